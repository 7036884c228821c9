"""compare.py --mode=time-to-target: the t-test verdict, the speed-up and the per-run summary as pure functions,
the mode's refusals, and one end-to-end run of the mode through real train.py subprocesses on the tiny CPU config."""
import math
import statistics

import numpy as np
import pytest
import torch
from scipy import stats

import compare
import time_to_target
import settings
from results import lookup, read_results
from tests.conftest import write_cache
from tests.test_compare import PNG_MAGIC, TINY
from time_to_target import (failed_outcome, regime_note, save_figure, median_seconds, run_outcome, speedup,
                            speedup_line, start_regime, table, target_section, target_verdict, verdict_line,
                            verdict_losses)

TARGET = 3.28


def entry(curve_losses, seconds=60.0, reached=None, status="complete", seed=1, target=TARGET):
    """A results entry as train.py records one with target_loss set: its validation curve every 10 updates."""
    curve = [{"epoch": 1, "update": 10 * (i + 1), "tokens": 1000 * (i + 1), "loss": loss, "seconds": 0.1,
              "training_seconds": seconds * (i + 1) / len(curve_losses)} for i, loss in enumerate(curve_losses)]
    return {"status": status, "config": {"seed": seed}, "step": 10 * len(curve_losses), "training_seconds": seconds,
            "validation_curve": curve, "target": {"loss": target, "reached": reached, "stop_at_target": False}}


def test_the_figure_names_every_seed_with_the_target_in_its_legend(tmp_path):
    """The target line's legend was rebuilt from the drawn lines, dropping a seed stopped before its first
    validation point; a seed with one point is a dot."""
    fig = save_figure(tmp_path / "t.png", [("s1", entry([3.5, 3.2])), ("s2", entry([3.4])), ("s3", entry([]))],
                      TARGET, "t")
    ax, = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["s1", "s2", "s3: no validation curve",
                                                                  f"target {TARGET:g}"]
    assert ax.lines[1].get_marker() == "o" and (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)


# ---------------------------------------------------------------- the t-test verdict

def test_losses_clearly_below_the_target_reach_it_at_p_below_001():
    losses = {f"r-seed{i}": loss for i, loss in enumerate((3.200, 3.210, 3.190, 3.205, 3.195))}
    v = target_verdict(losses, TARGET)
    assert v["reaches_target"] and v["reasons"] == [] and v["n_runs"] == 5
    expected = stats.ttest_1samp(list(losses.values()), TARGET, alternative="less")
    assert v["p_value"] == pytest.approx(expected.pvalue) and v["p_value"] < 0.01
    assert v["t_statistic"] == pytest.approx(expected.statistic)
    assert v["mean_loss"] == pytest.approx(3.2) and v["loss_std"] == pytest.approx(statistics.stdev(losses.values()))
    # two identical losses have no spread (scipy would warn and give nan): certainly below the target
    same = target_verdict({"a": 3.0, "b": 3.0}, TARGET)
    assert same["reaches_target"] and same["p_value"] == 0.0


def test_a_mean_below_the_target_misses_it_when_too_spread():
    losses = {"a": 3.270, "b": 3.200, "c": 3.279, "d": 3.100, "e": 3.275}
    v = target_verdict(losses, TARGET)
    assert v["mean_loss"] < TARGET and 0.01 <= v["p_value"] < 0.5
    assert not v["reaches_target"] and len(v["reasons"]) == 1 and "not below 3.28 at p < 0.01" in v["reasons"][0]
    # with 3 runs the mean must lie about 7 standard errors below (t_2 at 0.99 is 6.96); 6 is not enough
    se = 0.01 / math.sqrt(3)
    three = {"a": TARGET - 6 * se - 0.01, "b": TARGET - 6 * se, "c": TARGET - 6 * se + 0.01}
    assert not target_verdict(three, TARGET)["reaches_target"]
    assert target_verdict({k: v - se for k, v in three.items()}, TARGET)["reaches_target"]


