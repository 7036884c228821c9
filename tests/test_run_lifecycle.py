"""A run's lifecycle beyond its updates: validation every eval_interval updates, the target and stop_at_target,
signals (acknowledged at once, a validation stopped early, a second signal never recorded as a checkpointed stop),
and one process per run folder."""
import os
import random
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import checkpoint
import train
import trainer as trainer_lib
from data.loader import TokenCache
from results import lookup, read_results
from tests.conftest import write_cache
from tests.test_train import REPO, checkpoint_parameters, cli_args, small_config
import settings

INTERVAL = dict(eval_interval=1, full_validation=False)


def test_eval_interval_records_each_point_and_the_first_time_the_target_is_reached(text_cache, tmp_path):
    free = train.train(small_config(text_cache, tmp_path, name="free", out_dir=str(tmp_path / "free"), **INTERVAL))
    curve = free["validation_curve"]
    # one point after every update, the epoch ends' too (3 updates per epoch, 2 epochs), none twice
    assert [p["update"] for p in curve] == list(range(1, 7))
    assert [p["epoch"] for p in curve] == [1, 1, 1, 2, 2, 2]
    assert all(p["training_seconds"] > 0 and p["seconds"] > 0 for p in curve)
    target = sorted(p["loss"] for p in curve)[2]  # the third lowest loss: reached, but not at the first point
    first = next(p for p in curve if p["loss"] <= target)

    run = train.train(small_config(text_cache, tmp_path, name="target", out_dir=str(tmp_path / "target"),
                                   target_loss=target, **INTERVAL))
    assert [p["loss"] for p in run["validation_curve"]] == [p["loss"] for p in curve]  # evaluations change nothing
    reached = run["target"]["reached"]
    assert reached["update"] == first["update"] and reached["loss"] == first["loss"]
    assert reached["tokens"] == first["tokens"] and reached["training_seconds"] > 0
    assert run["step"] == 6 and run["status"] == "complete"

    stopped = train.train(small_config(text_cache, tmp_path, name="stop", out_dir=str(tmp_path / "stop"),
                                       target_loss=target, stop_at_target=True, **INTERVAL))
    assert stopped["status"] == "complete" and stopped["step"] == first["update"]
    assert stopped["target"]["reached"]["update"] == first["update"] and stopped["target"]["stop_at_target"]
    assert stopped["step"] < run["step"]  # fewer updates (their seconds are the CPU's, too noisy to order)
    ckpt = checkpoint_parameters(tmp_path / "stop")  # checkpointed where it stopped
    assert ckpt and lookup(stopped["config"]["results_file"], ["stop", "step"]) == first["update"]


def test_a_target_never_reached_is_recorded_as_such(text_cache, tmp_path):
    run = train.train(small_config(text_cache, tmp_path, target_loss=0.01, stop_at_target=True, **INTERVAL))
    assert run["target"] == {"loss": 0.01, "reached": None, "stop_at_target": True} and run["step"] == 6


def signalling_evaluate(monkeypatch, signals):
    """Trainer.evaluate that signals this process `signals` times as the first validation-subset pass starts."""
    real = trainer_lib.Trainer.evaluate
    calls = []

    def evaluate(self, batches, stopped=None):
        calls.append(1)
        if len(calls) == 1:
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGINT)
        return real(self, batches, stopped)
    monkeypatch.setattr(trainer_lib.Trainer, "evaluate", evaluate)
    monkeypatch.setattr(train.StopRequest, "SAME_STOP_SECONDS", 0.0)  # the second signal is a second one


