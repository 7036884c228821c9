# Time to quality, the quality candidate: the speed candidate's recipe (config/20m_speed.py, read below: the shipped
# Muon recipe with QK-norm, NorMuon and two value-embedding tables, AdamW at 8e-3), wider (width 384, 6 heads of 64,
# SwiGLU 1024) and in the preset's eight blocks (51.0M parameters, 36.9M of them the three tables) over all 23.8M tokens
# of the shuffled cache three times, at a context of 1024 throughout, in updates of 24,576 tokens with muon_lr 0.0035
# and Muon on q, k, v, the gate and up apart (muon_split_projections); regularised by weight decay 0.3, a cooldown over
# the last 70% and the weights' average (ema 0.998), which is validated and exported. Its verdict on one H100
# (compare.py, each run alone): seeds 1337 to 1341 ended at a validation-subset loss of 3.7852, 3.7930, 3.7825, 3.7855
# and 3.7815 (mean 3.7856, sd 0.0045, p = 0.001 below 3.80) in a median 55.6 training seconds, where the reference
# (config/20m_gh200.py) trained 56.8 and 55.3 s beside it (docs/TIME_TO_QUALITY.md, "The quality candidate"). It exports
# to no transformers class (value embeddings).
from pathlib import Path

exec(Path(__file__).with_name("20m_speed.py").read_text())  # the speed candidate's keys, then what differs:
name = "20m-quality"
dim = 384
n_heads = 6
hidden_dim = 1024
n_layers = 0  # the preset's eight blocks (the speed candidate has six)
train_subset_tokens = 0  # all the tokens
epochs = 3
seq_len_schedule = ""
tokens_per_update = 24576
micro_batch_size = 24
muon_lr = 0.0035
muon_split_projections = True
weight_decay = 0.3
cooldown_fraction = 0.7
ema = 0.998
