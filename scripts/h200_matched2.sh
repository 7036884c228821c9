#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine, after h200_levers.sh: the matched pair of the reference recipe with
# the fused loss (issue 8), eager measured on a quiet machine (issue 5), the cold start measured alone, and
# DDP at twice the tokens per update on 1 and 2 GPUs (issue 9).
#   A: GPU 0 trains the plain baseline (eager, micro-batch 8, full loss); GPU 1 first runs the eager benchmarks
#      (no compiler workers anywhere then: eager is launch-bound, and compiling beside it slowed it by up to
#      20% in h200_levers.sh), then trains the optimized config twice (the second run measures noise).
#   B: the cold compile alone on GPU 0, then the matched comparison.  C: DDP on both GPUs.
set -uo pipefail
source scripts/device_env.sh
bench() { timeout 240 python3 bench.py $REF --results_file=$R "$@"; }
eager() { bench --compile=False --micro_batch_size=8 "$@"; }

baseline() {
  python3 train.py $REF --results_file=$R --name=s2-matched-baseline --compile=False --micro_batch_size=8 \
    --loss_impl=full --log_interval=200
}
gpu1() {
  (cd "$BEFORE" && timeout 240 python3 bench.py $REF --results_file=$R --data_dir=$DATA --compile=False \
     --micro_batch_size=8 --name=s2q-eager-before)
  eager --name=s2q-eager-full --loss_impl=full
  eager --name=s2q-eager-fused --loss_impl=fused
  (cd "$BEFORE" && timeout 240 python3 bench.py $REF --results_file=$R --data_dir=$DATA --compile=False \
     --micro_batch_size=8 --name=s2q-eager-before-again)
  eager --name=s2q-eager-full-again --loss_impl=full
  for run in s2-matched-optimized s2-repeat-a; do
    python3 train.py $REF --results_file=$R --name=$run --log_interval=200
  done
}
CUDA_VISIBLE_DEVICES=0 baseline > "$OUT/baseline.log" 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=1 gpu1 > "$OUT/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1

CUDA_VISIBLE_DEVICES=0 bench --name=s2q-20m-cold-alone --cold=True > "$OUT/cold.log" 2>&1
python3 compare.py $REF --results_file=$R --name=s2-matched --baseline=s2-matched-baseline \
  --optimized=s2-matched-optimized --plot=$OUT/matched.png \
  --noise_runs=s2-repeat-a,repeat-1337-a,repeat-1337-b,seed-1338,seed-1339,seed-1340 > "$OUT/compare.log" 2>&1

{
  CUDA_VISIBLE_DEVICES=0 bench --name=s2-90m-1gpu-64k --preset=90m --tokens_per_update=65536
  timeout 200 torchrun --nproc_per_node=2 bench.py $REF --results_file=$R --name=s2-ddp2-90m-64k --preset=90m \
    --tokens_per_update=65536 --scaling_reference=s2-90m-1gpu-64k
} > "$OUT/ddp.log" 2>&1

tail -n 25 "$OUT/compare.log"
python3 scripts/summarize.py "$R" s2q- s2-90m-1gpu s2-ddp2-90m-64k s2-matched s2-repeat
