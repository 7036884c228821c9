#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: the fused SwiGLU as a triton_op (torch.compile launches its kernels
# from generated code; as an opaque custom op it made the 20m update host-bound in s12), against the previous
# commit (.carry/before): 20m interleaved twice, then 50m and 90m.
set -uo pipefail
source scripts/device_env.sh
BENCH_TIMEOUT=120
{
  interleaved s13-20m $REF
  pair s13-50m config/50m.py
  pair s13-90m config/90m.py
} > "$OUT/s13.log" 2>&1
python3 scripts/summarize.py "$R" s13-
