#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine, the retry of the s20 call (PERFORMANCE.md): flash-attn-4 (FA4)
# through our own op (model.flash_attention_4, sdpa_backend=fa4) against the default attention (auto, which
# picks cuDNN), attention alone and the whole update, 20m and 50m, interleaved.
set -uo pipefail
source scripts/device_fa4.sh
source scripts/device_env.sh
BENCH_TIMEOUT=150
{
  timeout 120 python3 scripts/attention_microbench.py --preset=20m --results_file=$R --name=s21-attention-20m
  for round in 1 2; do
    bench $REF --name=s21-20m-default-$round
    bench $REF --name=s21-20m-fa4-$round --sdpa_backend=fa4
  done
  bench config/50m.py --name=s21-50m-default
  bench config/50m.py --name=s21-50m-fa4 --sdpa_backend=fa4
  timeout 120 python3 scripts/attention_microbench.py --preset=50m --results_file=$R --name=s21-attention-50m
} > "$OUT/s21.log" 2>&1
grep -E "^(cudnn|flash|fa4|efficient) " "$OUT/s21.log"
python3 scripts/summarize.py "$R" s21-
