# The 50m preset (50.5M parameters) on the reference recipe's data and schedule.
name = "50m"
preset = "50m"
data_dir = "data/cache/gutenberg"
tokens_per_update = 32768
train_subset_tokens = 10_000_000
epochs = 10
learning_rate = 1.5e-3
min_lr = 1.5e-4
micro_batch_size = 32
compile = True
# Fused LM head + cross-entropy (model_kernels/cross_entropy.py): the same math as the full loss, faster and with less
# memory on the H200 (docs/PERFORMANCE.md, "Levers tried and not kept": `lever-full-loss`).
loss_impl = "fused"
