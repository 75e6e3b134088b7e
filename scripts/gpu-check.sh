#!/usr/bin/env bash
# On the GPU machine (through the device tool): the GPU test and the benchmarks of
# docs/GPU.md. Expects the carried, compressed binaries in gpu-bin/ (see docs/GPU.md for
# how they are made) and writes results to $OUT.
# KEEP=1 keeps each synthesized model in /tmp for the next mode of the same call.
#   scripts/gpu-check.sh [test|bench|all]       one GPU
#   scripts/gpu-check.sh decode [SHAPE:DTYPE...] one GPU: each row's decode under shoal's
#       graph-captured kernels, the same kernels launched one by one, and candle's path
#       (SHOAL_CUDA_GRAPHS=0, SHOAL_GPU_DECODE=candle): where a token's time goes;
#       MODES="graphs split1 split2 split4" instead compares warps per mat-vec row,
#       MODES="graphs nopdl" programmatic dependent launch on and off, MODES="graphs late"
#       bf16 weight rows' first loads before the wait for the kernel ahead (default) or after
#       MODES="graphs apart": rope and the KV append in the bf16 q/k/v projection (default)
#       or in a kernel of their own; MODES="graphs keys1 warps4 keys1warps4" the attention
#       kernel's keys a warp at a time (4 by default) and warps a block (8);
#       MODES="graphs dispatch splits64 dispatch64" the attention kernel compiled per group
#       size (default) or one for every group, and its splits one wave of blocks (default)
#       or 64; MODES="graphs nocluster cluster8" attention and its merge as one kernel of
#       thread-block clusters for caches up to 64 positions a block (default, 16 blocks a
#       KV head), off, or 8 blocks a KV head; MODES="graphs nopairs" dense mat-vecs two
#       rows a team (default) or one; split8 teams of 8 warps a row, split-STAGE:N[,...]
#       N warps a row of one stage's matrices (stages as omit- names them); noprefetch: the
#       attention's run of the cache not asked of L2 before its wait; next: the output
#       projection's weights asked of L2 by the attention (off by default); fuse: the
#       output projection in the cluster attention kernel (off by default: a mat-vec of
#       its own); staged: the output projection's weights staged in shared memory
#       before its wait for the attention (off by default; staged-nocarveout: without
#       asking every kernel for the SM's largest shared memory); chain: greedy
#       generation with each step's arg-max feeding the next on
#       the device (the default since 2026-12-07); step: a token at a time through the
#       host instead; lean: the bf16
#       mat-vecs held to 64 registers a thread (8 blocks an SM); timing only (the answers
#       are wrong): repeat2 replays the graph twice a token (the difference is the graph's
#       own time), omit-STAGE[,STAGE] leaves qkv, attn, o, gate_up, down or head out
#   scripts/gpu-check.sh profile [SHAPE:DTYPE...] one GPU: Nsight Compute's time and DRAM
#       bytes of every kernel of a few decode tokens (launched one by one), summed per
#       kernel and per token: $OUT/profile-SHAPE-DTYPE.csv and profile.md; PROFILE=prefill:
#       every kernel of one 512-token prompt instead; DEPTH=N: the decode kernels after N
#       tokens of context (COUNT of them, default 1200) instead of after a 512-token prompt;
#       PROFILE=detail: two layers' kernels with Nsight Compute's memory, occupancy and
#       warp-stall sections, $OUT/detail-SHAPE-DTYPE.csv
#   scripts/gpu-check.sh batch [SHAPE:DTYPE...] one GPU: generation of BATCHES (default
#       "1 8 32") sequences decoding together (bench --local --batch), total tok/s:
#       $OUT/batch.jsonl
#   scripts/gpu-check.sh depth [SHAPE:DTYPE...] one GPU: generation after DEPTHS (default
#       "0 512 2048 4096 8000") tokens of context (bench --local --depth): $OUT/depth.jsonl;
#       MODES as for decode (default graphs), e.g. MODES="graphs keys1 warps4"
#   scripts/gpu-check.sh nccl [SHAPE DTYPE...]  several GPUs: the NCCL test, the
#       all-reduce times, and for each SHAPE:DTYPE[:LAYERS] (default llama-8b:bf16
#       llama-8b:q4k) the benchmark on 1, 2, 4, 8 GPUs as the machine has them.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
# gpu-bin/all.tar.xz (scripts/build-cuda.sh's PACK=1: the binaries in one solid archive,
# smaller than apart) is unpacked into /tmp, where `unpack` then finds them.
[ ! -e gpu-bin/all.tar.xz ] || tar xJf gpu-bin/all.tar.xz -C /tmp
unpack() { # name
  [ -e "gpu-bin/$1.xz" ] || { [ -x "/tmp/$1" ] && return; }
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "gpu-bin/$1.xz" "/tmp/$1"
  chmod +x "/tmp/$1"
}
# The environment of a decode variant (MODES) into the array env.
mode_env() { # mode
  case $1 in
    graphs) env=() ;;
    eager) env=(SHOAL_CUDA_GRAPHS=0) ;;
    candle) env=(SHOAL_GPU_DECODE=candle) ;;
    split1 | split2 | split4) env=(SHOAL_GPU_SPLIT=${1#split}) ;;
    nopdl) env=(SHOAL_GPU_PDL=0) ;;
    late) env=(SHOAL_GPU_LATE=1) ;;
    apart) env=(SHOAL_GPU_ROPE=apart) ;;
    keys1) env=(SHOAL_GPU_KEYS=1) ;;
    warps4) env=(SHOAL_GPU_ATTN_WARPS=4) ;;
    keys1warps4) env=(SHOAL_GPU_KEYS=1 SHOAL_GPU_ATTN_WARPS=4) ;;
    dispatch) env=(SHOAL_GPU_ATTN=dispatch) ;;
    splits64) env=(SHOAL_GPU_ATTN_SPLITS=64) ;;
    dispatch64) env=(SHOAL_GPU_ATTN=dispatch SHOAL_GPU_ATTN_SPLITS=64) ;;
    nocluster) env=(SHOAL_GPU_ATTN_CLUSTER=0) ;;
    nopairs) env=(SHOAL_GPU_PAIRS=0) ;;
    cluster8) env=(SHOAL_GPU_ATTN_CLUSTER=8) ;;
    split8) env=(SHOAL_GPU_SPLIT=8) ;;
    split-*) env=(SHOAL_GPU_SPLIT=${1#split-}) ;;
    noprefetch) env=(SHOAL_GPU_ATTN_PREFETCH=0) ;;
    next) env=(SHOAL_GPU_PREFETCH_NEXT=1) ;;
    fuse) env=(SHOAL_GPU_FUSE_O=1) ;;
    staged) env=(SHOAL_GPU_STAGED=1) ;;
    staged-nocarveout) env=(SHOAL_GPU_STAGED=1 SHOAL_GPU_CARVEOUT=0) ;;
    repeat2) env=(SHOAL_GPU_REPEAT=2) ;;
    chain) env=(SHOAL_GPU_CHAIN=1) ;;
    step) env=(SHOAL_GPU_CHAIN=0) ;;
    lean) env=(SHOAL_GPU_LEAN=1) ;;
    omit-*) env=(SHOAL_GPU_OMIT=${1#omit-}) ;;
    *) echo "unknown mode $1" >&2; exit 2 ;;
  esac
}
# The synthesized model of SHAPE and DTYPE, made unless an earlier mode kept it (KEEP=1).
model_file() { # shape dtype -> path
  local file=/tmp/$1-$2.gguf
  [ -e "$file" ] || /tmp/shoal synth --shape "$1" --dtype "$2" --out "$file" >/dev/null
  echo "$file"
}
done_with() { # file
  [ -n "${KEEP:-}" ] || rm -f "$1"
}
# Runs a `bench --json` command line and appends {FIELDS, "bench": its JSON} to
# $out/NAME.jsonl; when it fails, shows its error's tail.
record() { # name fields command...
  local name=$1 fields=$2 line
  shift 2
  line=$("$@" 2>"$out/$name-err.txt" | tail -1)
  echo "{$fields,\"bench\":${line:-null}}" | tee -a "$out/$name.jsonl"
  [ -n "$line" ] || tail -5 "$out/$name-err.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [ "$what" = test ] || [ "$what" = all ]; then
  unpack gpu-test
  /tmp/gpu-test --nocapture --test-threads=1 2>&1 | tail -20 | tee "$out/gpu-test.txt"
  # The tests' contexts are short: the attention's two-kernel path (long caches) as well.
  SHOAL_GPU_ATTN_CLUSTER=0 /tmp/gpu-test --nocapture --test-threads=1 2>&1 | tail -20 | tee "$out/gpu-test-nocluster.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  unpack shoal
  for shape in qwen2.5-1.5b llama-8b; do
    for dt in bf16 q4k; do
      /tmp/shoal synth --shape "$shape" --dtype "$dt" --out "/tmp/$shape-$dt.gguf" | tee -a "$out/bench.txt"
      /tmp/shoal bench --local -m "/tmp/$shape-$dt.gguf" --device cuda:0 --ctx 4096 \
        --pp 512 --tg 128 -r 3 --json 2>&1 | tail -1 | tee -a "$out/bench.jsonl"
      rm -f "/tmp/$shape-$dt.gguf"
    done
  done
fi
if [ "$what" = nccl ]; then
  shift
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  nvidia-smi topo -m | tee "$out/topo.txt"
  unpack gpus-test
  unpack shoal
  if [ -z "${SKIP_TESTS:-}" ]; then
    /tmp/gpus-test --nocapture 2>&1 | tail -25 | tee "$out/gpus-test.txt"
    /tmp/gpus-test --ignored nccl_all_reduce_time --nocapture 2>&1 | grep -E 'us per|test result' | tee "$out/all-reduce.txt"
  fi
  for item in "${@:-llama-8b:bf16 llama-8b:q4k}"; do
    for one in $item; do
      IFS=: read -r shape dt layers <<<"$one"
      file=/tmp/$shape-$dt${layers:+-$layers}.gguf
      /tmp/shoal synth --shape "$shape" --dtype "$dt" ${layers:+--layers $layers} --out "$file" >/dev/null
      for n in 1 2 4 8; do
        [ "$n" -le "$gpus" ] || continue
        if [ "$n" = 1 ]; then dev=(--device cuda:0); else dev=(--ranks "$n" --strategy tensor --device cuda); fi
        start=$(date +%s)
        line=$(/tmp/shoal bench --local -m "$file" "${dev[@]}" --ctx 4096 --pp 512 --tg 128 -r 3 --json 2>"$out/bench-err.txt" | tail -1)
        echo "{\"shape\":\"$shape\",\"dtype\":\"$dt\",\"layers\":\"${layers:-all}\",\"gpus\":$n,\"seconds\":$(( $(date +%s) - start )),\"bench\":${line:-null}}" | tee -a "$out/nccl-bench.jsonl"
        [ -n "$line" ] || tail -5 "$out/bench-err.txt"
      done
      [ -n "${KEEP:-}" ] || rm -f "$file"
    done
  done
fi
if [ "$what" = decode ]; then
  shift
  unpack shoal
  for one in ${@:-qwen2.5-1.5b:bf16 qwen2.5-1.5b:q4k llama-8b:bf16 llama-8b:q4k}; do
    IFS=: read -r shape dt <<<"$one"
    file=$(model_file "$shape" "$dt")
    for mode in ${MODES:-graphs eager candle}; do
      mode_env "$mode"
      record decode "\"shape\":\"$shape\",\"dtype\":\"$dt\",\"decode\":\"$mode\"" \
        env "${env[@]}" /tmp/shoal bench --local -m "$file" --device cuda:0 --ctx 4096 \
        --pp 512 --tg 128 -r 3 --json
    done
    done_with "$file"
  done
fi
if [ "$what" = batch ]; then
  shift
  unpack shoal
  for one in ${@:-llama-8b:bf16}; do
    IFS=: read -r shape dt <<<"$one"
    file=$(model_file "$shape" "$dt")
    for b in ${BATCHES:-1 8 32}; do
      record batch "\"shape\":\"$shape\",\"dtype\":\"$dt\",\"batch\":$b" \
        /tmp/shoal bench --local -m "$file" --device cuda:0 --ctx 4096 --pp 0 \
        --tg "${TG:-64}" -r 1 --batch "$b" --json
    done
    done_with "$file"
  done
fi
if [ "$what" = depth ]; then
  shift
  unpack shoal
  for one in ${@:-llama-8b:bf16}; do
    IFS=: read -r shape dt <<<"$one"
    file=$(model_file "$shape" "$dt")
    for mode in ${MODES:-graphs}; do
      mode_env "$mode"
      for d in ${DEPTHS:-0 512 2048 4096 8000}; do
        record depth "\"shape\":\"$shape\",\"dtype\":\"$dt\",\"depth\":$d,\"decode\":\"$mode\"" \
          env "${env[@]}" /tmp/shoal bench --local -m "$file" --device cuda:0 --ctx 8192 \
          --pp 0 --tg "${TG:-128}" -r 2 --depth "$d" --json
      done
    done
    done_with "$file"
  done
fi
if [ "$what" = profile ]; then
  shift
  unpack shoal
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  for one in ${@:-qwen2.5-1.5b:q4k llama-8b:bf16 llama-8b:q4k}; do
    IFS=: read -r shape dt <<<"$one"
    file=$(model_file "$shape" "$dt")
    tag=
    if [ "${PROFILE:-decode}" = prefill ]; then
      # Every kernel of one 512-token prompt (the warm-up run; no generation).
      select=(--launch-count "${COUNT:-3000}") run=(--pp 512 --tg 0 -r 0)
    else
      # Decode kernels only (shoal_*), launched eagerly, past the first 1200 (a few
      # tokens): the prompt (candle's path) launches none of them.
      select=(--kernel-name regex:shoal_ --launch-skip 1200 --launch-count "${COUNT:-1200}")
      run=(--pp 512 --tg 64 -r 1)
      if [ "${PROFILE:-decode}" = detail ]; then
        # Two layers' decode kernels, each with Nsight Compute's sections on where its
        # time goes (memory, occupancy, warp stalls): $out/detail-SHAPE-DTYPE.csv.
        SHOAL_CUDA_GRAPHS=0 timeout "${PROFILE_TIMEOUT:-300}" "$ncu" --clock-control none \
          --kernel-name 'regex:^shoal_(attention|matvec|gate_up|qkv_rope)' \
          --launch-skip 400 --launch-count "${COUNT:-10}" --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
          --section LaunchStats --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_wait \
          --csv --page details /tmp/shoal bench --local -m "$file" --device cuda:0 --ctx 2048 \
          --pp 512 --tg 16 -r 0 >"$out/detail-$shape-$dt.csv" 2>"$out/profile-err.txt"
        echo "ncu exit $? for $one"; tail -3 "$out/profile-err.txt"
        done_with "$file"
        continue
      fi
      if [ -n "${DEPTH:-}" ]; then
        # The prompt's own kernels (prefill.cu) are named shoal_ too: only decode's.
        select=(--kernel-name 'regex:^shoal_(attention|attn_merge|matvec|gate_up|qkv_rope|rope_append)'
          --launch-skip 400 --launch-count "${COUNT:-1200}")
        run=(--pp 0 --tg 64 -r 0 --depth "$DEPTH")
        tag=-d$DEPTH
      fi
    fi
    SHOAL_CUDA_GRAPHS=0 timeout "${PROFILE_TIMEOUT:-300}" "$ncu" --clock-control none "${select[@]}" \
      --csv --page raw --print-units base \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
      /tmp/shoal bench --local -m "$file" --device cuda:0 --ctx $(( ${DEPTH:-0} + 2048 )) "${run[@]}" \
      >"$out/profile-$shape-$dt$tag.csv" 2>"$out/profile-err.txt"
    echo "ncu exit $? for $one"; tail -3 "$out/profile-err.txt"
    done_with "$file"
  done
  python3 - "$out" <<'PY' | tee "$out/profile.md"
import csv, glob, io, os, sys
from collections import defaultdict
for path in sorted(glob.glob(os.path.join(sys.argv[1], "profile-*.csv"))):
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        print(f"{path}: no kernels profiled"); continue
    rows = list(csv.DictReader(io.StringIO(text[start:])))[1:]  # the second row: units
    per = defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0])
    num = lambda r, m: float((r.get(m) or "0").replace(",", "") or 0)
    for r in rows:
        k = r["Kernel Name"].split("(")[0]
        t = num(r, "gpu__time_duration.sum")
        b = num(r, "dram__bytes_read.sum")
        per[k][0] += 1; per[k][1] += t; per[k][2] += b
        per[k][3] = max(per[k][3], int(num(r, "launch__registers_per_thread")))
        per[k][4] += num(r, "sm__warps_active.avg.pct_of_peak_sustained_active")
    total = sum(v[1] for v in per.values())
    print(f"### {os.path.basename(path)}: {len(rows)} kernels, {total/1e3:,.0f} us of kernel time")
    print("| kernel | launches | us total | us each | GB/s | share | registers | occupancy |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (n, t, b, regs, occ) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n} | {t/1e3:,.1f} | {t/n/1e3:.2f} | {b/t if t else 0:,.0f} | {100*t/total:.1f}% | {regs} | {occ/n:.0f}% |")
