#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: SwiGLU as one Triton kernel each way (model.swiglu) against the
# previous commit (.carry/before), where Inductor's backward kernel took 0.96 of the 20m update's 15.9 ms.
# 20m interleaved twice, then 50m, 90m and eager 20m at micro-batch 8 once each, then a profile of the new 20m.
# Its figures in results/h200.json are of the op's first version, an opaque custom_op (commit message of the
# triton_op change and docs/PERFORMANCE.md); run now, it measures the current code.
set -uo pipefail
source scripts/device_env.sh
{
  interleaved s12-20m $REF
  pair s12-50m config/50m.py
  pair s12-90m config/90m.py
  pair s12-eager $REF --compile=False --micro_batch_size=8
  bench $REF --name=s12-20m-profile --profile=True
} > "$OUT/s12.log" 2>&1
python3 scripts/summarize.py "$R" s12-
