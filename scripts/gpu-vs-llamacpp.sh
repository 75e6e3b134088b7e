#!/usr/bin/env bash
# On the GPU machine (through the device tool): shoal and llama.cpp's CUDA build side by
# side on the same generated GGUF files, on the same GPU, in one call.
#   scripts/gpu-vs-llamacpp.sh [SHAPE:DTYPE ...]   default: the four rows of docs/GPU.md
#   DEPTHS="0 512:1024 4096 8192" scripts/gpu-vs-llamacpp.sh llama-8b:bf16
#       generation (tg128, or the count after the colon) after that many tokens of
#       context (0: the pp512 / tg128 row)
# Expects gpu-bin/shoal.xz (scripts/build-cuda.sh) and gpu-bin/llama-bench.xz (from
# ../shared/tools/llamacpp-cuda.sh, copied there), carried; writes $OUT/$NAME.md and
# $OUT/$NAME.jsonl (NAME default side-by-side). REPEAT (default 3) runs each, medians.
# With gpu-bin/gpu-test.xz carried too, the GPU tests run first and a failure stops the
# call: $OUT/gpu-test.txt. (The three no longer fit the 64 MiB carry beside the working
# tree, ~71 MB in all on 2026-12-06: run the tests in a call of their own just before,
# on the same warm machine.) KEEP=1 leaves each model file in
# /tmp for a later command of the same call (scripts/gpu-check.sh's KEEP=1 finds it).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
out=${OUT:-/tmp/out}
repeat=${REPEAT:-3}
mkdir -p "$out"
# gpu-bin/all.tar.xz (scripts/build-cuda.sh's PACK=1: the binaries in one solid archive,
# smaller than apart) is unpacked into /tmp, where `unpack` then finds them.
[ ! -e gpu-bin/all.tar.xz ] || tar xJf gpu-bin/all.tar.xz -C /tmp
unpack() { # name
  [ -e "gpu-bin/$1.xz" ] || { [ -x "/tmp/$1" ] && return; }
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "gpu-bin/$1.xz" "/tmp/$1"
  chmod +x "/tmp/$1"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ -e gpu-bin/gpu-test.xz ]; then
  unpack gpu-test
  /tmp/gpu-test --nocapture --test-threads=1 >"$out/gpu-test.txt" 2>&1 || {
    tail -30 "$out/gpu-test.txt"
    echo "GPU tests failed: no side-by-side"
    exit 1
  }
  grep "test result" "$out/gpu-test.txt"
fi
unpack shoal
unpack llama-bench
rows=("$@")
[ ${#rows[@]} -gt 0 ] || rows=(llama-8b:bf16 llama-8b:q4k qwen2.5-1.5b:bf16 qwen2.5-1.5b:q4k)
name=${NAME:-side-by-side}   # what the results are called in $OUT
jsonl=$out/$name.jsonl
: >"$jsonl"
# llama-bench's JSON: tokens/s of its prompt test and of its generation test.
llama() { # file pp tg depth
  /tmp/llama-bench -m "$1" -ngl 99 -p "$2" -n "$3" -d "$4" -r "$repeat" -o json 2>>"$out/llama-err.txt" |
    python3 -c "
import json, sys
r = json.load(sys.stdin)
pp = next((x['avg_ts'] for x in r if x['n_prompt'] > 0 and x['n_gen'] == 0), None)
tg = next((x['avg_ts'] for x in r if x['n_gen'] > 0 and x['n_prompt'] == 0), None)
print(json.dumps({'pp': pp, 'tg': tg}))"
}
shoal() { # file pp tg depth
  local ctx=$(( $2 > $4 + $3 ? $2 : $4 + $3 ))
  ctx=$(( ctx < 4096 ? 4096 : ctx + 64 ))
  /tmp/shoal bench --local -m "$1" --device cuda:0 --ctx "$ctx" --pp "$2" --tg "$3" --depth "$4" \
    -r "$repeat" --json 2>>"$out/shoal-err.txt" | tail -1 |
    python3 -c "
import json, sys
r = json.load(sys.stdin)
print(json.dumps({'pp': r['prompt_tps'] or None, 'tg': r['generation_tps'] or None}))"
}
for row in "${rows[@]}"; do
  IFS=: read -r shape dt <<<"$row"
  file=/tmp/$shape-$dt.gguf
  [ -e "$file" ] || /tmp/shoal synth --shape "$shape" --dtype "$dt" --out "$file" >/dev/null ||
    { echo "synth $row failed"; continue; }
  for item in ${DEPTHS:-0}; do
    IFS=: read -r depth tg <<<"$item"
    tg=${tg:-128}
    if [ "$depth" = 0 ]; then pp=512; else pp=0; fi
    l=$(llama "$file" "$pp" "$tg" "$depth")
    s=$(shoal "$file" "$pp" "$tg" "$depth")
    echo "{\"shape\":\"$shape\",\"dtype\":\"$dt\",\"depth\":$depth,\"tg\":$tg,\"llama\":${l:-null},\"shoal\":${s:-null}}" | tee -a "$jsonl"
  done
  [ -n "${KEEP:-}" ] || rm -f "$file"
done
python3 - "$jsonl" <<'EOF' | tee "$out/$name.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def f(v):
    return "—" if v is None else f"{v:,.1f}"
def ratio(a, b):
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}×"
print("| shape / weights | depth | llama.cpp pp512 | shoal pp512 | ratio | generation | llama.cpp | shoal | ratio |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    l, s = r["llama"] or {}, r["shoal"] or {}
    print(f"| {r['shape']} {r['dtype']} | {r['depth']} | {f(l.get('pp'))} | {f(s.get('pp'))} | "
          f"{ratio(s.get('pp'), l.get('pp'))} | tg{r.get('tg', 128)} | {f(l.get('tg'))} | {f(s.get('tg'))} | "
          f"{ratio(s.get('tg'), l.get('tg'))} |")
EOF