def test_a_seed_at_or_above_the_target_misses_it_whatever_the_t_test_says():
    # four seeds far below and one above: the t-test alone passes (p = 0.009), the verdict does not
    losses = {"a": 3.0, "b": 3.0, "c": 3.0, "d": 3.0, "e": 3.29}
    v = target_verdict(losses, TARGET)
    assert v["p_value"] < 0.01 and not v["reaches_target"]
    assert v["reasons"] == ["not below the target 3.28: e 3.2900"]
    at = target_verdict({"a": 3.0, "b": 3.01, "c": TARGET}, TARGET)
    assert not at["reaches_target"] and "c 3.2800" in at["reasons"][0]


def test_a_run_that_never_reached_or_failed_misses_it():
    outcomes = {"a": run_outcome(entry([3.5, 3.1], reached={"training_seconds": 50.0})),
                "b": run_outcome(entry([3.5, 3.1], reached={"training_seconds": 55.0})),
                "never": run_outcome(entry([3.6, 3.4, 3.35]))}
    v = target_verdict(verdict_losses(outcomes), TARGET)
    assert not v["reaches_target"] and v["reasons"][0] == "not below the target 3.28: never 3.3500"
    outcomes["never"] = failed_outcome(3, "the candidate run r-seed3 exited with status 1")
    v = target_verdict(verdict_losses(outcomes), TARGET)
    assert not v["reaches_target"] and "no final loss from never" in v["reasons"][0]
    # a run stopped on an error keeps its curve, but its last point is not the recipe's result
    outcomes["never"] = run_outcome(entry([3.5, 3.0], status="failed"))
    assert verdict_losses(outcomes)["never"] is None


def test_fewer_than_two_runs_are_not_a_pass():
    one = target_verdict({"a": 3.0}, TARGET)
    assert not one["reaches_target"] and one["reasons"] == ["a t-test needs at least 2 final losses, got 1"]
    assert one["p_value"] is None and one["mean_loss"] == 3.0 and one["loss_std"] is None
    none = target_verdict({}, TARGET)
    assert not none["reaches_target"] and "got 0" in none["reasons"][0] and none["mean_loss"] is None
    nan = target_verdict({"a": 3.0, "b": float("nan")}, TARGET)
    assert not nan["reaches_target"] and len(nan["reasons"]) == 2


# ---------------------------------------------------------------- the speed-up and the per-run summary

def test_the_speedup_and_its_spread():
    up = speedup({"b1": 90.0}, {"c1": 30.0, "c2": 45.0, "c3": 60.0})
    assert up["speedup"] == pytest.approx(2.0) and up["reason"] is None
    assert (up["baseline_seconds_to_target"], up["candidate_median_seconds"]) == (90.0, 45.0)
    assert up["over_candidate_seeds"] == pytest.approx([1.5, 3.0]) and up["over_baseline_seeds"] is None
    two = speedup({"b1": 80.0, "b2": 100.0}, {"c1": 30.0, "c2": 60.0})
    assert two["speedup"] == pytest.approx(2.0) and two["over_baseline_seeds"] == pytest.approx([80 / 45, 100 / 45])
    assert two["over_candidate_seeds"] == pytest.approx([1.5, 3.0])
    never = speedup({"b1": 80.0, "b2": None}, {"c1": 30.0})
    assert never["speedup"] is None and never["reason"] == "the baseline never reached the target in b2"
    assert never["at_least"] is None  # b2's whole training time is unknown: no bound
    bound = speedup({"b1": 80.0, "b2": None}, {"c1": 30.0, "c2": 50.0}, {"b1": 120.0, "b2": 100.0})
    assert bound["speedup"] is None and bound["at_least"] == pytest.approx(90.0 / 40.0)
    assert "at least 2.25x" in speedup_line(bound)
    assert speedup({"b1": 80.0}, {"c1": 40.0})["at_least"] is None  # measured, no bound needed
    assert speedup({"b1": 80.0}, {})["reason"] == "no completed candidate run"


