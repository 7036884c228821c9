#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: which kernels the 20m and 50m updates spend their time in (the
# profile now keeps the slowest kernels by name), and the LM head + loss alone at the three presets' widths,
# our fused op against Cut Cross-Entropy (carried as a wheel in .whl) and Liger.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit
source scripts/device_env.sh
{
  for dim in 320 512 768; do
    timeout 100 python3 scripts/loss_microbench.py --dim=$dim --name=s9-loss-microbench-$dim --results_file=$R
  done
  timeout 120 python3 bench.py $REF --results_file=$R --name=s9-20m-profile --profile=True
  timeout 120 python3 bench.py config/50m.py --results_file=$R --name=s9-50m-profile --profile=True
} > "$OUT/s9.log" 2>&1
grep -A9 "^variant" "$OUT/s9.log"
python3 scripts/summarize.py "$R" s9-
