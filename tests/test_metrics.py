"""metrics.py's log line: the ETA follows the mean rate of this process's training, not one interval's."""
import math
import re
import types

import pytest
import torch

import env
import metrics
import settings


class Clock:
    """time.time() for metrics.py, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def time(self):
        return self.now


def run_metrics(monkeypatch, total_updates=200, tokens_per_update=1000):
    clock = Clock()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(time=clock.time))
    cfg = settings.Config(compile=True, tokens_per_update=tokens_per_update, target_loss=0.0)
    trainer = types.SimpleNamespace(step=0, lr_at=lambda step: 1e-3)
    facts = {"main_process": True, "world_size": 1, "device": "cpu", "flops": 1.0, "gpu_name": None,
             "total_updates": total_updates, "total_tokens": total_updates * tokens_per_update}
    m = metrics.Metrics(cfg, trainer, facts)
    m.dashboards = types.SimpleNamespace(log=lambda step, scalars: None)
    m.start_clock()
    return m, trainer, clock


def train(m, trainer, clock, seconds_per_update, updates, log_interval=10):
    for _ in range(updates):
        clock.now += seconds_per_update
        trainer.step += 1
        m.count(torch.tensor(4.0 * 1000), 1000)
        if trainer.step % log_interval == 0:
            m.log(torch.tensor(1.0))


def etas(out):
    """The ETAs of the log lines printed, in seconds."""
    return [int(m) * 60 + int(s) for m, s in re.findall(r"ETA (\d+)m(\d\d)s", out)]


def test_the_eta_is_the_mean_rate_since_the_first_update_not_the_last_intervals(monkeypatch, capsys):
    """One slow interval (the machine shared for a while) moved the ETA from 9m36 to 16m08 and back to 5m33."""
    m, trainer, clock = run_metrics(monkeypatch)
    clock.now += 30  # the first update compiles: 30 s, left out of the rate
    trainer.step += 1
    m.count(torch.tensor(4000.0), 1000)
    train(m, trainer, clock, 1.0, 39)  # updates 2..40 at 1 s each
    train(m, trainer, clock, 5.0, 10)  # updates 41..50 at 5 s each: a slow interval
    train(m, trainer, clock, 1.0, 10)  # updates 51..60 at 1 s each
    out = capsys.readouterr().out
    # 1 s per update from update 2 on: ETA = what is left x 1 s, whatever the compile took
    assert etas(out)[:4] == [190, 180, 170, 160]
    # after the slow interval: (39 + 50) s for 49 updates, not 5 s per update (the last interval's 750 s)
    assert etas(out)[4] == int(150 * 89 / 49)
    assert etas(out)[5] == int(140 * 99 / 59)  # and no swing back to 140 s with the next fast interval
    assert "| 0.2K tok/s |" in out  # the log line's rate is still the interval's (1,000 tokens per 5 s)


def test_the_eta_leaves_out_pauses_and_starts_afresh_in_a_resumed_process(monkeypatch, capsys):
    m, trainer, clock = run_metrics(monkeypatch)
    train(m, trainer, clock, 2.0, 20)
    with m.paused():  # a validation pass: not training time
        clock.now += 600
    train(m, trainer, clock, 2.0, 10)
    assert etas(capsys.readouterr().out) == [380, 360, 340]  # 2 s an update, the pause aside
    resumed, trainer, clock = run_metrics(monkeypatch)
    resumed.restore(m.state_dict())
    trainer.step = 30
    train(resumed, trainer, clock, 1.0, 20)  # 1 s an update now: the earlier process's 2 s are not this one's
    assert etas(capsys.readouterr().out) == [160, 150]


def test_the_first_update_records_the_first_call_childrens_timings_and_compiles_seconds_not_carried_by_a_resume(
        monkeypatch):
    """A cold run's entry says when the children had their kernels and how long its first update waited for them
    (model_kernels/first_calls.py), and a compiled run's what torch.compile spent of its first update, by phase, as
    bench.py's do; they belong to the process that compiled, not to a resume."""
    from model_kernels import first_calls
    timings = {"attention": {"ready_seconds": 11.4, "waited_seconds": 0.2}}
    graphs, phases = {"compiled": 0, "from_cache": 4}, {"dynamo_tracing": 0.6, "compile_total": 1.8}
    monkeypatch.setattr(first_calls, "timings", lambda: timings)
    monkeypatch.setattr(metrics.env, "compiled_since", lambda mark: (graphs, phases))
    m, trainer, clock = run_metrics(monkeypatch)
    train(m, trainer, clock, 1.0, 2)
    assert m.state.first_calls == timings and m.state.first_update_compile_seconds == phases
    assert m.state.first_update_graphs == graphs
    monkeypatch.setattr(first_calls, "timings", lambda: {})  # a later update finds none: the first's stay
    monkeypatch.setattr(metrics.env, "compiled_since", lambda mark: ({}, {"compile_total": 9.0}))
    train(m, trainer, clock, 1.0, 1)
    assert m.state.first_calls == timings and m.state.first_update_compile_seconds == phases
    assert not {"first_calls", "first_update_compile_seconds"} & set(metrics.RESUME_FIELDS)


