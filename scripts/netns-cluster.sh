#!/usr/bin/env bash
# Two or more "machines" as Linux network namespaces on one bridge (root only), each
# running `shoal node` with default flags, for trying the cluster by hand:
#   scripts/netns-cluster.sh up N      # namespaces shoal-h1..hN, 10.231.0.1..N, nodes started
#   ip netns exec shoal-h1 target/release/shoal status
#   ip netns exec shoal-sw ip link set p2 down    # cut host 2's cable (and `up` again)
#   scripts/netns-cluster.sh down
# Node data and logs live in ${SHOAL_NETNS_DIR:-/tmp/shoal-netns}; host 1 gets the
# installed smollm2-135m from $SHOAL_HOME if there is one. The tests use crates/testbed,
# which also delays, rate-limits and cuts cables; this is the manual form.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${SHOAL_NETNS_DIR:-/tmp/shoal-netns}
shoal=$PWD/target/release/shoal
case "${1:-}" in
up)
  n=${2:-2}
  ip netns add shoal-sw
  ip netns exec shoal-sw ip link add br0 type bridge
  ip netns exec shoal-sw ip link set br0 up
  mkdir -p "$dir"
  "$shoal" keygen >"$dir/cluster.key"
  for i in $(seq 1 "$n"); do
    ip netns add "shoal-h$i"
    ip link add "e$i" netns "shoal-h$i" type veth peer name "p$i" netns shoal-sw
    ip netns exec "shoal-h$i" ip addr add "10.231.0.$i/24" dev "e$i"
    ip netns exec "shoal-h$i" ip link set "e$i" up
    ip netns exec "shoal-h$i" ip link set lo up
    ip netns exec shoal-sw ip link set "p$i" master br0
    ip netns exec shoal-sw ip link set "p$i" up
    mkdir -p "$dir/n$i"
  done
  home=${SHOAL_HOME:-$HOME/.cache/shoal}
  if [ -d "$home/models/smollm2-135m" ]; then
    mkdir -p "$dir/n1/models" && cp -r "$home/models/smollm2-135m" "$dir/n1/models/"
  fi
  for i in $(seq 1 "$n"); do
    ip netns exec "shoal-h$i" env SHOAL_LOG=info "$shoal" node \
      --cluster-key-file "$dir/cluster.key" --data-dir "$dir/n$i" --runner-threads 1 \
      >"$dir/n$i.log" 2>&1 &
  done
  echo "started $n nodes; logs in $dir"
  ;;
down)
  for ns in $(ip netns list | awk '/^shoal-h/ {print $1}'); do
    ip netns pids "$ns" | xargs -r kill -9
    ip netns del "$ns"
  done
  ip netns del shoal-sw 2>/dev/null || true
  ;;
*)
  echo "usage: $0 up [N] | down" >&2
  exit 2
  ;;
esac
