#!/usr/bin/env bash
# On the GPU machine (through the device tool): the GPU test and the benchmarks of
# docs/GPU.md. Expects the carried, compressed binaries in gpu-bin/ (see docs/GPU.md for
# how they are made) and writes results to $OUT.
#   scripts/gpu-check.sh [test|bench|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
unpack() { # name
  python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "gpu-bin/$1.xz" "/tmp/$1"
  chmod +x "/tmp/$1"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [ "$what" = test ] || [ "$what" = all ]; then
  unpack gpu-test
  /tmp/gpu-test --nocapture 2>&1 | tail -20 | tee "$out/gpu-test.txt"
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
