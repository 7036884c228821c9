#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: where eager's host time goes with the fused loss; the activation
# memory budget beside the default (memory at micro-batch 32); the cold first update of regional compilation
# with CUDA graphs; eager at micro-batch 8 repeated (its figure moves with the host's CPU).
set -uo pipefail
source scripts/device_env.sh
bench() { timeout 200 python3 bench.py $REF --results_file=$R "$@"; }
{
  timeout 100 python3 scripts/eager_cpu_profile.py $REF --compile=False --micro_batch_size=8
  bench --name=s5-20m-default
  for budget in 0.8 0.6 0.4; do bench --name=s5-20m-budget$budget --activation_memory_budget=$budget; done
  bench --name=s5-20m-blocks-ro-cold --compile_scope=blocks --compile_mode=reduce-overhead --cold=True
  timeout 200 python3 bench.py config/90m.py --results_file=$R --name=s5-90m-budget0.6 --activation_memory_budget=0.6
  for round in 1 2 3; do bench --name=s5-eager-full-$round --compile=False --micro_batch_size=8 --loss_impl=full; done
  bench --name=s5-eager-fused --compile=False --micro_batch_size=8
} > "$OUT/s5.log" 2>&1
grep -A20 "ms per update unprofiled" "$OUT/s5.log" | head -22
python3 scripts/summarize.py "$R" s5-
