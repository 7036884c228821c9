#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine, nothing else running: eager before and after the kernel-count
# changes, interleaved twice (eager is launch-bound, so its figure moves with whatever else uses the CPU);
# evaluation speed with the fused per-token loss against the full one, in short training runs; the final
# default config; a smaller loss slice for memory; and a profile of regional compilation.
set -uo pipefail
source scripts/device_env.sh
bench() { timeout 200 python3 bench.py $REF --results_file=$R "$@"; }
before() { (cd "$BEFORE" && timeout 200 python3 bench.py $REF --results_file=$R --data_dir=$DATA "$@"); }
{
  for round in 1 2; do
    before --name=s3-eager-before-$round --compile=False --micro_batch_size=8
    bench --name=s3-eager-after-$round --compile=False --micro_batch_size=8 --loss_impl=full
  done
  bench --name=s3-20m-default
  for impl in fused full; do
    timeout 200 python3 train.py $REF --results_file=$R --name=s3-eval-$impl --loss_impl=$impl --epochs=1 \
      --train_subset_tokens=3000000 --log_interval=100
  done
  bench --name=s3-20m-fused-slice4096 --loss_chunk_tokens=4096
  bench --name=s3-20m-blocks --compile_scope=blocks --profile=True
} > "$OUT/quiet.log" 2>&1
python3 scripts/summarize.py "$R" s3-
