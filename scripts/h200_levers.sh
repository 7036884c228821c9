#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine: the levers of issues 5 and 8, each beside what it replaces on the
# same GPU in the same call, then DDP on both GPUs (issue 9). GPU 0 runs the compiled 20m set, GPU 1 the
# eager set and the larger presets. BEFORE names a copy of the previous commit's tree (`git archive HEAD`),
# so that a change with no switch of its own (the rotary rewrite) is measured against the code it replaces.
# Needs data/cache/gutenberg (carry it), and .whl/ with liger-kernel for the loss microbenchmark (optional).
set -uo pipefail
source scripts/device_env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.draw --format=csv,noheader
bench() { timeout 240 python3 bench.py $REF --results_file=$R "$@"; }

gpu0() {
  python3 scripts/loss_microbench.py --results_file=$R
  bench --name=s2-20m-full --profile=True
  bench --name=s2-20m-fused --loss_impl=fused --profile=True
  bench --name=s2-20m-fused-slice32k --loss_impl=fused --loss_chunk_tokens=32768
  bench --name=s2-20m-fused-ro --loss_impl=fused --compile_mode=reduce-overhead
  bench --name=s2-20m-fused-cold --loss_impl=fused --cold=True
  bench --name=s2-20m-fused-blocks-cold --loss_impl=fused --compile_scope=blocks --cold=True
}
gpu1() {
  (cd "$BEFORE" && timeout 240 python3 bench.py $REF --results_file=$R --data_dir=$DATA --name=s2-eager-before \
     --compile=False --micro_batch_size=8)
  bench --name=s2-eager-full --compile=False --micro_batch_size=8
  bench --name=s2-eager-fused --compile=False --micro_batch_size=8 --loss_impl=fused --profile=True
  bench --name=s2-presets-full --presets=50m,90m
  bench --name=s2-presets-fused --presets=50m,90m --loss_impl=fused
  bench --name=s2-90m-mb16-alone --preset=90m --micro_batch_size=16 --tokens_per_update=16384 --loss_impl=fused
}
CUDA_VISIBLE_DEVICES=0 gpu0 > "$OUT/gpu0.log" 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=1 gpu1 > "$OUT/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1

# DDP, the same recipe on 2 GPUs (16 sequences each): the default bucket size, then larger buckets.
ddp() { timeout 200 torchrun --nproc_per_node=2 bench.py $REF --results_file=$R --micro_batch_size=16 "$@"; }
{
  ddp --name=s2-ddp2-90m --preset=90m --loss_impl=fused --scaling_reference=s2-presets-fused-90m
  ddp --name=s2-ddp2-90m-bucket100 --preset=90m --loss_impl=fused --ddp_bucket_mb=100 \
    --scaling_reference=s2-presets-fused-90m
  ddp --name=s2-ddp2-20m --loss_impl=fused --scaling_reference=s2-20m-fused
} > "$OUT/ddp.log" 2>&1

python3 scripts/summarize.py "$R" s2-