def test_a_failed_baseline_run_is_named_as_failed_not_as_one_that_never_reached_the_target(tmp_path):
    """A baseline run whose train.py failed was reported as one that "never reached the target"."""
    up = speedup({"b1": 80.0, "b2": None}, {"c1": 30.0}, {"b1": 120.0}, {"b1": "complete", "b2": "failed"})
    assert up["speedup"] is None and up["reason"] == "the baseline run b2 failed" and up["at_least"] is None
    both = speedup({"b1": None, "b2": None}, {"c1": 30.0}, {"b1": 120.0}, {"b1": "complete", "b2": "failed"})
    assert both["reason"] == "the baseline run b2 failed; the baseline never reached the target in b1"
    assert both["at_least"] is None  # b2 trained no whole recipe: no bound
    diverged = speedup({"b1": None}, {"c1": 30.0}, {}, {"b1": "diverged"})
    assert diverged["reason"] == "the baseline run b1 did not complete (status diverged)"
    # the mode's record passes the baseline runs' statuses: one failed, one complete that never reached the target
    cfg = settings.Config(target_loss=TARGET, eval_interval=10, target_baseline="base.py")
    candidates = [settings.Config(name=f"r-seed{s}", seed=s) for s in (1, 2)]
    baselines = [settings.Config(name=f"r-target-baseline-seed{s}", seed=s) for s in (1, 2)]
    results = {"r-seed1": entry([3.2]), "r-seed2": entry([3.1]), "r-target-baseline-seed1": entry([3.5], seconds=90.0)}
    failed = {"r-target-baseline-seed2": "the target baseline run r-target-baseline-seed2 exited with status 1"}
    section = target_section(cfg, results, candidates, baselines, failed, tmp_path / "p.png")
    assert section["speedup"]["reason"] == ("the baseline run r-target-baseline-seed2 failed; the baseline never "
                                            "reached the target in r-target-baseline-seed1")
    assert "r-target-baseline-seed2 failed" in "\n".join(table(section))


def test_the_recipe_differences_come_from_finished_runs_not_a_failed_seeds_older_entry(tmp_path):
    """A failed seed's entry may be an older run's (another recipe): the differences were read from it."""
    cfg = settings.Config(target_loss=TARGET, eval_interval=10, target_baseline="base.py")
    candidates = [settings.Config(name=f"r-seed{s}", seed=s) for s in (1, 2)]
    baselines = [settings.Config(name="r-target-baseline-seed1", seed=1)]
    adamw, muon = {"optimizer": "adamw", "learning_rate": 3e-3}, {"optimizer": "muon", "learning_rate": 3e-3}
    results = {"r-seed1": dict(entry([3.2]), recipe=dict(adamw, learning_rate=9.9)),  # an older run's entry
               "r-seed2": dict(entry([3.1]), recipe=muon),
               "r-target-baseline-seed1": dict(entry([3.5], seconds=90.0), recipe=adamw)}
    failed = {"r-seed1": "the run r-seed1 exited with status 1"}
    section = target_section(cfg, results, candidates, baselines, failed, tmp_path / "p.png")
    assert section["candidate_runs"]["r-seed1"]["status"] == "failed"
    assert section["recipe_differences"] == ["optimizer"]


def test_the_speedup_divides_medians_not_means():
    """Skewed seeds, where a median and a mean differ (every other case here has them equal): one slow seed
    moves neither the candidate's time nor the baseline's."""
    cand, base = {"c1": 10.0, "c2": 20.0, "c3": 60.0}, {"b1": 50.0, "b2": 60.0, "b3": 200.0}
    up = speedup(base, cand)
    assert (up["baseline_seconds_to_target"], up["candidate_median_seconds"], up["speedup"]) == (60.0, 20.0, 3.0)
    bound = speedup(dict(base, b2=None), cand, {"b2": 60.0})  # b2 never reached it in its 60 s
    assert bound["speedup"] is None and bound["at_least"] == pytest.approx(3.0)
    outcome = lambda s: {"status": "complete", "training_seconds": s}
    assert median_seconds({name: outcome(s) for name, s in cand.items()}) == 20.0


