#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine, after h200_s15.sh made CUDA graphs the 20m config's default: the
# recipe trained at two more seeds, one per GPU at once (s14-matched and s15-matched-ro ended 0.017 to 0.018
# above the eager baseline, inside the tolerance but near its edge; seeds 1338 and 1339 of the first session's
# code ended at 4.6009 and 4.6015), then DDP on both GPUs with and without CUDA graphs (the README's torchrun
# line uses this config).
set -uo pipefail
source scripts/device_env.sh
for seed in 1338 1339; do
  CUDA_VISIBLE_DEVICES=$((seed - 1338)) timeout 240 python3 train.py $REF --results_file=$R \
    --name=s16-seed-$seed --seed=$seed --log_interval=500 > "$OUT/s16-seed-$seed.log" 2>&1 &
done
wait
ddp() { timeout 200 torchrun --nproc_per_node=2 bench.py $REF --results_file=$R --micro_batch_size=16 "$@"; }
{
  ddp --name=s16-ddp2-20m-ro
  ddp --name=s16-ddp2-20m-default --compile_mode=default
} > "$OUT/s16-ddp.log" 2>&1
tail -n 3 "$OUT"/s16-seed-*.log
python3 scripts/summarize.py "$R" s16-