def test_a_signal_during_validation_is_acknowledged_and_the_resumed_run_validates_that_epoch(text_cache, tmp_path,
                                                                                             monkeypatch, capfd):
    straight = train.train(small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight")))
    cfg = small_config(text_cache, tmp_path, name="signalled", out_dir=str(tmp_path / "signalled"))
    signalling_evaluate(monkeypatch, signals=1)
    stopped = train.train(cfg)
    err = capfd.readouterr().err
    assert "SIGINT received: stopping at the next update with a checkpoint" in err
    # the epoch's updates are done, its validation was stopped: not counted, and checkpointed
    assert stopped["status"] == "interrupted" and stopped["epochs"] == 0 and stopped["validation_curve"] == []
    assert stopped["step"] == 3 and (tmp_path / "signalled" / "ckpt.pt").exists()
    monkeypatch.undo()
    resumed = train.train(settings.Config(cfg, resume=True))
    assert resumed["status"] == "complete" and resumed["epochs"] == 2
    assert [p["loss"] for p in resumed["validation_curve"]] == [p["loss"] for p in straight["validation_curve"]]
    assert resumed["final_validation"]["loss"] == straight["final_validation"]["loss"]


def test_a_second_signal_ends_the_run_and_it_is_not_recorded_as_checkpointed(text_cache, tmp_path, monkeypatch,
                                                                            capsys):
    cfg = small_config(text_cache, tmp_path, epochs=1)
    signalling_evaluate(monkeypatch, signals=2)
    assert train.main(cli_args(cfg)) == 130
    entry = read_results(cfg.results_file)["t"]
    assert entry["status"] == "aborted" and "second signal" in entry["error"]
    assert "the start (no checkpoint was written)" in entry["error"]  # the first epoch's checkpoint never came


def test_two_processes_of_one_run_are_refused(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path)
    (tmp_path / "out").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               f"lock = FileLock({str(tmp_path / 'out' / 'run.lock')!r}); lock.acquire(); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert train.main(cli_args(cfg)) == 2
        err = capsys.readouterr().err
        assert "another train.py is running 't'" in err and err.count("\n") == 1
        assert not (tmp_path / "out" / "ckpt.pt").exists() and not (tmp_path / "results.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert train.main(cli_args(cfg)) == 0  # the lock goes with its process


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_entry_logs_the_schedule_it_trained_with(text_cache, tmp_path, schedule):
    cooldown = {"cooldown_fraction": 0.5} if schedule == "wsd" else {}  # wsd's key: refused beside cosine
    run = train.train(small_config(text_cache, tmp_path, lr_schedule=schedule, log_interval=1, **cooldown))
    lrs = [p["lr"] for p in run["training_curve"]]
    assert lrs[1] == pytest.approx(3e-3)  # warmup 2, then the peak
    if schedule == "wsd":  # 6 updates: 2 warmup, 1 stable, 3 of cooldown, the last at the floor
        assert lrs[2] == pytest.approx(3e-3) and lrs[3] < 3e-3 and lrs[-1] == pytest.approx(3e-4)
    else:  # cosine decays from the end of warmup and reaches the floor one update after the last
        assert lrs[2] == pytest.approx(3e-3) and lrs[3] < lrs[2] and lrs[-1] > 3e-4
    assert run["recipe"].get("lr_schedule") == (None if schedule == "cosine" else "wsd")


def test_resume_by_name_alone_takes_the_checkpoints_settings_and_names_each_changed_key(text_cache, tmp_path,
                                                                                         capsys):
    """`python train.py --name=NAME --resume=True` retyped nothing of the recipe and trained the defaults' recipe
    instead (refused, naming fields, never values); it now resumes the checkpoint's run as the full command does."""
    cfg = small_config(text_cache, tmp_path, epochs=2)
    straight = train.train(settings.Config(cfg, name="straight", out_dir=str(tmp_path / "straight")))
    assert train.main(cli_args(settings.Config(cfg, stop_after_updates=2))) == train.EXIT_INTERRUPTED
    where = [f"--name={cfg.name}", f"--out_dir={cfg.out_dir}"]
    capsys.readouterr()
    changed = train.main(where + ["--resume=True", "--learning_rate=0.01", f"--seq_len={cfg.seq_len // 2}"])
    err = capsys.readouterr().err
    assert changed == 2 and err.count("\n") == 1
    assert f"learning_rate {cfg.learning_rate!r} (the checkpoint's) against 0.01" in err
    assert f"seq_len {cfg.seq_len} (the checkpoint's) against {cfg.seq_len // 2}" in err
    assert train.main(where + ["--resume=True", "--log_interval=3"]) == 0  # an execution key may change
    resumed = lookup(cfg.results_file, [cfg.name])
    assert resumed["status"] == "complete" and resumed["sessions"] == 2
    assert resumed["recipe_identity"] == straight["recipe_identity"]
    assert resumed["final_validation"]["loss"] == straight["final_validation"]["loss"]


def test_a_run_whose_loss_is_not_finite_ends_diverged_with_a_nonzero_exit(text_cache, tmp_path, capsys):
    """--learning_rate=1e9: the loss was NaN from update 3 and the run ended `complete`, exit 0."""
    cfg = small_config(text_cache, tmp_path, epochs=2, learning_rate=1e9, min_lr=0.0, warmup_updates=0)
    assert train.main(cli_args(cfg)) == train.EXIT_DIVERGED
    entry = lookup(cfg.results_file, [cfg.name])
    assert entry["status"] == "diverged" and "nan" in entry["error"].lower()
    assert entry["step"] < entry["total_updates"]  # it stopped there, not at the end
    assert "diverged:" in capsys.readouterr().err
    # its updates are training time (no pause had counted them: 0.0 s and no tokens/s were recorded)
    assert entry["training_seconds"] > 0 and entry["training_tokens_per_second"] > 0


def test_a_failed_run_records_the_training_time_of_its_updates(text_cache, tmp_path, monkeypatch):
    """A run failing mid-epoch recorded only the time up to its last pause: none, before its first validation."""
    cfg = small_config(text_cache, tmp_path, epochs=1)
    update, calls = train.Run.update, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        time.sleep(0.05)
        return update(self, *args)
    monkeypatch.setattr(train.Run, "update", failing)
    with pytest.raises(RuntimeError):
        train.main(cli_args(cfg))
    entry = lookup(cfg.results_file, [cfg.name])
    assert entry["status"] == "failed" and entry["training_seconds"] >= 0.1


@pytest.mark.parametrize("stop", ["stop_after_updates", "checkpoint_minutes"])
def test_weights_that_went_nan_between_log_lines_are_never_checkpointed(text_cache, tmp_path, capsys, stop):
    """The loss is read at log lines only; a stop or a timed checkpoint between them saved NaN weights, and the run
    ended interrupted (its resume went on from NaN) or said its checkpoint held the last finite weights."""
    when = dict(stop_after_updates=2) if stop == "stop_after_updates" else dict(checkpoint_minutes=1e-9)
    cfg = small_config(text_cache, tmp_path, epochs=2, learning_rate=1e20, min_lr=0.0, warmup_updates=0,
                       log_interval=50, **when)
    assert train.main(cli_args(cfg)) == train.EXIT_DIVERGED
    entry = lookup(cfg.results_file, [cfg.name])
    assert entry["status"] == "diverged" and "not finite" in entry["error"]
    if os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt")):  # one saved before the weights went NaN
        assert all(w.isfinite().all() for w in checkpoint_parameters(cfg.out_dir).values())
    assert "diverged:" in capsys.readouterr().err


def test_overwrite_removes_the_old_checkpoint_before_the_new_run_trains(text_cache, tmp_path, capsys, monkeypatch):
    """An overwriting run that failed before its first checkpoint left the old run's; --resume=True then continued
    the run the user had asked to discard, and its entry replaced the failed run's."""
    cfg = small_config(text_cache, tmp_path, epochs=1)
    assert train.main(cli_args(cfg)) == 0
    monkeypatch.setattr(train.Run, "update", lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError):
        train.main(cli_args(settings.Config(cfg, overwrite=True)))
    assert lookup(cfg.results_file, [cfg.name, "status"]) == "failed"
    assert not os.path.exists(os.path.join(cfg.out_dir, "ckpt.pt"))
    monkeypatch.undo()
    capsys.readouterr()
    assert train.main(cli_args(settings.Config(cfg, resume=True))) == 0
    assert "starting from scratch" in capsys.readouterr().out


def test_a_validation_a_signal_cut_short_is_done_when_the_run_resumes(text_cache, tmp_path, monkeypatch):
    """An eval_interval validation stopped by a signal was skipped by the resumed run, so a target reached there
    was recorded an interval late."""
    cfg = small_config(text_cache, tmp_path, epochs=2, eval_interval=2)
    straight = train.train(settings.Config(cfg, name="straight", out_dir=str(tmp_path / "straight")))
    evaluate = train.Run.evaluate

    def signal_during_the_validation_at_update_2(run, max_tokens):
        if run.trainer.step == 2:
            run.stop.signal, run.stop.signalled_at = signal.SIGTERM, time.monotonic()
        return evaluate(run, max_tokens)
    monkeypatch.setattr(train.Run, "evaluate", signal_during_the_validation_at_update_2)
    assert train.main(cli_args(cfg)) == train.EXIT_INTERRUPTED
    assert lookup(cfg.results_file, [cfg.name, "validation_curve"]) == []
    monkeypatch.undo()
    assert train.main(cli_args(settings.Config(cfg, resume=True))) == 0
    updates = lambda entry: [p["update"] for p in entry["validation_curve"]]
    assert updates(lookup(cfg.results_file, [cfg.name])) == updates(straight) == [2, 3, 4, 6]


def test_resume_and_overwrite_together_are_refused(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path, resume=True, overwrite=True)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: resume=True continues") and "overwrite=True starts afresh" in err
    assert not (tmp_path / "out").exists()


def test_a_validation_subset_larger_than_the_split_is_refused_as_the_training_subset_is(text_cache, tmp_path,
                                                                                          capsys):
    """--val_subset_tokens=1e9 silently meant all of them, under another recipe identity than 0 (all)."""
    from data.loader import TokenCache
    available = len(TokenCache(text_cache).val)
    cfg = small_config(text_cache, tmp_path, val_subset_tokens=available + 1)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert f"val_subset_tokens {available + 1:,} exceeds the {available:,} validation tokens" in err


def test_an_evaluation_batch_larger_than_the_subset_holds_only_the_rows_it_scores(text_cache, tmp_path,
                                                                                    monkeypatch):
    """--eval_batch_size=1000000 padded every validation batch to a million rows (65 GB)."""
    sizes = []
    real = train.eval_batches
    monkeypatch.setattr(train, "eval_batches", lambda tokens, seq_len, batch_size, max_tokens=0: (
        sizes.append(batch_size) or real(tokens, seq_len, batch_size, max_tokens)))
    cfg = small_config(text_cache, tmp_path, epochs=1, eval_batch_size=1_000_000)
    straight = train.train(small_config(text_cache, tmp_path, epochs=1, name="plain", out_dir=str(tmp_path / "p")))
    entry = train.train(cfg)
    from data.loader import TokenCache
    whole = -(-(len(TokenCache(text_cache).val) - 1) // cfg.seq_len)  # the full validation's rows
    assert entry["status"] == "complete" and sizes[0] == -(-(cfg.val_subset_tokens - 1) // cfg.seq_len)
    assert sizes[-1] == whole and max(sizes) == whole
    assert entry["best_subset_loss"] == pytest.approx(straight["best_subset_loss"], abs=1e-6)


def test_a_limit_that_falls_on_the_runs_last_update_finishes_the_run(text_cache, tmp_path):
    """stop_after_updates was checked before the run's end: a run with every update and epoch validation done
    stopped "interrupted" without its full validation, and needed one more job for that pass."""
    cfg = small_config(text_cache, tmp_path, epochs=1)
    total = train.train(settings.Config(cfg, name="whole", out_dir=str(tmp_path / "whole")))["total_updates"]
    entry = train.train(settings.Config(cfg, stop_after_updates=total))
    assert entry["status"] == "complete" and entry["final_validation"]


def test_an_out_dir_the_lock_cannot_be_made_in_is_one_line(text_cache, tmp_path, monkeypatch, capsys):
    import filelock
    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(filelock.FileLock, "acquire", refused)
    assert train.main(cli_args(small_config(text_cache, tmp_path))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be written (Permission denied); give a writable folder" in err[0], err


def test_a_world_size_without_torchrun_is_one_line(text_cache, tmp_path, monkeypatch, capsys):
    """A WORLD_SIZE left in the environment, without torchrun's RANK and rendezvous, was torch's traceback."""
    for variable in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(cli_args(small_config(text_cache, tmp_path))) == 2
    assert "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not: launch with torchrun" in \
        capsys.readouterr().err


def test_a_cpu_run_under_torchrun_takes_gloo_on_a_machine_with_a_gpu(monkeypatch):
    """The backend followed the machine: torchrun of a CPU config on a GPU machine started NCCL, which fails on
    CPU tensors."""
    import torch
    import torch.distributed as dist
    import distributed
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: chosen.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for variable, value in (("RANK", "0"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(variable, value)
    distributed.distributed("cpu")
    distributed.distributed("cuda")
    assert chosen == ["gloo", "nccl"]


def test_a_signal_before_the_first_update_checkpoints_the_run_it_calls_interrupted(text_cache, tmp_path, monkeypatch):
    """A SIGTERM as the run started exited 3 (interrupted: checkpointed) with no checkpoint, so --resume=True
    found nothing to continue."""
    import metrics
    record = metrics.Metrics.record

    def signalled_at_the_start(self, status, **kwargs):
        if status == "running" and not getattr(self, "signalled_once", False):
            self.signalled_once = True
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, as the run starts
        return record(self, status, **kwargs)
    monkeypatch.setattr(metrics.Metrics, "record", signalled_at_the_start)
    cfg = small_config(text_cache, tmp_path, epochs=1)
    assert train.main(cli_args(cfg)) == train.EXIT_INTERRUPTED
    assert (tmp_path / "out" / "ckpt.pt").is_file()
    monkeypatch.setattr(metrics.Metrics, "record", record)
    assert train.train(settings.Config(cfg, resume=True))["status"] == "complete"


def test_a_checkpoint_keeps_the_generator_of_the_gpu_its_model_is_on(tmp_path, monkeypatch):
    """save() takes the run's device from the model's weights: a run on cuda:1 keeps cuda:1's generator, which its
    resume continues, beside the update count and the run's state. No GPU here: torch.cuda mocked, and a stand-in
    model whose weight says it is on cuda:1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": torch.full((16,), torch.device(device).index or 0, dtype=torch.uint8))
    weight = types.SimpleNamespace(device=torch.device("cuda", 1))
    model = types.SimpleNamespace(parameters=lambda: iter([weight]), state_dict=lambda: {"w": torch.ones(2)})
    optimizer = types.SimpleNamespace(state_dict=lambda: {"state": {}, "param_groups": []})
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model, optimizer, 7, {"epoch": 1, "update_in_epoch": 3})
    saved = checkpoint.read(path)
    assert saved["rng"]["cuda"].tolist() == [1] * 16
    assert (saved["step"], saved["epoch"], saved["update_in_epoch"]) == (7, 1, 3)
    assert torch.equal(saved["model"]["w"], torch.ones(2)) and saved["optimizer"]["state"] == {}


def test_a_checkpoint_continues_each_random_generator_where_the_run_left_it(tmp_path):
    """What torch's, numpy's and Python's generators draw after a checkpoint is saved is what they draw after a
    resume from it, whatever was drawn in between."""
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    model = torch.nn.Linear(2, 2)  # the run's draws so far
    np.random.rand(3), random.random()
    checkpoint.save(tmp_path / "ckpt.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), 5, {})
    draws = lambda: (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)])
    straight = draws()
    torch.manual_seed(12345), np.random.seed(12345), random.seed(12345)
    checkpoint.set_rng_state(checkpoint.read(tmp_path / "ckpt.pt")["rng"])
    assert draws() == straight


def test_init_from_weights_of_another_cache_that_is_still_there_without_tokenizers_to_compare_is_accepted(tmp_path):
    """init_from a checkpoint trained on cache a, to train on cache b: a still holds what the weights were trained on,
    and neither holds a tokenizer (byte caches, as here): nothing to compare, so nothing to refuse."""
    trained_on = write_cache(tmp_path / "a", np.arange(300) % 256, np.arange(100) % 256, 256)
    other = write_cache(tmp_path / "b", np.arange(300) % 200, np.arange(100) % 200, 256)
    identity = TokenCache(trained_on).identity
    assert identity != TokenCache(other).identity
    assert checkpoint.same_tokenizer(trained_on, other) is None
    assert checkpoint.tokenizer_mismatch("init_from x", identity, trained_on, other, "train on another") is None
