#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine: a short smoke test of every GPU path, then the protocol-v2
# benchmarks of the bench and speed issues (GPU 0 and GPU 1 run independent sets side by side; every
# comparison of a lever with what it replaces is on one GPU, one after the other), then DDP on both GPUs.
# Needs the token cache data/cache/gutenberg (carry it). Results and logs under $OUT.
set -uo pipefail
source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"

# 1. smoke: every path for a few updates (fails fast)
CUDA_VISIBLE_DEVICES=0 python3 bench.py $REF --name=smoke --results_file=$OUT/smoke.json --warmup=2 --steps=3 \
  --windows=1 --profile=True --partial_probe=True || exit 1
CUDA_VISIBLE_DEVICES=0 python3 train.py $REF --name=smoke-train --results_file=$OUT/smoke.json --epochs=1 \
  --train_subset_tokens=600000 --val_subset_tokens=65536 --out_dir=/tmp/smoke --log_interval=5 || exit 1
torchrun --nproc_per_node=2 bench.py $REF --name=smoke-ddp --results_file=$OUT/smoke.json --micro_batch_size=16 \
  --warmup=2 --steps=3 --windows=1 || exit 1

# 2. two independent sets, one per GPU
gpu0() {
  python3 bench.py $REF --name=final-20m --profile=True --partial_probe=True --results_file=$R
  python3 bench.py $REF --name=eager-20m-mb8 --compile=False --micro_batch_size=8 --results_file=$R
  python3 bench.py $REF --name=lever-chunked-ce --loss_impl=chunked --results_file=$R
  python3 bench.py $REF --name=lever-sdpa-flash --sdpa_backend=flash --results_file=$R
  python3 bench.py $REF --name=lever-sdpa-cudnn --sdpa_backend=cudnn --results_file=$R
  python3 bench.py $REF --name=final-20m-cold --cold=True --results_file=$R
}
gpu1() {
  python3 bench.py $REF --name=presets --presets=50m,90m --results_file=$R
  python3 bench.py $REF --name=lever-reduce-overhead --compile_mode=reduce-overhead --results_file=$R
  python3 bench.py $REF --name=final-20m-synthetic --data_mode=synthetic --results_file=$R
  python3 model.py --parity=20m --device=cuda --results_file=$R
  python3 model.py --parity=50m --device=cuda --results_file=$R
  python3 model.py --parity=90m --device=cuda --results_file=$R
  python3 model.py --parity=20m --checkpoint=/tmp/smoke/ckpt.pt --device=cuda --results_file=$R
}
CUDA_VISIBLE_DEVICES=0 gpu0 > "$OUT/gpu0.log" 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=1 gpu1 > "$OUT/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1

# 3. DDP on both GPUs: the same recipe (strong scaling: 16 sequences per GPU) and twice the tokens per update
#    (weak scaling: 32 per GPU, a different recipe, for the per-GPU ceiling)
torchrun --nproc_per_node=2 bench.py $REF --name=ddp2-20m --micro_batch_size=16 --scaling_reference=final-20m \
  --results_file=$R > "$OUT/ddp.log" 2>&1
torchrun --nproc_per_node=2 bench.py $REF --name=ddp2-90m --preset=90m --micro_batch_size=16 \
  --scaling_reference=presets-90m --results_file=$R >> "$OUT/ddp.log" 2>&1
torchrun --nproc_per_node=2 bench.py $REF --name=ddp2-90m-weak --preset=90m --micro_batch_size=32 \
  --tokens_per_update=65536 --scaling_reference=presets-90m --results_file=$R >> "$OUT/ddp.log" 2>&1
python3 scripts/summarize.py "$R"
