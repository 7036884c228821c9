#!/usr/bin/env bash
# Device call B (2-GPU H200): tune.py's 10-minute sweep starts on GPU 1 in its own process session (it
# outlives this call; the next call collects /root/tune.json), while GPU 0 runs compare.py's matched pair of the
# reference recipe (baseline: eager, micro-batch 8; optimized: config/20m_gh200.py as given).
set -uo pipefail
source scripts/device_env.sh
rm -rf /root/tune-repo && mkdir -p /root/tune-repo && cp -r . /root/tune-repo/
(cd /root/tune-repo && CUDA_VISIBLE_DEVICES=1 setsid nohup python3 tune.py config/20m_gh200.py --budget=10 \
  --name=tune-20m --results_file=/root/tune.json > /root/tune.log 2>&1 &)
CUDA_VISIBLE_DEVICES=0 python3 compare.py config/20m_gh200.py --name=matched --results_file="$R" \
  --plot=docs/matched-comparison.png 2>&1 | tee "$OUT/compare.log" | grep -vE "^\[(baseline|optimized)\] update" 
cp docs/matched-comparison.png "$OUT/" 2>/dev/null
tail -5 /root/tune.log
