#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: Inductor's coordinate-descent tuning of its own Triton kernels
# (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1; the elementwise and norm kernels are a fifth of the 90m update)
# beside the same settings without it, for 90m (with one loss slice and CUDA graphs, 702,761 in s7) and 20m.
set -uo pipefail
source scripts/device_env.sh
CDT="env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1"
S90="config/90m.py --loss_chunk_tokens=32768 --compile_mode=reduce-overhead"
{
  timeout 150 python3 bench.py $S90 --results_file=$R --name=s8-90m-slice32k-ro
  timeout 240 $CDT python3 bench.py $S90 --results_file=$R --name=s8-90m-slice32k-ro-cdt
  timeout 240 $CDT python3 bench.py $REF --results_file=$R --name=s8-20m-cdt
} > "$OUT/s8.log" 2>&1
python3 scripts/summarize.py "$R" s8- s5-20m-default
