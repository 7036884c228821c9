# The 20m preset on FineWeb-edu (HuggingFaceFW/fineweb-edu, its sample-10BT) tokenized by SmolLM2's tokenizer
# (49,152 tokens: the model's vocabulary follows the cache, about 26M parameters), with the reference recipe's
# optimizer settings. Prepare data/cache/fineweb-edu first, with internet, by the command in README.md ("Data"):
# the first 1,000,000 documents of the stream (about a billion tokens), shuffled, in shards of 100M tokens;
# docs/DATA.md says how to prepare all of it on many machines. One pass over a 500M-token subset (about 20 tokens
# per parameter), which samples every document read, as the cache is shuffled. Not yet run on a GPU: no figure of
# it is recorded.
name = "20m-fineweb-edu"
preset = "20m"
data_dir = "data/cache/fineweb-edu"
seq_len = 1024
train_subset_tokens = 500_000_000
epochs = 1
tokens_per_update = 32768
learning_rate = 2e-3
min_lr = 2e-4
warmup_updates = 100
micro_batch_size = 32
compile = True
loss_impl = "fused"
compile_mode = "reduce-overhead"
