#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine (the host where eager missed 450K): where eager's host time goes;
# eager before and after one autocast region per update, interleaved twice; eager with the fused loss; the
# default config and a 4,096-token loss slice now that the fused op holds one slice of logits at a time;
# where the cold first update of regional compilation + CUDA graphs spends its seconds; 90m with CUDA graphs.
set -uo pipefail
source scripts/device_env.sh
bench() { timeout 200 python3 bench.py $REF --results_file=$R "$@"; }
before() { (cd "$BEFORE" && timeout 200 python3 bench.py $REF --results_file=$R --data_dir=$DATA "$@"); }
{
  timeout 100 python3 scripts/eager_cpu_profile.py $REF --compile=False --micro_batch_size=8 --loss_impl=full
  for round in 1 2; do
    before --name=s4-eager-before-$round --compile=False --micro_batch_size=8 --loss_impl=full
    bench --name=s4-eager-after-$round --compile=False --micro_batch_size=8 --loss_impl=full
  done
  bench --name=s4-eager-fused --compile=False --micro_batch_size=8
  bench --name=s4-20m-default
  bench --name=s4-20m-slice4096 --loss_chunk_tokens=4096
  timeout 150 python3 scripts/cold_start_profile.py $REF --compile_scope=blocks --compile_mode=reduce-overhead
  timeout 200 python3 bench.py config/90m.py --results_file=$R --name=s4-90m
  timeout 200 python3 bench.py config/90m.py --results_file=$R --name=s4-90m-ro --compile_mode=reduce-overhead
} > "$OUT/s4.log" 2>&1
grep -A30 "ms per update unprofiled" "$OUT/s4.log" | head -32
grep -B2 -A3 "first update:" "$OUT/s4.log"
python3 scripts/summarize.py "$R" s4-