def test_the_run_summary_reads_the_final_loss_the_training_seconds_and_the_target():
    reached = {"update": 20, "tokens": 2000, "training_seconds": 31.5, "loss": 3.27, "epoch": 1}
    o = run_outcome(entry([3.6, 3.27, 3.21], seconds=61.0, reached=reached, seed=7))
    assert o == {"status": "complete", "seed": 7, "final_loss": 3.21, "training_seconds": 61.0, "updates": 30,
                 "reached": reached, "seconds_to_target": 31.5, "first_update_seconds": None, "start": "eager",
                 "sessions": None}
    diverged = run_outcome(dict(entry([3.6, None]), target=None))  # results.py writes a NaN loss as null
    assert diverged["final_loss"] is None and diverged["reached"] is None
    assert run_outcome({})["final_loss"] is None
    assert median_seconds({"a": o, "b": dict(o, training_seconds=40.0), "f": failed_outcome(9, "x")}) == 50.5


def test_a_failed_baseline_run_fails_the_command_though_the_target_is_reached(tmp_path, monkeypatch, capsys):
    """compare.py exited 0 when the candidate reached the target beside a failed target-baseline run (train_all
    goes on past it), though its exit status is 1 when a training run failed; the verdict stands as recorded."""
    cfg = settings.Config(target_loss=TARGET, eval_interval=10, target_baseline="base.py")
    candidates = [settings.Config(name=f"r-seed{s}", seed=s) for s in range(5)]
    baselines = [settings.Config(name="r-target-baseline-seed0", seed=0)]
    results = {c.name: entry([3.20 + 0.001 * c.seed], seconds=50.0, seed=c.seed) for c in candidates}
    failed = {"r-target-baseline-seed0": "the target baseline run r-target-baseline-seed0 exited with status 1"}
    section = target_section(cfg, results, candidates, baselines, failed, tmp_path / "p.png")
    assert section["reaches_target"] and section["baseline_runs"]["r-target-baseline-seed0"]["status"] == "failed"
    monkeypatch.setattr(compare, "compare", lambda cfg: section)
    assert compare.main(["--mode=time-to-target", f"--target_loss={TARGET}"]) == 1
    assert capsys.readouterr().err == "error: r-target-baseline-seed0 failed (the output above says why)\n"
    del failed["r-target-baseline-seed0"]
    results["r-target-baseline-seed0"] = entry([3.25], seconds=80.0, reached={"training_seconds": 70.0})
    section = target_section(cfg, results, candidates, baselines, failed, tmp_path / "p.png")
    assert compare.main(["--mode=time-to-target", f"--target_loss={TARGET}"]) == 0


def test_a_seed_resumed_over_several_sessions_says_so_in_the_table_and_the_record(tmp_path):
    """A resumed seed's training seconds hold each session's recompile, so its time is not an uninterrupted
    run's: the table's first-update column and the recorded run summary say how many sessions trained it."""
    resumed = dict(entry([3.2], seconds=61.0), sessions=2, first_update_seconds=2.2)
    assert run_outcome(resumed)["sessions"] == 2 and run_outcome(entry([3.2]))["sessions"] is None
    cfg = settings.Config(target_loss=TARGET, eval_interval=10, target_baseline="")
    candidates = [settings.Config(name=f"r-seed{s}", seed=s) for s in (1, 2)]
    results = {"r-seed1": resumed, "r-seed2": dict(entry([3.1]), sessions=1, first_update_seconds=2.0)}
    section = target_section(cfg, results, candidates, [], {}, tmp_path / "p.png")
    assert [o["sessions"] for o in section["candidate_runs"].values()] == [2, 1]
    assert section["median_training_seconds"] == pytest.approx((61.0 + 60.0) / 2)  # the arithmetic as it was
    rows = table(section)[1:3]
    assert rows[0].endswith("eager 2.2 s, 2 sessions") and rows[1].endswith("eager 2.0 s")