def test_a_log_interval_a_checkpoint_cut_goes_on_in_the_resumed_process(monkeypatch, capsys):
    """Its loss point averages all its updates, and its rate is all its tokens over all its training seconds, the
    earlier process's included; a rank other than 0 brings only its own updates' loss sum to the log's all-reduce."""
    m, trainer, clock = run_metrics(monkeypatch)
    train(m, trainer, clock, 1.0, 2, log_interval=4)  # updates 1-2, loss 4 a token, 1 s each
    with m.paused() as start:
        clock.now += 30  # the checkpoint: not training time
        m.keep_open_interval(start)
    saved = m.state_dict()
    assert saved["open_interval"] == {"updates": 2, "tokens": 2000, "loss_sum": 8000.0, "training_seconds": 2.0}
    assert "open_interval" not in metrics.RESUME_FIELDS  # an older checkpoint has none

    resumed, trainer, clock = run_metrics(monkeypatch)
    resumed.restore(saved)
    resumed.start_clock()
    assert resumed.state.open_interval is None  # carried now: a later checkpoint keeps its own
    with resumed.paused() as start:  # a checkpoint before this process's first update keeps the interval as it was
        resumed.keep_open_interval(start)
    assert resumed.state.open_interval == saved["open_interval"]
    trainer.step = 2
    for _ in range(2):  # updates 3-4, loss 1 a token, 4 s each
        clock.now += 4.0
        trainer.step += 1
        resumed.count(torch.tensor(1000.0), 1000)
    resumed.log(torch.tensor(1.0))
    point = resumed.state.training_curve[-1]
    assert point["update"] == 4 and point["loss"] == (8000.0 + 2000.0) / 4000
    assert resumed.state.interval_tokens_per_second[-1] == 4000 / (2.0 + 8.0)

    reduced = []
    monkeypatch.setattr(metrics, "all_reduce_sum", lambda tensor, world_size: reduced.append(tensor.item()) or tensor)
    other, trainer, clock = run_metrics(monkeypatch)
    other.main, other.world_size = False, 2
    other.restore(saved)
    other.start_clock()
    assert other.loss_total is None and (other.interval_updates, other.interval_tokens) == (2, 2000)
    with other.paused() as start:
        other.keep_open_interval(start)
    assert reduced == [0.0]  # rank 0 brings the kept sum


def entry_of(m, **facts):
    """m's results entry, with the facts run_metrics leaves out (the entry reports them as given)."""
    m.facts.update({"parameters": 1, "recipe_id": "r", "recipe": {}, "fingerprint": None, **facts})
    m.trainer.attention = "sdpa"
    return m.entry("complete")


