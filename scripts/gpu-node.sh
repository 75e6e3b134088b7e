#!/usr/bin/env bash
# On the GPU machine (through the device tool): a node serving through a GPU rank, the
# way a user runs one, and the runner's steps summed by kind. The machine cannot reach
# the model store and no catalog model fits a call's carry, so a `shoal synth` file
# stands in for qwen2.5-coder-1.5b: qwen2.5-1.5b's shape in Q4_K, padded to the catalog
# file's size and installed under its name with the card's digest as its marker (the
# store checks the marker and the size; the runner reads the GGUF, whose tensors end
# before the padding).
# Expects gpu-bin/shoal.xz (scripts/build-cuda.sh) carried, or /tmp/shoal; writes
# $OUT/node.log, bench-node.txt, steps.txt, ways.txt, status.txt, metrics.txt.
#   CONCURRENCY (default 1,8,32), REPEAT (default 2)
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
S=/tmp/shoal
if [ -e gpu-bin/shoal.xz ]; then
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" gpu-bin/shoal.xz $S
  chmod +x $S
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
data=/tmp/nd-gpu model=qwen2.5-coder-1.5b
mkdir -p "$data/models/$model"
file=$data/models/$model/qwen2.5-coder-1.5b-instruct.gguf
$S synth --shape qwen2.5-1.5b --dtype q4k --out "$file" && truncate -s 1117320768 "$file"
printf %s cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 >"$data/models/$model/.sha256"
SHOAL_LOG=info,shoal_runner=debug $S node --data-dir "$data" --no-mdns >"$out/node.log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null' EXIT
for _ in $(seq 1 60); do curl -s 127.0.0.1:52415/health >/dev/null && break; sleep 0.5; done
for _ in $(seq 1 30); do $S place $model --ctx 4096 >"$out/place.txt" 2>&1 && break; sleep 1; done
cat "$out/place.txt"
# Ready: a one-token answer comes back.
for _ in $(seq 1 120); do
  $S bench --node 127.0.0.1:52415 -m $model --concurrency 1 --pp 16 --tg 2 --repeat 1 >/dev/null 2>&1 && break
  sleep 1
done
$S status >"$out/status.txt" 2>&1
cat "$out/status.txt"
$S bench --node 127.0.0.1:52415 -m $model --concurrency "${CONCURRENCY:-1,8,32}" --pp 64 --tg 64 \
  --repeat "${REPEAT:-2}" --warmup 2>&1 | tee "$out/bench-node.txt"
curl -s 127.0.0.1:52415/metrics >"$out/metrics.txt"
kill $node; wait $node 2>/dev/null
grep -a "warmed up\|warming" "$out/node.log"
# Steps by (decode rows, prompt tokens): how many, mean ms.
sed 's/\x1b\[[0-9;]*m//g' "$out/node.log" | grep " step decoding=" | awk '{
  for (i = 1; i <= NF; i++) { split($i, a, "="); v[a[1]] = a[2] }
  p = v["prompt_tokens"]; b = p == 0 ? "0" : p <= 4 ? "1-4" : p <= 64 ? "5-64" : ">64"
  k = v["decoding"] " decode rows, " b " prompt tokens"; n[k]++; s[k] += v["ms"]
} END { for (k in n) printf "%s: %d steps, %.2f ms\n", k, n[k], s[k] / n[k] }' | sort -n | tee "$out/steps.txt"
# Steps of decode rows only, by the way the rank ran them (`DecodeWays`): how many, mean ms.
sed 's/\x1b\[[0-9;]*m//g' "$out/node.log" | grep "decode rows on the GPU" | awk '{
  for (i = 1; i <= NF; i++) { split($i, a, "="); v[a[1]] = a[2] }
  k = v["way"] " of " v["rows"] " rows"; n[k]++; s[k] += v["ms"]
} END { for (k in n) printf "%s: %d steps, %.2f ms\n", k, n[k], s[k] / n[k] }' | sort -k3n | tee "$out/ways.txt"
