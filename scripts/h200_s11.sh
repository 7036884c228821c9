#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: the fused loss's kernel at ten launch shapes (s10 found one exp per
# element saves a quarter, and 8,192-column pieces with 8 warps the fastest launch) and as the previous commit
# had it (.carry/before); then 20m (interleaved twice) and 50m before and after, the kernel at its new launch.
set -uo pipefail
source scripts/device_env.sh
{
  timeout 120 python3 scripts/ce_rows_sweep.py --name=s11-ce-rows-sweep --results_file=$R
  timeout 120 python3 scripts/ce_rows_sweep.py --name=s11-ce-rows-before --tree="$BEFORE" --results_file=$R
  interleaved s11-20m $REF
  pair s11-50m config/50m.py
} > "$OUT/s11.log" 2>&1
grep -A11 "^launch" "$OUT/s11.log"
python3 scripts/summarize.py "$R" s11-
