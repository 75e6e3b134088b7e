#!/usr/bin/env bash
# Builds `shoal` with candle's CUDA backend on a machine without a GPU, for a GPU machine
# with driver 580 / CUDA 13.0 (see ../shared/GPU.md for why each step is there):
#   scripts/build-cuda.sh            -> target-cuda/release/shoal (and shoal.zst)
# 1. CUDA 13.0's compiler from PyPI wheels into .cuda/ (nvvm pinned: a newer one emits
#    PTX the 13.0 ptxas refuses).
# 2. Link-time stubs for the driver libraries that are not in the wheels (libcuda,
#    libnvrtc, libcurand, libcublas, libcublasLt, libnccl): the real ones are loaded by
#    SONAME on the GPU machine.
# 3. cargo build --features cuda,nccl into target-cuda/ (the CPU build's target/ stays).
# The first build compiles candle's kernels: about 15 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
if [ ! -x .cuda/bin/pip ]; then
  python3 -m venv .cuda
fi
.cuda/bin/pip install -q "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
  "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*"
NV=$(echo "$PWD"/.cuda/lib/python3.*/site-packages/nvidia/cu13)
export PATH=$NV/bin:$PATH CUDA_ROOT=$NV CUDA_PATH=$NV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# nvcc looks for its own tools and headers next to it.
export NVCC_PREPEND_FLAGS="${NVCC_PREPEND_FLAGS:-} -I$NV/include"

stubs=$PWD/stubs
mkdir -p "$stubs"
[ -e "$stubs/libcudart.so" ] || ln -sf "$NV"/lib/libcudart.so.13 "$stubs/libcudart.so"

build() {
  LIBRARY_PATH=$stubs${LIBRARY_PATH:+:$LIBRARY_PATH} cargo build --release -p shoal-cli --features cuda,nccl "$@"
}

# The first attempt compiles everything and may fail only at the link, for want of the
# stubs; the symbols it needs are then read from the built objects.
if ! build 2>"$CARGO_TARGET_DIR.link.log"; then
  grep -q "undefined reference\|cannot find -l\|unable to find library" "$CARGO_TARGET_DIR.link.log" || {
    cat "$CARGO_TARGET_DIR.link.log" >&2
    exit 1
  }
fi
undef=$(mktemp)
nm -u "$CARGO_TARGET_DIR"/release/deps/*.rlib "$CARGO_TARGET_DIR"/release/build/candle-kernels-*/out/*.a 2>/dev/null \
  | awk '{print $NF}' | sort -u > "$undef"
stub() { # name soname pattern [exclude]
  local name=$1 soname=$2 pattern=$3 exclude=${4:-^$}
  grep -E "$pattern" "$undef" | grep -vE "$exclude" | sed 's/.*/void &(void){}/' > "$stubs/$name.c" || true
  echo 'void shoal_stub_marker(void){}' >> "$stubs/$name.c"
  gcc -shared -fPIC -o "$stubs/$name.so" -Wl,-soname,"$soname" "$stubs/$name.c"
}
stub libcuda libcuda.so.1 '^cu[A-Z]'
stub libnvrtc libnvrtc.so.13 '^nvrtc'
stub libcurand libcurand.so.10 '^curand'
stub libcublasLt libcublasLt.so.13 '^cublasLt'
stub libcublas libcublas.so.13 '^cublas' '^cublasLt'
stub libnccl libnccl.so.2 '^nccl'
rm -f "$undef"
build
# The GPU tests as binaries of their own: one GPU against the CPU
# (crates/model/tests/gpu.rs), NCCL tensor parallelism (crates/runner/tests/gpus.rs).
test_bin() { # package features test
  LIBRARY_PATH=$stubs cargo test --release -p "$1" --features "$2" --test "$3" --no-run \
    --message-format=json 2>/dev/null | python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['target']['name'] == sys.argv[1]:
        print(m['executable'])" "$3"
}
gpu_test=$(test_bin shoal-model cuda gpu)
gpus_test=$(test_bin shoal-runner nccl gpus)
# Stripped and xz-compressed copies for the device tool's 64 MiB carry (gpu-bin/).
mkdir -p gpu-bin
strip -o gpu-bin/shoal "$CARGO_TARGET_DIR/release/shoal"
strip -o gpu-bin/gpu-test "$gpu_test"
strip -o gpu-bin/gpus-test "$gpus_test"
xz -6 -T0 -f gpu-bin/shoal gpu-bin/gpu-test gpu-bin/gpus-test
ls -la gpu-bin
# PACK=1: shoal, gpu-test and llama.cpp's llama-bench (LLAMA_BENCH, by default the one
# ../shared/tools/llamacpp-cuda.sh left) in one solid archive, gpu-bin/all.tar.xz: ~53 MB
# against ~61 MB apart, so the GPU tests and the side-by-side fit one call's carry (~5
# minutes of one core). Carry gpu-bin with all.tar.xz alone in it.
if [ "${PACK:-0}" != 0 ]; then
  pack=$(mktemp -d)
  xz -dc gpu-bin/shoal.xz >"$pack/shoal"
  xz -dc gpu-bin/gpu-test.xz >"$pack/gpu-test"
  xz -dc "${LLAMA_BENCH:-$HOME/.cache/llamacpp-cuda/llama-bench.xz}" >"$pack/llama-bench"
  chmod +x "$pack"/*
  tar cf - -C "$pack" shoal gpu-test llama-bench |
    xz -9e --lzma2=preset=9e,dict=256MiB -T1 >gpu-bin/all.tar.xz
  rm -rf "$pack"
  ls -la gpu-bin/all.tar.xz
fi
