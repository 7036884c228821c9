"""trainer.py: what an evaluation pass leaves behind for the updates after it, and the CPU's peak memory unit."""
import pytest
import torch

import trainer as trainer_lib
from tests.test_train import make_trainer, small_config, train_data


@pytest.fixture(autouse=True)
def restore_threads():
    """Trainer(cpu_threads=1) sets the process-wide thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_an_evaluation_runs_in_eval_mode_and_leaves_the_model_training(text_cache, tmp_path, ema):
    """Validation puts the model in eval mode for its pass only: the updates after it run in training mode (a
    compiled model guards on it, and would recompile or run eval-mode graphs for every later update)."""
    cfg = small_config(text_cache, tmp_path, ema=ema)
    trainer, data = make_trainer(cfg), train_data(cfg)
    batches, n_tokens = data.micro_batches(0, 0, cfg.micro_batch_size)
    trainer.update(batches, n_tokens)
    modes = []
    hook = trainer.raw_model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    x, y, *_ = batches[0]
    scored = trainer.evaluate([(x[:2], y[:2])])
    hook.remove()
    assert scored["tokens"] == 2 * cfg.seq_len and modes == [False]
    assert trainer.raw_model.training and all(m.training for m in trainer.raw_model.modules())
    trainer.update(*data.micro_batches(0, 1, cfg.micro_batch_size))  # and the next update trains as before
    assert trainer.raw_model.training


def test_the_cpu_peak_memory_is_in_bytes():
    """On the CPU the peak is getrusage's ru_maxrss, which Linux gives in KiB: the recorded peak_memory_bytes is in
    bytes, so it is at least a tensor this process has touched (a KiB count read as bytes is 1024 times too small)."""
    big = torch.ones(16 * 2**20)  # 64 MiB, touched
    assert trainer_lib.peak_memory_bytes("cpu") >= big.numel() * big.element_size()
    del big