def test_each_run_says_how_it_started_and_a_warm_side_against_a_cold_one_is_named():
    compiled = lambda made, cached: {"config": {"compile": True}, "first_update_graphs": {"compiled": made,
                                                                                          "from_cache": cached}}
    assert [start_regime(compiled(*c)) for c in ((2, 0), (0, 2), (1, 1))] == ["cold", "warm", "part-warm"]
    assert start_regime({"config": {"compile": True}}) is None  # an entry recorded before it was kept
    assert start_regime({}) is None and start_regime({"config": {"compile": False}}) == "eager"
    warm, cold = run_outcome(dict(entry([3.2]), **compiled(0, 2))), run_outcome(dict(entry([3.2]), **compiled(2, 0)))
    assert regime_note({"candidate_runs": {"a": warm}, "baseline_runs": {"b": warm}}) == ""
    note = regime_note({"candidate_runs": {"a": warm}, "baseline_runs": {"b": cold, "c": warm}})
    assert "candidate warm, baseline cold, warm" in note


# ---------------------------------------------------------------- the mode

@pytest.fixture
def tiny(text_cache, tmp_path, monkeypatch):
    """The tests' tiny CPU config at 1 epoch of 32 updates and a results file, in tmp_path (out/ goes there)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.py"
    path.write_text(TINY.format(cache=str(text_cache)) + "epochs = 1\nmicro_batch_size = 4\nfull_validation = False\n")
    return str(path), str(tmp_path / "results.json")


def test_the_mode_refuses_mistakes_in_one_line(tiny, tmp_path, capsys):
    config, results = tiny
    mode = [config, f"--results_file={results}", "--mode=time-to-target"]
    other_tokens = tmp_path / "other.py"
    other_tokens.write_text(open(config).read() + "val_subset_tokens = 1024\n")
    gpu = tmp_path / "gpu.py"
    gpu.write_text(open(config).read() + "device = 'cuda'\n")
    for argv, words in ((mode, "needs --target_loss=L > 0"),
                        (mode + ["--target_loss=3", "--tuned=True", "--noise_seed_runs=2"],
                         "--tuned, --noise_seed_runs belong to --mode=matched"),
                        ([config, "--seeds=3"], "--seeds belong to --mode=time-to-target"),
                        (mode + ["--target_loss=3", "--stop_at_target=True"], "stop_at_target is refused"),
                        (mode + ["--target_loss=3", "--target_baseline_seeds=3"],  # trained no baseline, said nothing
                         "--target_baseline_seeds=3 needs --target_baseline"),
                        (mode + ["--target_loss=3", "--seeds=1"], "the t-test needs at least 2 runs"),
                        (mode + ["--target_loss=3", "--target_baseline=nope.py"], "nope.py is not a file"),
                        (mode + ["--target_loss=3", f"--target_baseline={other_tokens}"],
                         "val_subset_tokens 2048 against 1024"),
                        (mode + ["--target_loss=3", f"--target_baseline={gpu}"],
                         "target baseline (as " if not torch.cuda.is_available() else "on cpu and"),
                        (mode + ["--target_loss=3", "--plot=t.xyz"], "must end in .png")):
        assert compare.main(argv) == 2, words
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert read_results(results) == {}  # nothing trained


def test_the_mode_end_to_end_misses_an_unreachable_target_and_reaches_a_reachable_one(tiny, tmp_path, capsys):
    config, results = tiny
    argv = [config, "--name=tt", f"--results_file={results}", "--mode=time-to-target", "--seeds=2",
            "--eval_interval=8"]
    assert compare.main(argv + ["--target_loss=1.0"]) == 1
    out = capsys.readouterr().out
    assert "[candidate] " in out and "misses the target 1: not below the target 1: tt-seed1337" in out
    miss = lookup(results, ["time-to-target", "tt"])
    assert list(miss["candidate_runs"]) == ["tt-seed1337", "tt-seed1338"] and miss["baseline_runs"] == {}
    assert not miss["reaches_target"] and miss["speedup"] is None and miss["target_loss"] == 1.0
    assert all(o["reached"] is None and o["final_loss"] > 1.0 for o in miss["candidate_runs"].values())

    # With 2 seeds p < 0.01 needs a mean 32 standard errors below the target, so the target reachable here is
    # set from the losses just measured (the same seeds train the same math again: target_loss is execution).
    losses = [o["final_loss"] for o in miss["candidate_runs"].values()]
    target = round(statistics.mean(losses) + max(0.2, 45 * statistics.stdev(losses) / math.sqrt(2)), 3)
    baseline = tmp_path / "baseline.py"
    baseline.write_text(open(config).read())
    reach = argv + [f"--target_loss={target}", f"--target_baseline={baseline}"]
    assert compare.main(reach) == 0
    out = capsys.readouterr().out
    assert "[target baseline] " in out and f"reaches the target {target:g}" in out and "speed-up" in out
    s = lookup(results, ["time-to-target", "tt"])
    runs = read_results(results)
    assert s["reaches_target"] and s["reasons"] == [] and s["p_value"] < 0.01 and s["n_runs"] == 2
    assert s["target_loss"] == target and s["eval_interval"] == 8 and s["baseline_config"] == str(baseline)
    for name, o in s["candidate_runs"].items():
        run = runs[name]
        assert o["final_loss"] == run["validation_curve"][-1]["loss"] < target
        assert o["training_seconds"] == run["training_seconds"] and o["reached"] == run["target"]["reached"]
        assert run["step"] == run["total_updates"] == 32 and not run["config"]["stop_at_target"]  # to the end
        assert len(run["validation_curve"]) == 4  # every 8 updates, the last at the epoch's end
    assert s["mean_loss"] == pytest.approx(statistics.mean(o["final_loss"] for o in s["candidate_runs"].values()))
    assert s["median_training_seconds"] == pytest.approx(
        statistics.median(o["training_seconds"] for o in s["candidate_runs"].values()))
    # the baseline stops at the target: its time to first reach it over the candidate's median is the speed-up
    b = runs["tt-target-baseline-seed1337"]
    assert list(s["baseline_runs"]) == ["tt-target-baseline-seed1337"] and b["config"]["stop_at_target"]
    assert b["status"] == "complete" and b["target"]["reached"]["update"] == b["step"] <= b["total_updates"]
    assert s["speedup"]["speedup"] == pytest.approx(
        b["target"]["reached"]["training_seconds"] / s["median_training_seconds"])
    assert s["recipe_differences"] == [] and s["verdict"] == verdict_line(s)
    png = (tmp_path / "out" / "tt-time-to-target.png").read_bytes()
    assert s["plot"] == "out/tt-time-to-target.png" and png.startswith(PNG_MAGIC)
    assert any(h["path"] == ["time-to-target", "tt"] for h in runs["history"])  # the miss, kept
    # the printed table: a row per run, then the test, the time, the speed-up and the verdict
    lines = table(s)
    assert lines[0].split() == ["run", "status", "final", "loss", "training", "s", "reached", "at", "s", "first", "update"]
    assert all(line.split()[5] == "eager" for line in lines[1:4])  # tiny_cpu compiles nothing
    assert [line.split()[0] for line in lines[1:4]] == ["tt-seed1337", "tt-seed1338", "tt-target-baseline-seed1337"]
    assert "\n".join(lines) in out
    # the same command again reuses every finished run (they have no full validation, which this mode never asks)
    assert compare.main(reach) == 0
    out = capsys.readouterr().out
    assert out.count("reusing the complete run") == 3 and "[candidate] " not in out and "[target baseline] " not in out


def test_a_plot_that_cannot_be_written_after_the_runs_leaves_the_verdict_recorded(tiny, monkeypatch, capsys):
    """The figure is written after every run has trained: a full disk there was a traceback over the verdict."""
    config, results = tiny
    monkeypatch.setattr(time_to_target, "train_all", lambda cfg, runs, keep_going: {})  # nothing to train here
    def disk_full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(time_to_target, "save_figure", disk_full)
    compare.main([config, "--name=tt", f"--results_file={results}", "--mode=time-to-target", "--seeds=2",
                  "--target_loss=3"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "could not be written (No space left on device)" in err
    assert "tt" in read_results(results)["time-to-target"]


def test_losses_all_at_the_target_give_no_evidence_below_it():
    """Identical losses exactly at the target: the mean is not below it, so p is 1 (scipy's t-test divides 0 by a
    spread of 0 there and gives nan; a mean at the target is no certainty of one below it, p 0)."""
    at = target_verdict({"a": TARGET, "b": TARGET, "c": TARGET}, TARGET)
    assert not at["reaches_target"] and at["p_value"] == 1.0 and at["t_statistic"] is None
    assert at["reasons"][-1] == f"the mean {TARGET:.4f} is not below {TARGET:g} at p < 0.01 (p = 1)"
    above = target_verdict({"a": TARGET + 0.5, "b": TARGET + 0.5}, TARGET)
    assert above["p_value"] == 1.0 and above["t_statistic"] == math.inf


def test_the_median_training_time_is_over_the_completed_seeds_only():
    """A seed that stopped early (diverged, interrupted) has training seconds, but not the recipe's time."""
    outcomes = {"a": run_outcome(entry([3.2], seconds=60.0)), "b": run_outcome(entry([3.1], seconds=80.0)),
                "d": run_outcome(entry([3.9], seconds=5.0, status="diverged"))}
    assert median_seconds(outcomes) == statistics.median([60.0, 80.0])
    assert median_seconds({"d": outcomes["d"]}) is None


