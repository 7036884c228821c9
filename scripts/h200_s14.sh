#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: SwiGLU fused with the down projection (backward recomputes the
# product instead of keeping it) against the previous commit (.carry/before), 20m interleaved twice; then the
# same tree with CUDA graphs and profiled; the reference recipe trained to the end (compare.py reads it
# afterwards against s2-matched-baseline); then 50m and 90m before and after.
set -uo pipefail
source scripts/device_env.sh
BENCH_TIMEOUT=120
{
  interleaved s14-20m $REF
  bench $REF --name=s14-20m-ro --compile_mode=reduce-overhead
  bench $REF --name=s14-20m-profile --profile=True
  timeout 200 python3 train.py $REF --results_file=$R --name=s14-matched --log_interval=500
  pair s14-50m config/50m.py
  pair s14-90m config/90m.py
} > "$OUT/s14.log" 2>&1
python3 scripts/summarize.py "$R" s14-
