# Time to quality, the quality candidate: the speed candidate's recipe (config/20m_speed.py: the shipped Muon recipe
# with QK-norm, NorMuon, two value-embedding tables, contexts of 256 then 512 then 1024 tokens, updates of 16,384
# tokens with muon_lr 0.003, AdamW at 8e-3, a cooldown over the last half) over all 23.8M tokens of the shuffled cache
# three times, validated and exported as the weights' average (ema 0.995). Its screen on one H200, two runs at once,
# ended at a validation-subset loss of 3.8500 (four passes: 3.8487); the bar is every one of 5 seeds below 3.80
# within the reference's whole training time, about 50 s (docs/TIME_TO_QUALITY.md, "The quality regime"). Its solo
# time is not measured yet. It exports to no transformers class (value embeddings). Execution settings as the
# reference's.
name = "20m-quality"
preset = "20m"
data_dir = "data/cache/gutenberg"
seq_len = 1024
seq_len_schedule = "256:0.3,512:0.6"
train_subset_tokens = 0
epochs = 3
tokens_per_update = 16384
learning_rate = 8e-3
min_lr = 4e-4
warmup_updates = 20
optimizer = "muon"
muon_lr = 0.003
muon_adjust_lr = "match_rms_adamw"
normuon = True
lr_schedule = "wsd"
cooldown_fraction = 0.5
ema = 0.995
qk_norm = True
value_embeddings = 2
micro_batch_size = 16
eval_interval = 25
compile = True
loss_impl = "fused"
compile_mode = "reduce-overhead"