def test_a_failed_candidate_seed_leaves_the_speedup_over_the_completed_ones(tmp_path):
    """The speed-up divides the baseline's time to the target by the median of the seeds that completed; a failed
    seed (no training time) is left out of it, as it is of the median training time, rather than voiding it."""
    cfg = settings.Config(target_loss=TARGET, eval_interval=10, target_baseline="base.py")
    candidates = [settings.Config(name=f"r-seed{s}", seed=s) for s in (1, 2, 3)]
    baselines = [settings.Config(name="r-target-baseline-seed1", seed=1)]
    results = {"r-seed1": entry([3.2], seconds=40.0), "r-seed2": entry([3.1], seconds=60.0),
               "r-target-baseline-seed1": entry([3.25], seconds=100.0, reached={"training_seconds": 90.0})}
    failed = {"r-seed3": "the candidate run r-seed3 exited with status 1"}
    section = target_section(cfg, results, candidates, baselines, failed, tmp_path / "p.png")
    up = section["speedup"]
    assert up["reason"] is None and up["candidate_median_seconds"] == section["median_training_seconds"] == 50.0
    assert up["speedup"] == pytest.approx(90.0 / 50.0)
    assert up["over_candidate_seeds"] == pytest.approx([90.0 / 60.0, 90.0 / 40.0])


