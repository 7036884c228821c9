#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: flash-attn-4 (FA4, through PyTorch's own registry: sdpa_backend=fa4)
# against the default attention (auto, which picks cuDNN), attention alone and the whole update, 20m and 50m.
# FA4's wheels are more than one call can carry: the call before this one carried the CUTLASS DSL's CUDA 13
# module (.fa4a/cutlass_ir.so.zst, 55 MB) to /tmp/fa4stash; this one carries .fa4b: the other wheels, the rest of
# that CUDA 13 wheel and the token cache (zstd, 28 MB instead of 50).
set -uo pipefail
mkdir -p data/cache && zstd -dcq .fa4b/gutenberg.tar.zst | tar -x || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fa4b/*.whl || exit 1
zstd -dcq .fa4b/cu13_rest.tar.zst | tar -x -C /tmp/site || exit 1
zstd -dcq /tmp/fa4stash/cutlass_ir.so.zst \
  > /tmp/site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so || exit 1
# --target skips the DSL's .pth file, which puts dsl_packages on the path; compiled kernels are kept on disk
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
source scripts/device_env.sh
BENCH_TIMEOUT=150
{
  python3 -c "import torch, flash_attn.cute, importlib.metadata as m; print('torch', torch.__version__, 'flash-attn-4', m.version('flash-attn-4'), 'cutlass-dsl', m.version('nvidia-cutlass-dsl'))"
  timeout 120 python3 scripts/attention_microbench.py --preset=20m --results_file=$R --name=s20-attention-20m
  for round in 1 2; do
    bench $REF --name=s20-20m-default-$round
    bench $REF --name=s20-20m-fa4-$round --sdpa_backend=fa4
  done
  bench config/50m.py --name=s20-50m-default
  bench config/50m.py --name=s20-50m-fa4 --sdpa_backend=fa4
  timeout 120 python3 scripts/attention_microbench.py --preset=50m --results_file=$R --name=s20-attention-50m
} > "$OUT/s20.log" 2>&1
grep -E "^(torch|cudnn|flash|fa4|efficient) " "$OUT/s20.log"
python3 scripts/summarize.py "$R" s20-
