# The reference recipe: the 20m preset, 10 epochs over a 10M-token subset of the Gutenberg corpus
# (about 100M tokens), 32,768 tokens per update, compiled, on one GPU.
name = "20m-reference"
preset = "20m"
data_dir = "data/cache/gutenberg"
seq_len = 1024
tokens_per_update = 32768
train_subset_tokens = 10_000_000
epochs = 10
learning_rate = 2e-3
min_lr = 2e-4
warmup_updates = 100
micro_batch_size = 32
compile = True
# Fused LM head + cross-entropy (model_kernels/cross_entropy.py): the same math as the full loss, faster and with less
# memory on the H200 (docs/PERFORMANCE.md, "Levers tried and not kept": `lever-full-loss`).
loss_impl = "fused"
# CUDA graphs for the whole compiled model: faster than the plain compile (docs/PERFORMANCE.md, "Levers tried and
# not kept": `lever-no-cudagraphs`), and the recipe trained with them matched the eager baseline ("Matched runs").
compile_mode = "reduce-overhead"