def test_a_speedup_without_a_baseline_run_or_with_a_zero_time_says_why():
    none = speedup({}, {"c1": 30.0})
    assert (none["speedup"], none["reason"], none["at_least"]) == (None, "no baseline run", None)
    zero = speedup({"b1": 80.0}, {"c1": 0.0, "c2": 30.0})  # no division by a time of 0
    assert (zero["speedup"], zero["reason"], zero["at_least"]) == (None, "no training time from c1", None)


def test_a_baseline_that_scores_other_windows_or_another_cache_is_refused(tiny, tmp_path, capsys):
    """A validation-subset loss over windows of another seq_len, or over another cache's tokens, is another
    quantity: a target reached on it says nothing of the config's."""
    config, results = tiny
    mode = [config, f"--results_file={results}", "--mode=time-to-target", "--target_loss=3"]
    shorter = tmp_path / "shorter.py"
    shorter.write_text(open(config).read() + "seq_len = 32\n")
    other = write_cache(tmp_path / "other-cache", np.arange(9000) % 256, np.arange(3000) % 256, 256)
    elsewhere = tmp_path / "elsewhere.py"
    elsewhere.write_text(open(config).read() + f"data_dir = {str(other)!r}\n")
    for baseline, words in ((shorter, "(seq_len 64 against 32)"), (elsewhere, "another cache")):
        assert compare.main(mode + [f"--target_baseline={baseline}"]) == 2, words
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert read_results(results) == {}  # nothing trained
