#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine, after h200_s14.sh: where evaluation's time goes (s14-matched
# evaluated at 2.76x its training speed, under the 3x bar), with and without CUDA graphs; the whole model with
# CUDA graphs against without, interleaved twice; the cold first update with this session's kernels; and the
# reference recipe trained with CUDA graphs (compare.py reads it afterwards against s2-matched-baseline).
set -uo pipefail
source scripts/device_env.sh
BENCH_TIMEOUT=120
RO=--compile_mode=reduce-overhead
{
  timeout 150 python3 scripts/eval_speed.py $REF --results_file=$R --name=s15-eval-speed
  timeout 150 python3 scripts/eval_speed.py $REF --results_file=$R --name=s15-eval-speed-ro $RO
  for round in 1 2; do
    bench $REF --name=s15-20m-default-$round
    bench $REF --name=s15-20m-ro-$round $RO
  done
  bench $REF --name=s15-20m-blocks-ro-cold --compile_scope=blocks $RO --cold=True
  timeout 200 python3 train.py $REF --results_file=$R --name=s15-matched-ro $RO --log_interval=500
} > "$OUT/s15.log" 2>&1
grep -E "^(unpinned|prefetched)" "$OUT/s15.log"
python3 scripts/summarize.py "$R" s15-
