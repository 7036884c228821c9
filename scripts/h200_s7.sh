#!/usr/bin/env bash
# One device call on a 1-GPU H200 machine: where the 50m and 90m updates spend their GPU time (both miss their
# 1.4x bars), and 90m with its loss in one slice and CUDA graphs together.
set -uo pipefail
source scripts/device_env.sh
{
  timeout 200 python3 bench.py config/90m.py --results_file=$R --name=s7-90m-profile --profile=True
  timeout 200 python3 bench.py config/50m.py --results_file=$R --name=s7-50m-profile --profile=True
  timeout 200 python3 bench.py config/90m.py --results_file=$R --name=s7-90m-slice32k-ro --loss_chunk_tokens=32768 \
    --compile_mode=reduce-overhead
} > "$OUT/s7.log" 2>&1
python3 scripts/summarize.py "$R" s7-
python3 - "$R" <<'PY'
import json, sys
profiles = json.load(open(sys.argv[1]))["profiles"]
for name in ("s7-90m-profile", "s7-50m-profile"):
    p = profiles.get(name)
    if p:
        n = p["profiled_updates"]
        print(name, {c: round(ms / n, 2) for c, ms in p["kernel_ms_by_category"].items()}, "total", round(p["kernel_ms"] / n, 2))
PY
