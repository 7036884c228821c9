"""train.py's run loop edges: timed checkpoints in minutes, a stop's checkpoint's entry, the diverged message,
validation batches and a resume's weights key."""
import time
import types

import numpy as np
import pytest
import torch

import checkpoint
import settings
import train
from configurator import ConfigError
from results import lookup
from tests.test_train import small_config


def timed_run(minutes, seconds_ago):
    """A one-process Run of rank 0 whose last checkpoint was seconds_ago, with checkpoint_minutes=minutes."""
    run = train.Run.__new__(train.Run)
    run.cfg, run.plan = settings.Config(checkpoint_minutes=minutes, log_interval=1), types.SimpleNamespace(device="cpu")
    run.world_size, run.main_process, run.last_checkpoint_time = 1, True, time.time() - seconds_ago
    run.stop, run.trainer = types.SimpleNamespace(signal=None), types.SimpleNamespace(step=1)
    return run


def test_checkpoint_minutes_are_minutes_not_seconds():
    run = timed_run(minutes=1.0, seconds_ago=30)  # past 1 s, not past 1 minute
    assert not run.signalled() and not run.checkpoint_due(False, None)
    run = timed_run(minutes=1.0, seconds_ago=61)
    assert not run.signalled() and run.checkpoint_due(False, None)


def test_a_stops_checkpoint_records_the_entry_as_interrupted_before_the_run_closes(text_cache, tmp_path,
                                                                                 monkeypatch):
    """A process killed between its stop's checkpoint and its close leaves an entry that says it can be resumed."""
    cfg = small_config(text_cache, tmp_path, epochs=1, stop_after_updates=2)
    seen, finish = [], train.Run.finish

    def recording_finish(self, reason):
        seen.append(lookup(cfg.results_file, [cfg.name])["status"])
        return finish(self, reason)
    monkeypatch.setattr(train.Run, "finish", recording_finish)
    entry = train.train(cfg)
    assert seen == ["interrupted"] and entry["status"] == "interrupted" and entry["step"] == 2


def test_a_run_diverged_before_its_first_checkpoint_says_none_was_written(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path, epochs=2, learning_rate=1e20, min_lr=0.0, warmup_updates=0)
    assert train.main([f"--{k}={v}" for k, v in cfg.items()]) == train.EXIT_DIVERGED
    assert not checkpoint.in_folder(cfg.out_dir).exists()
    err = capsys.readouterr().err
    assert "no checkpoint was written" in err and "last finite weights" not in err


@pytest.mark.parametrize("max_tokens, rows", [(4 * 64 + 1, 4), (4 * 64, 4), (4 * 64 + 2, 5)])
def test_a_validation_subset_batch_holds_no_row_of_padding_only(max_tokens, rows):
    """max_tokens tokens score max_tokens - 1 targets: 4 * 64 + 1 of them are 4 whole rows of 64, not 5."""
    run = train.Run.__new__(train.Run)
    run.cfg = settings.Config(eval_batch_size=16, seq_len=64)
    run.plan = types.SimpleNamespace(cache=types.SimpleNamespace(val=np.arange(2000, dtype=np.uint16)), rank=0)
    run.world_size, run.main_process, run.stop = 1, False, None
    run.trainer = types.SimpleNamespace(evaluate=lambda batches, stopped: [tuple(x.shape) for x, _ in batches])
    assert run.evaluate(max_tokens) == [(rows, 64)]


def test_resume_refuses_weights_to_start_from_other_than_the_checkpoints(text_cache, tmp_path):
    """init_from (the weights a run started from) is part of the run a resume continues, as a recipe key is."""
    cfg = small_config(text_cache, tmp_path, resume=True)
    folder = tmp_path / "out"
    folder.mkdir()
    torch.save({"config": dict(cfg)}, checkpoint.in_folder(folder))
    other = tmp_path / "other"
    argv = [f"--name={cfg.name}", f"--out_dir={folder}", "--resume=True", f"--init_from={other}"]
    with pytest.raises(ConfigError, match=rf"init_from '' \(the checkpoint's\) against '{other}'"):
        train.resumed_settings(settings.Config(cfg, init_from=str(other)), argv)
    assert train.resumed_settings(cfg, argv[:3])["init_from"] == ""  # its own: accepted


def test_a_timed_checkpoint_restarts_the_clock_for_the_next(text_cache, tmp_path, monkeypatch):
    """checkpoint_minutes after the first update's: the next timed one is due minutes later, not at every update."""
    cfg = small_config(text_cache, tmp_path, epochs=1, checkpoint_minutes=60.0)
    saved, update, save = [], train.Run.update, train.Run.save_checkpoint

    def update_an_hour_late(self, *args):
        if self.trainer.step == 0:
            self.last_checkpoint_time -= 3601  # the first update ends an hour after the last checkpoint
        return update(self, *args)

    def counting_save(self):
        saved.append(self.trainer.step)
        return save(self)
    monkeypatch.setattr(train.Run, "update", update_an_hour_late)
    monkeypatch.setattr(train.Run, "save_checkpoint", counting_save)
    entry = train.train(cfg)
    assert entry["status"] == "complete" and entry["step"] == 3
    assert saved == [1, 3, 3]  # the timed one, the epoch's end and the final one