def test_a_pause_counts_in_the_elapsed_seconds_only_never_in_the_training_seconds_or_an_intervals_rate(monkeypatch):
    """A validation or a checkpoint in the middle of a log interval: the training seconds, the tokens per training
    second and the interval's rate leave it out; the elapsed seconds (and their rate) take it in."""
    m, trainer, clock = run_metrics(monkeypatch)
    train(m, trainer, clock, 1.0, 5, log_interval=10)
    with m.paused():
        clock.now += 600
    train(m, trainer, clock, 1.0, 5, log_interval=10)  # the log line at update 10
    m.stop_clock()
    assert m.state.interval_tokens_per_second == [10_000 / 10]
    assert (m.state.training_seconds, m.state.training_elapsed_seconds) == (10.0, 610.0)
    entry = entry_of(m)
    assert entry["training_tokens_per_second"] == 10_000 / 10
    assert entry["elapsed_tokens_per_second"] == 10_000 / 610


def test_stopping_the_clock_adds_the_updates_since_the_last_pause_once(monkeypatch):
    """A diverged run stops the clock at its last update; a later stop (its failure's handling) adds nothing."""
    m, trainer, clock = run_metrics(monkeypatch)
    train(m, trainer, clock, 1.0, 3)
    m.stop_clock()
    clock.now += 100
    m.stop_clock(quiet=True)
    assert m.state.training_seconds == m.state.training_elapsed_seconds == 3.0


def test_the_first_update_seconds_start_with_the_clock_not_with_the_setup(monkeypatch):
    """Reading a checkpoint or building the model before the clock starts is not the first update's time."""
    m, trainer, clock = run_metrics(monkeypatch)
    clock.now += 100  # the setup, after Metrics was made
    m.start_clock()
    train(m, trainer, clock, 30.0, 1)
    train(m, trainer, clock, 1.0, 1)
    assert m.state.first_update_seconds == 30.0


def test_the_entrys_mfu_is_one_gpus_share_of_the_tokens_per_second_over_its_peak(monkeypatch):
    """The counted tokens are every rank's: under DDP each GPU did its share of them."""
    m, trainer, clock = run_metrics(monkeypatch)
    m.world_size = 2
    train(m, trainer, clock, 0.5, 10, log_interval=100)  # no log line: its all-reduce would need the ranks
    m.stop_clock()
    entry = entry_of(m, flops=6e9, gpu_name="NVIDIA H100 80GB HBM3")
    per_gpu = 10_000 / 5.0 / 2
    assert entry["mfu"] == pytest.approx(6e9 * per_gpu / env.PEAK_BF16_FLOPS["H100"], rel=1e-12)


def test_a_validation_point_and_the_target_take_the_training_seconds_before_the_validation(monkeypatch):
    """train.py adds the point inside the validation's pause: the pass's own seconds are the point's seconds, not
    training seconds (time_to_target reads the target's)."""
    m, trainer, clock = run_metrics(monkeypatch)
    m.cfg = settings.Config(m.cfg, target_loss=3.0)
    train(m, trainer, clock, 1.0, 5)
    with m.paused() as start:
        clock.now += 50  # the validation pass
        m.add_validation({"loss": 2.5, "tokens": 1000}, clock.now - start, epoch_end=False)
    point = m.state.validation_curve[-1]
    assert (point["training_seconds"], point["seconds"], point["update"]) == (5.0, 50.0, 5)
    assert m.state.target_reached["training_seconds"] == 5.0


def test_the_final_validation_result_adds_its_perplexity_and_tokens_per_second():
    result = metrics.final_validation_result({"loss": 2.0, "tokens": 1000}, 4.0)
    assert result == {"loss": 2.0, "tokens": 1000, "perplexity": math.exp(2.0), "seconds": 4.0, "split": "full",
                      "validation_complete": True, "tokens_per_second": 1000 / 4.0}
