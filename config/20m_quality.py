# Time to quality, the quality candidate: the speed candidate's recipe (config/20m_speed.py, read below: the shipped
# Muon recipe with QK-norm, NorMuon, two value-embedding tables, contexts of 256 then 512 then 1024 tokens, updates of
# 16,384 tokens with muon_lr 0.003, AdamW at 8e-3, a cooldown over the last half) over all 23.8M tokens of the
# shuffled cache three times, validated and exported as the weights' average (ema 0.995). Its screen on one H200, two
# runs at once, ended at a validation-subset loss of 3.8500 (four passes: 3.8487); the bar is every one of 5 seeds
# below 3.80 within the reference's whole training time, about 50 s (docs/TIME_TO_QUALITY.md, "The quality regime").
# Its solo time is not measured yet. It exports to no transformers class (value embeddings). Execution settings as
# the reference's.
from pathlib import Path

exec(Path(__file__).with_name("20m_speed.py").read_text())  # the speed candidate's keys, then what differs:
name = "20m-quality"
train_subset_tokens = 0  # all the tokens
epochs = 3
ema = 0.995
