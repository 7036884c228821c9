#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: the lean setting (regional compilation + CUDA graphs + an activation
# memory budget of 0.8) benchmarked from a cold compiler cache, then trained on the reference recipe, so that
# compare.py (run afterwards on the returned results) checks it against the eager baseline s2-matched-baseline.
# Also the whole model at a budget of 0.9, between the default and 0.8.
set -uo pipefail
source scripts/device_env.sh
LEAN="--compile_scope=blocks --compile_mode=reduce-overhead --activation_memory_budget=0.8"
{
  timeout 200 python3 bench.py $REF --results_file=$R --name=s6-20m-lean-cold $LEAN --cold=True
  timeout 300 python3 train.py $REF --results_file=$R --name=s6-matched-lean $LEAN --log_interval=200
  timeout 200 python3 bench.py $REF --results_file=$R --name=s6-20m-budget0.9 --activation_memory_budget=0.9
} > "$OUT/s6.log" 2>&1
python3 scripts/summarize.py "$R" s6-
