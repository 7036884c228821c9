# A model small enough to train for real on 2 CPU cores (README.md, "On a fresh machine"): 4 layers of width 128,
# context 128, on the shared corpus tokenized with a 4096-token BPE (see docs/DATA.md).
name = "tiny-cpu"
preset = "20m"
dim = 128
n_layers = 4
n_heads = 2
hidden_dim = 384
seq_len = 128
data_dir = "data/cache/gutenberg-4k"
# The cache's vocabulary, stated so that a missing cache's error suggests the right prepare command, and a
# 32,000-token cache here is refused instead of silently giving the LM head 32,000 rows instead of 4,096.
vocab_size = 4096
train_subset_tokens = 250_000
val_subset_tokens = 32_768
# The full validation set (1.3M tokens) would take longer than the training itself here.
full_validation = False
epochs = 2
tokens_per_update = 4096
learning_rate = 3e-3
min_lr = 3e-4
warmup_updates = 20
micro_batch_size = 16
eval_batch_size = 32
log_interval = 20
device = "cpu"
