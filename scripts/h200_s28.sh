#!/usr/bin/env bash
# One device call on the machine of h200_s27.sh, right after it (flash-attn-4 is installed there): Inductor's
# matmul autotuning (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1: Triton templates against cuBLAS for each matmul shape,
# the fastest kept), never measured before (the tune sweep's max-autotune candidate ran past its time limit),
# beside the default; then every lever that gained at once.
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
source scripts/device_env.sh
{
  bench $REF --name=s28-20m-default-1
  BENCH_TIMEOUT=420 TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 bench $REF --name=s28-20m-mm-autotune-1
  bench $REF --name=s28-20m-default-2
  TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 bench $REF --name=s28-20m-mm-autotune-2
} > "$OUT/s28.log" 2>&1
grep -E "autotun|AUTOTUNE|Error" "$OUT/s28.log" | tail -20
python3 scripts/summarize.py "$R" s28-
