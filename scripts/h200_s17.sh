#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: CUDA graphs (now the 20m config's default) for the 50m and 90m
# configs, each beside its plain compile in the same call, and a kernel profile of the 20m default.
set -uo pipefail
source scripts/device_env.sh
BENCH_TIMEOUT=150
RO=--compile_mode=reduce-overhead
{
  for preset in 50m 90m; do
    bench config/$preset.py --name=s17-$preset-default
    bench config/$preset.py --name=s17-$preset-ro $RO
  done
  bench $REF --name=s17-20m-profile --profile=True
} > "$OUT/s17.log" 2>&1
python3 scripts/summarize.py "$R" s17-
