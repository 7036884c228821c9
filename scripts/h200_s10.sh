#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: the fused loss's kernel (2.14 of the 20m update's 15.9 ms in
# s9-20m-profile, 1.9 TB/s) at its launch shapes (eight at the time) and as the previous commit had it
# (.carry/before); then the 20m default before and after its one-exp-per-element change, interleaved twice.
set -uo pipefail
source scripts/device_env.sh
{
  timeout 120 python3 scripts/ce_rows_sweep.py --name=s10-ce-rows-sweep --results_file=$R
  timeout 120 python3 scripts/ce_rows_sweep.py --name=s10-ce-rows-before --tree="$BEFORE" --results_file=$R
  interleaved s10-20m $REF
} > "$OUT/s10.log" 2>&1
grep -A9 "^launch" "$OUT/s10.log"
python3 scripts/summarize.py "$R" s10-