PY
fi
if [ "$what" = kill ]; then
  # A rank killed mid-generation: rank 0 must fail with a clear error, soon.
  unpack shoal
  file=/tmp/kill.gguf
  /tmp/shoal synth --shape llama-8b --dtype q4k --layers 8 --out "$file" >/dev/null
  /tmp/shoal run -m "$file" --ranks 2 --device cuda --raw -n 100000 "once upon a time" \
    >"$out/kill-out.txt" 2>"$out/kill-err.txt" &
  parent=$!
  for _ in $(seq 600); do # until it generates
    [ "$(wc -c <"$out/kill-out.txt")" -gt 200 ] && break
    sleep 0.1
  done
  child=$(pgrep -f "shoal rank --rank 1" | head -1)
  echo "killing rank 1 (pid $child) of $parent" | tee "$out/kill.txt"
  t0=$(date +%s.%N); kill -9 "$child"
  wait "$parent"; rc=$?
  t1=$(date +%s.%N)
  echo "rank 0 exit $rc after $(python3 -c "print(round($t1-$t0,2))") s; output bytes $(wc -c <"$out/kill-out.txt")" | tee -a "$out/kill.txt"
  tail -3 "$out/kill-err.txt" | tee -a "$out/kill.txt"
  pgrep -fa "shoal" | tee -a "$out/kill.txt"
fi
