#!/usr/bin/env bash
# Side-by-side benchmark: shoal and llama.cpp on the same GGUF files, alternating, one
# model at a time: pp512 and tg128, median of REPEAT runs each.
#   scripts/bench-vs-llamacpp.sh [THREADS] [REPEAT] [MODEL...]
# Needs llama.cpp's tools (../shared/tools/llamacpp.sh builds them) and the models
# installed (`shoal pull NAME`); LLAMA_BENCH overrides the llama-bench path.
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-2}
repeat=${2:-3}
shift $(( $# > 2 ? 2 : $# ))
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b)
bench=${LLAMA_BENCH:-$HOME/.cache/llamacpp-anchor/build/bin/llama-bench}
cargo build --release -q -p shoal-cli
shoal=target/release/shoal
printf '| model | threads | shoal pp512 | llama.cpp pp512 | ratio | shoal tg128 | llama.cpp tg128 | ratio |\n|---|---|---|---|---|---|---|---|\n'
for m in "${models[@]}"; do
  path=$($shoal models --json | python3 -c "import json,sys; print(next(r['path'] for r in json.load(sys.stdin) if r['name']=='$m'))")
  [ "$path" != "None" ] || { echo "$m is not installed" >&2; continue; }
  # Alternate: llama.cpp, shoal, llama.cpp, shoal ... one run each, then take medians.
  lp=(); lt=(); sp=(); st=()
  for _ in $(seq "$repeat"); do
    out=$("$bench" -m "$path" -p 512 -n 128 -r 1 -t "$threads" -o json 2>/dev/null)
    lp+=("$(echo "$out" | python3 -c "import json,sys; r=json.load(sys.stdin); print(next(x['avg_ts'] for x in r if x['n_prompt']>0))")")
    lt+=("$(echo "$out" | python3 -c "import json,sys; r=json.load(sys.stdin); print(next(x['avg_ts'] for x in r if x['n_gen']>0))")")
    out=$($shoal bench --local -m "$path" --pp 512 --tg 128 --repeat 1 -t "$threads" --json 2>/dev/null)
    sp+=("$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['prompt_tps'])")")
    st+=("$(echo "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['generation_tps'])")")
  done
  python3 - "$m" "$threads" "${lp[*]}" "${lt[*]}" "${sp[*]}" "${st[*]}" <<'PY'
import statistics, sys
m, t, lp, lt, sp, st = sys.argv[1:7]
med = lambda s: statistics.median(float(x) for x in s.split())
lp, lt, sp, st = med(lp), med(lt), med(sp), med(st)
print(f"| {m} | {t} | {sp:.1f} | {lp:.1f} | {sp/lp:.2f} | {st:.1f} | {lt:.1f} | {st/lt:.2f} |")
PY
done
