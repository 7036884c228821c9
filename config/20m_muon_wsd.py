# Time to quality: the reference's model and token cache, trained once over all of it with Muon on the blocks'
# matrices (AdamW on the embedding and the norms) and a warmup-stable-decay schedule with a long linear cooldown.
# At 5 seeds it reaches the reference's best loss within half the reference's training time to it
# (docs/TIME_TO_QUALITY.md, "The shipped recipe": `time-to-target.20m-muon-wsd`; the settings tried around it in
# "The levers, kept or not"). Execution settings as the reference's.
name = "20m-muon-wsd"
preset = "20m"
data_dir = "data/cache/gutenberg"
seq_len = 1024
train_subset_tokens = 0
epochs = 1
tokens_per_update = 32768
learning_rate = 4e-3
min_lr = 4e-4
warmup_updates = 20
optimizer = "muon"
muon_lr = 0.004
muon_adjust_lr = "match_rms_adamw"
lr_schedule = "wsd"
cooldown_fraction = 0.7
micro_batch_size = 32
compile = True
loss_impl = "fused"
compile_mode = "reduce-overhead"
