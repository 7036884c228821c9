#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: flash-attn-4 (FA4) against the default attention (auto, which picks
# cuDNN), attention alone and the whole update, 20m and 50m. This first try put FA4 behind SDPA's flash kernel
# through PyTorch's own registry (commit cd797c6); in PyTorch 2.11 that registry unpacks two values from
# flash-attn-4 4.0.0b36's forward, which returns five, so every fa4 entry failed. h200_s21.sh is the retry.
set -uo pipefail
source scripts/device_fa4.sh
source scripts/device_env.sh
BENCH_TIMEOUT=150
{
  timeout 120 python3 scripts/attention_microbench.py --preset=20m --results_file=$R --name=s20-attention-20m
  for round in 1 2; do
    bench $REF --name=s20-20m-default-$round
    bench $REF --name=s20-20m-fa4-$round --sdpa_backend=fa4
  done
  bench config/50m.py --name=s20-50m-default
  bench config/50m.py --name=s20-50m-fa4 --sdpa_backend=fa4
  timeout 120 python3 scripts/attention_microbench.py --preset=50m --results_file=$R --name=s20-attention-50m
} > "$OUT/s20.log" 2>&1
grep -E "^(cudnn|flash|fa4|efficient) " "$OUT/s20.log"
python3 scripts/summarize.py "$R" s20-
