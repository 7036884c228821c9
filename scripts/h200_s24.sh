#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine, after h200_s21.sh and the inline calls s22 and s23: attention's kernel
# times alone per kernel (the microbench now times kernels, not the host), evaluation with sdpa_backend=fa4 now
# that forward-only passes go to SDPA, and the 20m default against fa4 once more. Set up as h200_s21.sh is.
set -uo pipefail
source scripts/device_fa4.sh
source scripts/device_env.sh
RO=--compile_mode=reduce-overhead
{
  for preset in 20m 50m; do
    timeout 120 python3 scripts/attention_microbench.py --preset=$preset --results_file=$R --name=s24-attention-$preset
  done
  timeout 100 python3 scripts/eval_speed.py $REF --results_file=$R --name=s24-eval-speed-fa4-ro --sdpa_backend=fa4 $RO --passes=3
  bench $REF --name=s24-20m-default
  bench $REF --name=s24-20m-fa4 --sdpa_backend=fa4
} > "$OUT/s24.log" 2>&1
grep -E "^(cudnn|flash|fa4|efficient|unpinned|prefetched)" "$OUT/s24.log"
python3 scripts/summarize.py "$R" s24-
