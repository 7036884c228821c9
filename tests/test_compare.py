"""compare.py: matched runs through real train.py subprocesses, the verdict both ways (training noise counted,
broken math caught), signals passed to the training child, and the read-only mode."""
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import configurator
import dashboard
import env
from results import lookup, read_results, record
import compare
import matched
import runs as runs_lib
import settings
import time_to_target
import train

TINY = """\
preset = "20m"
dim = 64
n_layers = 2
n_heads = 2
hidden_dim = 128
seq_len = 64
data_dir = {cache!r}
device = "cpu"
cpu_threads = 1
epochs = 2
train_subset_tokens = 8192
val_subset_tokens = 2048
tokens_per_update = 256
warmup_updates = 5
learning_rate = 1e-2
min_lr = 1e-3
log_interval = 1000
"""
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]
# A test-only break of a run's math that leaves its recipe as it is, loaded into the train.py child that
# BREAK_RUN names (through PYTHONPATH, before train.py runs): the second half of every sequence is trained to
# predict its input token instead of the next one, as a loss kernel that misaligns its targets would.
BREAK_HOOK = """\
import os, sys
if "--name=" + os.environ.get("BREAK_RUN", "") in sys.argv:
    sys.path.insert(0, os.environ["BREAK_REPO"])
    import torch
    import trainer
    update = trainer.Trainer.update

    def misaligned(self, micro_batches, n_tokens):
        def targets(x, y):
            h = y.shape[1] // 2
            return torch.cat([y[:, :h], torch.where(y[:, h:] == -100, y[:, h:], x[:, h:])], dim=1)
        return update(self, [(x, targets(x, y)) for x, y in micro_batches], n_tokens)

    trainer.Trainer.update = misaligned
    print("test hook: targets misaligned in", os.environ["BREAK_RUN"], flush=True)
"""


@pytest.fixture
def tiny(text_cache, tmp_path, monkeypatch):
    """A tiny config and a results file in tmp_path, which is also the working folder (out/ goes there)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.py"
    path.write_text(TINY.format(cache=str(text_cache)))
    return str(path), str(tmp_path / "results.json")


def check_the_read_only_mode(results, c, tmp_path, capsys):
    """Two finished runs compared by name give comparison c's verdict again, the baseline's noise run found by
    its name; the earlier comparison moves to the history; an unknown or unfinished run is a one-line error."""
    runs = read_results(results)
    plot = tmp_path / "read-only.png"
    assert compare.main([f"--results_file={results}", "--baseline=m-baseline", "--optimized=m-optimized",
                         f"--plot={plot}"]) == 0
    c2 = lookup(results, ["matched-comparison"])
    assert c2["run_id"] != c["run_id"] and c2["recipe_equal_except_execution"] and c2["plot"] == str(plot)
    assert c2["loss_difference"] == c["loss_difference"] and c2["tolerance"] == c["tolerance"]
    assert c2["noise_runs"] == c["noise_runs"]
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert any(h["path"] == ["matched-comparison"] for h in read_results(results)["history"])

    # An unknown name and an unfinished run are one-line errors naming the run.
    capsys.readouterr()
    assert compare.main([f"--results_file={results}", "--baseline=m-baseline", "--optimized=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'nope'" in err and "m-optimized" in err and "Traceback" not in err
    record(results, ["m-cut"], dict(runs["m-optimized"], status="interrupted", run_id="cut"))
    assert compare.main([f"--results_file={results}", "--baseline=m-baseline", "--optimized=m-cut"]) == 2
    err = capsys.readouterr().err
    assert "m-cut" in err and "interrupted" in err and err.count("\n") == 1


def test_matched_runs_pass_broken_math_fails_runs_are_reused_and_rereadable(tiny, tmp_path, monkeypatch, capsys):
    """The default verdict on the CPU config: one noise run (the baseline at seed + 1) measures training noise;
    a same-math execution passes, and a run of the same recipe whose math is broken does not."""
    config, results = tiny
    # 1 x 4 accumulation against 4 x 1: the same updates, summed in another order.
    argv = [config, "--name=m", f"--results_file={results}", "--baseline_micro_batch_size=1", "--micro_batch_size=4"]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert "[baseline] " in out and "[optimized] " in out and "[noise] " in out and "verdict" in out
    c = lookup(results, ["matched-comparison"])
    assert c["baseline"] == "m-baseline" and c["optimized"] == "m-optimized"
    assert c["recipe_identity_equal"] and c["recipe_differences"] == []
    assert c["losses_agree"] and c["recipe_equal_except_execution"] and c["label"] == "matched run"
    assert abs(c["loss_difference"]) <= c["tolerance"] and "3 * sqrt" in c["tolerance_rule"]
    assert c["speed_ratio"] == pytest.approx(
        lookup(results, ["m-optimized", "median_training_tokens_per_second"])
        / lookup(results, ["m-baseline", "median_training_tokens_per_second"]))
    assert list(c["runs"]) == ["m-baseline", "m-optimized"]
    for name in ("m-baseline", "m-optimized"):
        run = c["runs"][name]
        assert run["result"]["status"] == "complete"
        assert not {"environment", "config", "recipe"} & set(run["result"])
        assert len(run["validation_curve"]) == 2
        assert {"tokens", "loss", "seconds"} <= set(run["validation_curve"][0])
        assert run["final_validation"]["loss"] == run["result"]["final_validation"]["loss"]
    runs = read_results(results)
    assert runs["m-baseline"]["config"]["micro_batch_size"] == 1
    assert runs["m-optimized"]["config"]["micro_batch_size"] == 4
    # The noise run: the baseline's execution and recipe but the seed, and the tolerance covers 3 x its
    # difference from the baseline (or the validation noise, when larger).
    noise = runs["m-baseline-seed1338"]
    assert noise["status"] == "complete" and noise["config"]["micro_batch_size"] == 1
    assert settings.recipe_differences(runs["m-baseline"]["recipe"], noise["recipe"]) == ["seed"]
    d = noise["final_validation"]["loss"] - runs["m-baseline"]["final_validation"]["loss"]
    assert c["noise_runs"] == {"m-baseline-seed1338": noise["final_validation"]["loss"]}
    assert c["training_noise_tolerance"] == pytest.approx(3 * abs(d))
    assert c["tolerance"] == pytest.approx(max(c["validation_tolerance"], 3 * abs(d)))
    assert c["plot"] == "out/m-comparison.png"
    png = (tmp_path / c["plot"]).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    # The same command again reuses the three complete runs instead of training.
    assert compare.main(argv) == 0
    assert capsys.readouterr().out.count("reusing the complete run") == 3
    again = read_results(results)
    assert again["m-baseline"]["run_id"] == runs["m-baseline"]["run_id"]
    assert again["m-baseline-seed1338"]["run_id"] == noise["run_id"]

    check_the_read_only_mode(results, c, tmp_path, capsys)

    # Broken math under the same recipe identity: the optimized run (now micro-batch 2, so it trains again
    # while the baseline and its noise run are reused) is trained with misaligned targets.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BREAK_HOOK)
    monkeypatch.setenv("PYTHONPATH", str(hook))
    monkeypatch.setenv("BREAK_REPO", str(REPO))
    monkeypatch.setenv("BREAK_RUN", "m-optimized")
    assert compare.main(argv[:-1] + ["--micro_batch_size=2"]) == 1
    out = capsys.readouterr().out
    assert "[optimized] test hook: targets misaligned in m-optimized" in out and "not shown" in out
    assert out.count("reusing the complete run") == 2
    broken = lookup(results, ["matched-comparison"])
    assert broken["recipe_identity_equal"] and broken["label"] == "matched run"
    assert not broken["losses_agree"] and not broken["recipe_equal_except_execution"]
    assert abs(broken["loss_difference"]) > broken["tolerance"] and broken["noise_runs"] == c["noise_runs"]


def test_recipe_change_is_refused_unless_allowed(tiny, capsys):
    config, results = tiny
    # noise_seed_runs=0: no noise run is trained, and the tolerance says it counts no training noise.
    argv = [config, "--name=r", f"--results_file={results}", "--baseline_micro_batch_size=1",
            "--micro_batch_size=4", "--optimized_overrides=--learning_rate=1e-4 --min_lr=1e-5", "--noise_seed_runs=0"]
    # Refused before any training: the recipes are known from the configs.
    assert compare.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "learning_rate" in err and "--allow_recipe_change" in err
    assert err.count("\n") == 1
    assert read_results(results) == {}

    assert compare.main(argv + ["--allow_recipe_change=True"]) == 0
    c = lookup(results, ["matched-comparison"])
    assert c["label"] == "recipe change"
    assert not c["recipe_identity_equal"] and "learning_rate" in c["recipe_differences"]
    assert not c["losses_agree"] and abs(c["loss_difference"]) > c["tolerance"]
    assert not c["recipe_equal_except_execution"]
    assert c["tolerance"] == c["validation_tolerance"] and "training noise is not counted" in c["tolerance_rule"]
    runs = read_results(results)
    assert runs["r-optimized"]["config"]["learning_rate"] == 1e-4
    assert runs["r-baseline"]["config"]["learning_rate"] == 1e-2
    assert not [name for name in runs if "seed" in name]

    # Read-only comparison of the same runs is refused too, naming the field.
    capsys.readouterr()
    assert compare.main([f"--results_file={results}", "--baseline=r-baseline", "--optimized=r-optimized"]) == 2
    assert "learning_rate" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["SIGTERM to compare.py", "SIGINT to its process group, as Ctrl-C sends it"])
def test_a_signal_stops_the_training_child_checkpointed_and_a_rerun_resumes_it(tiny, tmp_path, capsys, how):
    """Stopping compare.py stops its train.py child as train.py stops (checkpointed, status interrupted, never a
    broken pipe), once even when the signal reaches the whole process group; compare.py then exits with
    status 3 and one line saying how to resume, and the same command again resumes the run."""
    config, results = tiny
    argv = [config, "--name=s", f"--results_file={results}", "--baseline_micro_batch_size=1",
            "--micro_batch_size=4", "--noise_seed_runs=0", "--log_interval=2"]
    proc = subprocess.Popen([sys.executable, str(REPO / "compare.py"), *argv], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[baseline] update "):  # the child is training, past its signal handlers
                if how.startswith("SIGTERM"):
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                break
        out = "".join(lines) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert proc.returncode == 3, out
    assert f"[baseline] signal {name}: checkpointed at update" in out
    assert "Traceback" not in out and "BrokenPipe" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {name}: the baseline run s-baseline is checkpointed (status interrupted)")
    assert "run this compare.py command again" in last and "compare_config.py" in last and "--resume=True" in last
    runs = read_results(results)
    interrupted = runs["s-baseline"]
    assert interrupted["status"] == "interrupted" and 0 < interrupted["step"] < interrupted["total_updates"]
    assert (tmp_path / "out" / "s-baseline" / "ckpt.pt").is_file() and "s-optimized" not in runs
    if name == "SIGINT":
        return  # the resume below is the same either way
    assert compare.main(argv) == 0
    assert "baseline: resuming the stopped run s-baseline" in capsys.readouterr().out
    done = read_results(results)["s-baseline"]
    assert done["status"] == "complete" and done["run_id"] == interrupted["run_id"] and done["sessions"] == 2


def test_a_run_that_stops_itself_stops_the_comparison(tiny, capsys):
    """A child that stops checkpointed without a signal (stop_after_updates, as a time limit) is not a failed
    run: compare.py stops with status 3 and says how to resume."""
    config, results = tiny
    assert compare.main([config, "--name=q", f"--results_file={results}", "--baseline_micro_batch_size=1",
                         "--micro_batch_size=4", "--stop_after_updates=3"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("stopped by train.py itself: the baseline run q-baseline is checkpointed")
    assert "--resume=True" in err and "\n" not in err
    assert lookup(results, ["q-baseline", "status"]) == "interrupted" and lookup(results, ["q-baseline", "step"]) == 3
    # the same comparison without the limit resumes that run (stop_after_updates is how it ran, not what it is)
    assert compare.main([config, "--name=q", f"--results_file={results}", "--baseline_micro_batch_size=1",
                         "--micro_batch_size=4", "--noise_seed_runs=0"]) == 0
    assert "baseline: resuming the stopped run q-baseline" in capsys.readouterr().out
    assert lookup(results, ["q-baseline", "sessions"]) == 2


class FakeTrainPy:
    """runs.stream in place of a train.py subprocess: it keeps each command and records the entry train.py
    would (status, run_id, the config and recipe identity it ran, on this machine), with a checkpoint of the run,
    and exits with status 0."""

    def __init__(self, status, run_id="r1", **environment):
        self.status, self.run_id, self.environment = status, run_id, environment
        self.identity, self.commands = None, []

    def __call__(self, side, cmd, signals):
        self.commands.append(cmd)
        args = [a for a in cmd[2:] if a.split("=")[0] not in ("--resume", "--overwrite")]
        c = settings.Config(configurator.load_config(runs_lib.TRAIN_DEFAULTS, args))
        machine = {"gpu": env.gpu_model(), "cpu_model": env.cpu_model(), "versions": env.package_versions(("torch",))}
        record(c.results_file, [c.name], {
            "status": self.status, "run_id": self.run_id, "recipe_identity": self.identity, "config": dict(c),
            "final_validation": {"loss": 4.0}, "environment": dict(machine, source_hash=env.source_hash(),
                                                                   **self.environment)})
        ckpt = runs_lib.checkpoint.in_folder(runs_lib.run_dir(c))
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"run_id": self.run_id}, ckpt)
        return 0


def launch(tiny, monkeypatch, fake, times=2):
    """Train the run k times over through runs.train_or_reuse, train.py faked; returns the commands launched."""
    config, results = tiny
    c = settings.load(settings.TrainSettings, [config, "--name=k", f"--results_file={results}", "--micro_batch_size=4"])
    fake.identity = env.hash_json(runs_lib.run_recipe("baseline", c))
    monkeypatch.setattr(runs_lib, "stream", fake)
    for _ in range(times):
        runs_lib.train_or_reuse("baseline", c, fake.identity, False, runs_lib.SignalForwarder())
    return fake.commands


@pytest.mark.parametrize("status", ["running", "aborted", "failed", "interrupted"])
def test_a_run_killed_or_failed_with_its_checkpoint_resumes_from_it(tiny, monkeypatch, capsys, status):
    """A run killed by SIGKILL or out of memory (still "running"), ended by a second signal ("aborted") or by an
    error ("failed") was trained again from update 0, its checkpoint deleted by --overwrite=True, though
    compare.py's message says it resumes from the run's last checkpoint: only "interrupted" resumed."""
    first, second = launch(tiny, monkeypatch, FakeTrainPy(status))
    assert not {"--resume=True", "--overwrite=True"} & set(first)
    assert second[-1] == "--resume=True" and "--overwrite=True" not in second
    assert "baseline: resuming the stopped run k" in capsys.readouterr().out


def test_a_diverged_run_trains_again_rather_than_resuming_from_its_last_finite_weights(tiny, monkeypatch):
    """A rerun resumed a diverged seed from its last finite checkpoint; on a GPU it could then complete and count in
    the verdict, the divergence gone from it. It trains again as it first did."""
    first, second = launch(tiny, monkeypatch, FakeTrainPy("diverged"))
    assert "--resume=True" not in second and second[-1] == "--overwrite=True"


def test_a_checkpoint_of_another_run_is_replaced_not_resumed(tiny, monkeypatch):
    class Replaced(FakeTrainPy):  # the checkpoint left in the folder is not the recorded run's
        def __call__(self, side, cmd, signals):
            code = super().__call__(side, cmd, signals)
            torch.save({"run_id": "another"}, runs_lib.checkpoint.in_folder(Path("out/k")))
            return code
    first, second = launch(tiny, monkeypatch, Replaced("running"))
    assert second[-1] == "--overwrite=True"


@pytest.mark.parametrize("differ", [{"gpu": "another GPU"}, {"cpu_model": "another CPU"},
                                    {"versions": {"torch": "1.0.0"}}])
def test_a_complete_run_of_another_machine_is_not_reused(tiny, monkeypatch, capsys, differ):
    """A complete run recorded on another GPU, CPU or torch (merged in by scripts/merge_results.py) was reused,
    its training seconds counted as this machine's; one line now says why it trains again."""
    first, second = launch(tiny, monkeypatch, FakeTrainPy("complete", **differ))
    assert second[-1] == "--overwrite=True"  # trained again, not resumed: the complete run is the other machine's
    out = capsys.readouterr().out
    key, value = next(iter(differ.items()))
    words = {"gpu": "GPU", "cpu_model": "CPU", "versions": "torch"}[key]
    value = value["torch"] if key == "versions" else value
    assert f"not reusing k: recorded on {words} {value}, this machine has {words} " in out
    assert "reusing the complete run" not in out


def test_a_complete_run_of_this_machine_is_reused(tiny, monkeypatch, capsys):
    first, *again = launch(tiny, monkeypatch, FakeTrainPy("complete"))
    out = capsys.readouterr().out
    assert not again and "baseline: reusing the complete run k" in out and "not reusing" not in out


def test_mistakes_are_one_line_errors(tiny, capsys):
    config, results = tiny
    # The default baseline micro-batch (8) does not divide the 4 sequences of an update.
    assert compare.main([config, f"--results_file={results}", "--micro_batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "baseline run" in err and "baseline_micro_batch_size" in err and "valid sizes: [1, 2, 4]" in err
    for argv, words in (([f"--results_file={results}", "--baseline=a"], "--optimized"),
                        ([config, f"--results_file={results}", "--tuned=True"], "tune.py"),
                        ([config, "--optimized_overrides=--learnin_rate=1"], "learning_rate"),
                        ([config, "--full_validation=False"], "full_validation"),
                        ([config, "--optimized_overrides=--name=foo --micro_batch_size=2"],
                         "--optimized_overrides sets name, which compare.py sets for each run"),
                        ([config, "--overwrite=True"], "--overwrite: compare.py decides them for each run"),
                        ([config, f"--seed={2 ** 64 - 1}"], "give a --seed at most 18446744073709551614"),
                        ([config, "--loss_impl=fused", "--lm_head_fp8=True"], "the matched baseline runs the plain")):
        assert compare.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1
    # a plot path matplotlib cannot write is refused before anything trains
    assert compare.main([config, f"--results_file={results}", "--plot=verdict.xyz"]) == 2
    assert "must end in .png" in capsys.readouterr().err and not read_results(results)


def finished(loss, recipe="r1", speed=1000.0, std=3.0, tokens=1_000_000):
    """A hand-made complete training entry, as train.py records one."""
    return {"status": "complete", "recipe_identity": recipe, "recipe": {"seed": recipe}, "run_id": f"{loss}-{recipe}",
            "final_validation": {"loss": loss, "loss_std": std, "tokens": tokens},
            "median_training_tokens_per_second": speed,
            "validation_curve": [{"epoch": 1, "tokens": 10, "loss": loss + 1, "training_seconds": 1.0}]}


def test_the_verdict_both_ways_and_training_noise(tmp_path, capsys):
    """Losses further apart than the tolerance are 'not shown' (exit 1); noise runs widen the tolerance to
    3 x sqrt(2) x the standard deviation of their and the baseline's losses (3 x the difference, for one), and
    never narrow it. The baseline's seed runs are found by name; noise_seed_runs=0 leaves them out."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600, speed=500.0), config={"seed": 7}))
    record(results, ["far"], finished(4.650, speed=2000.0))
    for i, loss in enumerate((4.59, 4.62, 4.65)):
        record(results, [f"repeat-{i}"], finished(loss))
    read = lambda optimized, *extra: compare.main([f"--results_file={results}", "--baseline=base",
                                                   f"--optimized={optimized}", f"--plot={tmp_path / 'p.png'}", *extra])
    assert read("far") == 1  # 0.05 apart; validation tolerance 3 * sqrt(2) * 3 / 1000 = 0.0127
    c = lookup(results, ["matched-comparison"])
    assert not c["losses_agree"] and c["tolerance"] == pytest.approx(3 * 2 ** 0.5 * 3.0 / 1000)
    assert "noise_runs" not in c and "training noise is not counted" in c["tolerance_rule"]
    out = capsys.readouterr().out
    assert c["speed_ratio"] == pytest.approx(4.0) and "not shown" in out and "training noise not measured" in out
    # One noise run 0.01 from the baseline: 3 x 0.01, still short of 0.05; a rough estimate, the verdict says.
    assert read("far", "--noise_runs=repeat-0") == 1
    c = lookup(results, ["matched-comparison"])
    assert c["training_noise_tolerance"] == c["tolerance"] == pytest.approx(3 * 0.01)
    out = capsys.readouterr().out
    assert "not shown" in out and "--noise_seed_runs=3 would firm the verdict up" in out
    assert read("far", "--noise_runs=repeat-0,repeat-1,repeat-2") == 0
    c = lookup(results, ["matched-comparison"])
    std = float(np.std([4.600, 4.59, 4.62, 4.65], ddof=1))
    assert c["losses_agree"] and c["training_noise_std"] == pytest.approx(std)
    assert c["tolerance"] == pytest.approx(3 * 2 ** 0.5 * std)
    assert list(c["noise_runs"]) == ["repeat-0", "repeat-1", "repeat-2"]
    # The baseline's seed run, as compare.py names it (seed 7 + 1), counts without being named; not when off.
    record(results, ["base-seed8"], finished(4.640))
    assert read("far") == 0
    assert lookup(results, ["matched-comparison", "tolerance"]) == pytest.approx(3 * 0.04)
    assert read("far", "--noise_seed_runs=0") == 1
    capsys.readouterr()
    assert read("far", "--noise_seed_runs=-1") == 2
    assert "noise_seed_runs must be 0 or more" in capsys.readouterr().err
    # Noise runs of another recipe, or the compared runs themselves, would widen the tolerance at will: the pair
    # as its own noise gives at least 3 x their difference, so any two runs would pass.
    assert read("far", "--noise_runs=base,far") == 2
    assert "a run being compared" in capsys.readouterr().err
    record(results, ["big-model"], dict(finished(5.9), recipe={"seed": "r1", "model": {"dim": 768}}))
    assert read("far", "--noise_runs=repeat-0,big-model") == 2
    assert "noise run big-model is not the baseline's recipe (it differs in model)" in capsys.readouterr().err
    record(results, ["other-recipe"], finished(4.601, recipe="r2"))
    assert read("other-recipe") == 2  # a different recipe is refused, not compared
    assert "different recipes" in capsys.readouterr().err


def test_a_loss_difference_of_exactly_the_tolerance_agrees_and_one_just_beyond_does_not(tmp_path):
    """|difference| <= tolerance, as TOLERANCE_RULE says. Standard errors 3/1024 and 4/1024 (2**20 tokens) make a
    tolerance of 3 x 5/1024, and a loss that far from 4.5, exact in floating point."""
    results = tmp_path / "results.json"
    base = finished(4.5, std=3.0, tokens=2 ** 20)
    tol = matched.tolerance(base["final_validation"], finished(4.5, std=4.0, tokens=2 ** 20)["final_validation"])
    assert tol == 3 * 5 / 1024  # exact: the edge is not blurred by rounding
    edge = 4.5 + tol
    assert edge - 4.5 == tol
    record(results, ["base"], dict(base, config={"seed": 7}))
    for optimized, agree in ((edge, True), (float(np.nextafter(edge, 5.0)), False)):
        record(results, ["opt"], finished(optimized, std=4.0, tokens=2 ** 20))
        assert compare.main([f"--results_file={results}", "--baseline=base", "--optimized=opt",
                             f"--plot={tmp_path / 'p.png'}", "--noise_seed_runs=0"]) == (0 if agree else 1)
        c = lookup(results, ["matched-comparison"])
        assert c["tolerance"] == tol and c["losses_agree"] is agree


@pytest.mark.parametrize("names", [("baseline", "optimized"), ("plot", "label"), ("tolerance", "runs")])
def test_runs_named_like_a_field_of_the_comparison_keep_their_summaries(tmp_path, names):
    """The two runs' summaries were keyed by run name beside the comparison's fields, so a run named "baseline"
    or "plot" overwrote that field (or the field overwrote the run); they are under "runs" now."""
    results = tmp_path / "results.json"
    record(results, [names[0]], dict(finished(4.600), config={"seed": 7}))
    record(results, [names[1]], finished(4.601))
    assert compare.main([f"--results_file={results}", f"--baseline={names[0]}", f"--optimized={names[1]}",
                         f"--plot={tmp_path / 'p.png'}", "--noise_seed_runs=0"]) == 0
    c = lookup(results, ["matched-comparison"])
    assert (c["baseline"], c["optimized"], c["plot"]) == (*names, str(tmp_path / "p.png"))
    assert c["label"] == "matched run" and c["tolerance"] == pytest.approx(3 * 2 ** 0.5 * 3.0 / 1000)
    assert list(c["runs"]) == list(names)
    assert [c["runs"][n]["final_validation"]["loss"] for n in names] == [4.600, 4.601]


def test_tuned_config_and_overrides_layer_on_the_optimized_side_only(tiny, tmp_path, capsys):
    config, results = tiny
    tuned = tmp_path / "tuned.py"
    tuned.write_text("micro_batch_size = 2\nloss_impl = 'fused'\n")
    record(results, ["tuning"], {"selected": {"config_path": str(tuned)}})
    argv = [config, "--name=t", f"--results_file={results}", "--tuned=True", "--baseline_micro_batch_size=1",
            "--loss_impl=fused", "--optimized_overrides=--eval_batch_size=4"]
    base, opt = matched.side_configs(settings.Config(configurator.load_config(compare.DEFAULTS, argv)))
    assert (base.name, opt.name) == ("t-baseline", "t-optimized")
    assert (base.micro_batch_size, base.loss_impl, base.eval_batch_size) == (1, "full", 32)
    assert (opt.micro_batch_size, opt.loss_impl, opt.eval_batch_size) == (2, "fused", 4)
    assert base.results_file == opt.results_file == results
    assert "baseline" not in base and "tuned" not in opt  # compare's own keys never reach train.py

    tuned.unlink()
    assert compare.main(argv) == 2
    assert "tuned.py" in capsys.readouterr().err


def test_every_run_has_its_own_folders_and_the_noise_runs_are_the_baseline_at_other_seeds(tiny):
    config, results = tiny
    argv = [config, "--name=f", "--out_dir=runs/f", "--tensorboard_dir=tb", "--noise_seed_runs=2", "--seed=5",
            "--baseline_micro_batch_size=1", "--micro_batch_size=4", "--attention_backend=math"]
    cfg = settings.Config(configurator.load_config(compare.DEFAULTS, argv))
    base, opt = matched.side_configs(cfg)
    noise = matched.noise_configs(cfg, base)
    assert [c.name for c in noise] == ["f-baseline-seed6", "f-baseline-seed7"] and [c.seed for c in noise] == [6, 7]
    assert {k: v for k, v in noise[0].items() if base[k] != v} == {"name": "f-baseline-seed6", "seed": 6,
                                                                   "out_dir": "runs/f/baseline-seed6"}
    assert (base.out_dir, opt.out_dir) == ("runs/f/baseline", "runs/f/optimized")
    # one TensorBoard folder given, each run's events under its own name there (tb/f-baseline, ...), not tb/<side>/..
    assert base.tensorboard_dir == opt.tensorboard_dir == noise[0].tensorboard_dir == "tb"
    assert len({str(dashboard.tensorboard_folder(c)) for c in (base, opt, *noise)}) == 4
    # the baseline is the plain execution whatever the config asks for ("auto" attention may be fa4)
    assert (base.attention_backend, opt.attention_backend, base.compile) == ("sdpa", "math", False)


def test_the_table_names_every_execution_setting_off_its_default():
    """The matched table says how each side ran, down to the settings that made it lean or fast."""
    cfg = dict(train.DEFAULTS, micro_batch_size=32, compile=True, compile_scope="model",
               compile_mode="reduce-overhead", activation_memory_budget=0.8, loss_impl="fused")
    summary = matched.execution_summary(cfg)
    assert summary.startswith("mb 32, compile True")
    for shown in ("compile_scope model", "compile_mode reduce-overhead", "activation_memory_budget 0.8",
                  "loss_impl fused"):
        assert shown in summary
    assert "attention_backend" not in summary and "loss_chunk_tokens" not in summary  # at their defaults
    assert matched.execution_summary(dict(train.DEFAULTS)) == "mb 8, compile False"


def test_a_diverged_run_is_named_as_such_not_a_missing_field():
    """results.py writes a diverged run's NaN loss as null; the comparison says the run diverged in one line."""
    entry = {"recipe_identity": "r", "status": "complete",
             "final_validation": {"loss": None, "loss_std": None, "tokens": 100}}
    with pytest.raises(matched.CompareError, match="run b diverged: its final validation loss is not a finite"):
        matched.finished_run({"b": entry}, "b", "results.json")


@pytest.mark.parametrize("final_validation, words", [
    ({"loss": 4.0, "loss_std": 1.0}, "has no tokens, so no tolerance"),
    ({"loss": 4.0, "tokens": 100}, "has no loss_std, so no tolerance"),
    ("4.0", "final_validation is a str, not train.py's record"),
    ({"loss": 4.0, "loss_std": 1.0, "tokens": 0}, "has no tokens, so no tolerance"),
    ({"loss": "4.0", "loss_std": 1.0, "tokens": 100}, "its final validation loss is not a finite number"),
    (None, "is complete without a final validation"),
])
def test_a_hand_edited_final_validation_is_one_line_not_a_traceback(final_validation, words):
    """Before, a missing tokens count was a KeyError in the tolerance, a string an AttributeError."""
    entry = {"recipe_identity": "r", "status": "complete", "final_validation": final_validation}
    with pytest.raises(matched.CompareError, match=words):
        matched.finished_run({"b": entry}, "b", "results.json")


def test_a_hand_edited_curve_is_one_line_not_a_traceback():
    entry = dict(finished(4.0), validation_curve="x")
    with pytest.raises(matched.CompareError, match="run b's validation_curve is not a list of points"):
        matched.finished_run({"b": entry}, "b", "results.json")


def test_a_rate_that_is_not_a_number_gives_no_speed_ratio(tmp_path):
    results = tmp_path / "results.json"
    record(results, ["a"], finished(4.0))
    record(results, ["b"], dict(finished(4.0), median_training_tokens_per_second="fast"))
    comparison = matched.compare_runs(results, "a", "b", False, tmp_path / "v.png")
    assert comparison["speed_ratio"] is None and comparison["losses_agree"]


@pytest.mark.parametrize("seed_run", [{"status": "interrupted"}, {"final_validation": None}])
def test_no_noise_run_found_says_how_many_seed_runs_were_looked_for(tmp_path, capsys, seed_run):
    """The baseline's seed run asked for (noise_seed_runs=1) but not in the results file: the rule and the table
    said "noise_seed_runs=0", as if none had been asked for. A complete run of that name without a final validation
    (time-to-target's seed runs are named so) is not one either: it stopped the comparison with an error."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600), config={"seed": 7}))
    record(results, ["opt"], finished(4.601))
    record(results, ["base-seed8"], dict(finished(4.602), **seed_run))
    for argv, words in (([], "noise_seed_runs=1, but no complete base-seed<N> run was found, and no --noise_runs"),
                        (["--noise_seed_runs=0"], "noise_seed_runs=0 and no --noise_runs")):
        assert compare.main([f"--results_file={results}", "--baseline=base", "--optimized=opt",
                             f"--plot={tmp_path / 'p.png'}", *argv]) == 0
        assert words in lookup(results, ["matched-comparison", "tolerance_rule"])
        assert f"training noise not measured ({words})" in capsys.readouterr().out


@pytest.mark.parametrize("argv, key", [(["--rerun=True"], "--rerun"), (["--baseline_micro_batch_size=4"],
                                       "--baseline_micro_batch_size"), (["--tuned=True"], "--tuned"),
                                       (["--learning_rate=1e-3"], "--learning_rate"), (["{config}"], "--seed")])
def test_comparing_finished_runs_refuses_what_only_shapes_training(tmp_path, monkeypatch, capsys, argv, key):
    """Comparing two finished runs trains nothing: a key that only shapes a training run, given on the command
    line or by a config file, was silently ignored."""
    results = tmp_path / "results.json"
    record(results, ["base"], finished(4.600))
    record(results, ["opt"], finished(4.601))
    config = tmp_path / "c.py"
    config.write_text("seed = 5\n")
    read = [f"--results_file={results}", "--baseline=base", "--optimized=opt", f"--plot={tmp_path / 'p.png'}"]
    assert compare.main([a.format(config=config) for a in argv] + read) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"training run: {key} " in err and err.count("\n") == 1, err
    assert not lookup(results, ["matched-comparison"])
    # the keys the comparison reads are taken: the name of its default plot, the noise keys
    monkeypatch.chdir(tmp_path)
    assert compare.main([f"--results_file={results}", "--baseline=base", "--optimized=opt", "--name=n",
                         "--noise_seed_runs=0", "--allow_recipe_change=True"]) == 0
    assert (tmp_path / "out" / "n-comparison.png").is_file()


def test_the_rules_say_the_numbers_the_verdict_uses(monkeypatch):
    """The rules' texts wrote 3, 4 and the odds of a false alarm beside the constants that set them, and the
    validation tolerance hard-coded its 3."""
    from scipy import stats
    for df in range(1, 8):
        assert matched.t_tail(matched.NOISE_SIGMAS, df) == pytest.approx(2 * stats.t.sf(matched.NOISE_SIGMAS, df))
    odds = [f"{2 * stats.t.sf(matched.NOISE_SIGMAS, df):.2f}" for df in (1, matched.FIRM_NOISE_RUNS)]
    # an upper bound: the baseline is in both the difference and the noise estimate
    assert (f"probability at most {odds[0]}; {odds[1]} with {matched.FIRM_NOISE_RUNS} noise runs"
            in matched.NOISE_RULE)
    assert f"{matched.NOISE_SIGMAS} * sqrt(se_baseline^2" in matched.TOLERANCE_RULE
    assert f"exp(+-{matched.SPEED_SIGMAS} * sqrt(2) * s)" in matched.SPEED_RULE
    assert f"at least {matched.MIN_INTERVALS} log intervals" in matched.SPEED_RULE
    fv = {"loss": 4.0, "loss_std": 3.0, "tokens": 900}
    monkeypatch.setattr(matched, "NOISE_SIGMAS", 4)
    assert matched.tolerance(fv, fv) == pytest.approx(4 * 2 ** 0.5 * 0.1)


def test_an_out_dir_that_is_a_file_is_one_line_before_any_training(tiny, tmp_path, capsys):
    config, results = tiny
    (tmp_path / "taken").write_text("not a folder")
    assert compare.main([config, f"--results_file={results}", f"--out_dir={tmp_path / 'taken'}",
                         "--baseline_micro_batch_size=4", "--micro_batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the baseline run") and "cannot keep its files in" in err and err.count("\n") == 1
    assert not read_results(results)


def test_a_tuned_config_path_that_is_not_a_path_is_one_line(tmp_path):
    """Before, a number there was a TypeError from Path()."""
    results = tmp_path / "results.json"
    record(results, ["tuning"], {"selected": {"config_path": 5}})
    argv = [f"--results_file={results}", "--tuned=True"]
    cfg = settings.Config(configurator.load_config(compare.DEFAULTS, argv))
    with pytest.raises(matched.CompareError, match="has no tuning.selected.config_path"):
        matched.side_configs(cfg)


def test_the_matched_baseline_runs_every_kernel_concern_plainly(tmp_path):
    """Each registry concern (attention, loss, MLP) has its plain choice in the baseline: mlp_impl, added to the
    registry later, was left as the config's, so --mlp_impl=quack ran quack's kernels on both sides."""
    from model_kernels import registry
    assert {r.key for r in registry.REGISTRIES} <= set(matched.BASELINE_EXECUTION)
    argv = ["config/tiny_cpu.py", f"--results_file={tmp_path / 'r.json'}", "--mlp_impl=quack"]
    cfg = settings.Config(configurator.load_config(compare.DEFAULTS, argv))
    base, optimized = matched.side_configs(cfg)
    assert base["mlp_impl"] == "torch" and optimized["mlp_impl"] == "quack"


# ---------------------------------------------------------------- the speed verdict

BASE_EXECUTION = dict({k: train.DEFAULTS[k] for k in settings.execution_keys()}, device="cpu",
                      **matched.BASELINE_EXECUTION)


def timed(loss, rates, attention="sdpa", seed=7, **execution):
    """A hand-made finished run with its config (the baseline's execution, changed by execution), the attention
    that ran and its interval rates; its median rate as train.py takes it."""
    entry = finished(loss, speed=statistics.median(rates))
    return dict(entry, config=dict(BASE_EXECUTION, seed=seed, **execution), attention=attention, world_size=1,
                interval_tokens_per_second=list(rates))


def speed_verdict_of(tmp_path, runs, *argv):
    """compare.py's read-only mode on the runs {name: entry}, base against opt; returns (exit status, comparison,
    printed table)."""
    results = tmp_path / "results.json"
    for name, entry in runs.items():
        record(results, [name], entry)
    code = compare.main([f"--results_file={results}", "--baseline=base", "--optimized=opt",
                         f"--plot={tmp_path / 'p.png'}", *argv])
    return code, lookup(results, ["matched-comparison"])


def test_identical_executions_give_no_speed_up_however_far_apart_their_rates(tmp_path, capsys):
    """The issue's case: micro-batch 8 on both sides, and "auto" attention that ran as SDPA, the baseline's; the
    optimized run happened to time 1.61x the baseline, beyond its noise run's 690 tok/s. Same execution: no
    speed-up, whatever the band (validation's batch is not timed, so it does not make another execution)."""
    runs = {"base": timed(4.600, [630, 633, 640]), "base-seed8": timed(4.601, [680, 690, 700], seed=8),
            "opt": timed(4.602, [1010, 1018, 1030], attention_backend="auto", eval_batch_size=64)}
    code, c = speed_verdict_of(tmp_path, runs)
    out = capsys.readouterr().out
    assert code == 0 and c["losses_agree"]
    assert c["same_execution"] is True and c["execution_differences"] == []
    assert c["speed_verdict"] == "same execution" and c["speed_ratio"] == pytest.approx(1018 / 633)
    assert c["speed_ratio_low"] > 1  # outside the noise, and still no speed-up: the execution is the same
    assert "the two sides run the same execution: no speed-up (their 1.61x is noise)" in out
    assert "x speed-up" not in out and "faster" not in out


def test_a_faster_side_outside_the_noise_is_a_speed_up_with_its_ratio_and_band(tmp_path, capsys):
    base_rates = [960, 990, 1000, 1010, 1040]
    runs = {"base": timed(4.600, base_rates), "base-seed8": timed(4.601, [r * 1.02 for r in base_rates], seed=8),
            "opt": timed(4.602, [1950, 1990, 2000, 2010, 2050], micro_batch_size=32, compile=True)}
    code, c = speed_verdict_of(tmp_path, runs)
    out = capsys.readouterr().out
    assert code == 0 and c["same_execution"] is False
    assert c["execution_differences"] == ["compile", "micro_batch_size"]
    assert c["speed_verdict"] == "faster" and c["speed_ratio"] == pytest.approx(2.0)
    noise = c["speed_noise"]
    assert noise["rates"] == {"base": 1000, "base-seed8": pytest.approx(1020)}
    assert noise["between_runs"] == pytest.approx(3 * abs(np.log(1.02)))  # 3 x |d| for one noise run
    assert noise["interval_quartiles"] == {"baseline": [990, 1010], "optimized": [1990, 2010]}
    # the wider of 2 * exp(+-3 |ln 1.02|) and [1990 / 1010, 2010 / 990]: here the first at both ends
    assert c["speed_ratio_low"] == pytest.approx(2 / 1.02 ** 3) and c["speed_ratio_high"] == pytest.approx(2 * 1.02 ** 3)
    assert "the 2.00x speed-up (noise band 1.88x to 2.12x) kept the math" in out and "3 * sqrt(2)" in c["speed_rule"]


def test_a_faster_median_inside_the_noise_is_no_speed_up(tmp_path, capsys):
    """Either noise alone keeps a 1.15x median from being called: the baseline's noise run 10% off it, or interval
    rates that overlap; with neither measured nothing is called. A noise run of another execution times that one."""
    steady = [980, 990, 1000, 1010, 1020]
    runs = {"base": timed(4.600, steady), "base-seed8": timed(4.601, [r * 1.1 for r in steady], seed=8),
            "opt": timed(4.602, [r * 1.15 for r in steady], micro_batch_size=32)}
    code, c = speed_verdict_of(tmp_path, runs)
    assert code == 0 and c["speed_ratio"] == pytest.approx(1.15) and c["speed_verdict"] == "within noise"
    assert c["speed_ratio_low"] == pytest.approx(1.15 / 1.1 ** 3)
    quartiles = c["speed_noise"]["interval_quartiles"]
    assert quartiles["optimized"][0] > quartiles["baseline"][1]  # the interval rates alone would call it
    assert "no speed difference outside the noise (1.15x, noise band 0.86x to " in capsys.readouterr().out

    noisy = {"base": timed(4.600, [700, 900, 1000, 1100, 1300]),
             "opt": timed(4.602, [800, 1050, 1150, 1250, 1500], micro_batch_size=32)}
    code, c = speed_verdict_of(tmp_path, noisy, "--noise_seed_runs=0")
    assert c["speed_verdict"] == "within noise" and c["speed_noise"]["between_runs"] is None
    assert c["speed_ratio_low"] == pytest.approx(1050 / 1100) and c["speed_ratio_high"] == pytest.approx(1250 / 900)

    compiled = dict(timed(4.601, [1500], seed=8), config=dict(BASE_EXECUTION, seed=8, compile=True))
    few = {"base": timed(4.600, [1000]), "opt": timed(4.602, [1300], micro_batch_size=32), "base-seed8": compiled}
    code, c = speed_verdict_of(tmp_path, few)
    assert c["noise_runs"] == {"base-seed8": 4.601} and c["speed_noise"]["rates"] == {"base": 1000}
    assert c["speed_verdict"] == "noise not measured" and c["speed_ratio_low"] is None
    assert "1.30x, but the speed's noise is not measured" in capsys.readouterr().out


def test_the_two_sides_resolving_to_one_execution_is_said_before_training(tiny, capsys):
    config, results = tiny
    for mb, said in ((4, True), (2, False)):
        argv = [config, f"--results_file={results}", "--baseline_micro_batch_size=4", f"--micro_batch_size={mb}"]
        cfg = settings.Config(configurator.load_config(compare.DEFAULTS, argv))
        matched.check_before_training(cfg, matched.side_configs(cfg))
        out = capsys.readouterr().out
        assert ("resolve to the same execution" in out and "attention sdpa on cpu" in out) == said


def test_hand_edited_interval_rates_give_no_band_from_them_not_a_traceback(tmp_path):
    runs = {"base": dict(timed(4.600, [960, 1000, 1040, 1000]), interval_tokens_per_second=5),
            "opt": timed(4.602, [1950, 2000, 2050, 2000], micro_batch_size=32, compile=True)}
    code, c = speed_verdict_of(tmp_path, runs, "--noise_seed_runs=0")
    assert code == 0 and c["speed_noise"]["interval_quartiles"]["baseline"] is None
    assert c["speed_verdict"] == "noise not measured"


def test_an_older_entry_under_a_renamed_key_is_another_execution(tmp_path, capsys):
    """Entries recorded before sdpa_backend became attention_backend, without the attention that ran: "auto" and
    "fa4" read as one execution (both new names missing), so a speed-up outside the noise was called none."""
    def old(entry, backend):
        config = {k: v for k, v in entry["config"].items() if k != "attention_backend"}
        return dict({k: v for k, v in entry.items() if k != "attention"}, config=dict(config, sdpa_backend=backend))
    runs = {"base": old(timed(4.600, [960, 990, 1000, 1010, 1040]), "auto"),
            "opt": old(timed(4.601, [1300, 1310, 1320, 1330, 1340]), "fa4")}
    code, c = speed_verdict_of(tmp_path, runs)
    assert code == 0 and c["same_execution"] is False and c["execution_differences"] == ["attention_backend"]
    assert c["speed_verdict"] == "faster"


def test_the_baseline_drops_what_needs_compile_with_compile(tiny, tmp_path):
    """The baseline runs eager (compile=False) but kept update_graph and compile_cache, which need compile: a
    compiled config was refused with advice to set compile=True, which it had."""
    config, results = tiny
    cfg = settings.Config(configurator.load_config(compare.DEFAULTS, [
        config, "--compile=True", "--update_graph=True", f"--compile_cache={tmp_path / 'c.bin'}",
        "--baseline_micro_batch_size=4",
        f"--results_file={results}"]))
    base, opt = matched.side_configs(cfg)
    assert (base.compile, base.update_graph, base.compile_cache) == (False, False, "")
    assert (opt.compile, opt.update_graph) == (True, True)
    runs_lib.run_plan("baseline", base)  # the settings' checks pass


@pytest.mark.parametrize("low, high, call", [(1.0, 1.3, "within noise"), (1.001, 1.3, "faster"),
                                             (0.7, 1.0, "within noise"), (0.7, 0.999, "slower")])
def test_a_noise_band_touching_one_is_within_noise(low, high, call):
    """faster only where the whole band of the speed ratio lies above 1, slower only where it lies below."""
    assert matched.speed_call(1.0, low, high, ["compile_mode"]) == call


def compare_settings(*argv):
    return settings.resolve(compare.CompareSettings, list(argv))


def test_resume_is_refused_as_compare_decides_it_for_each_run():
    """--resume=True would be passed to every run, the first one included, which has nothing to resume: compare.py
    resumes a stopped run itself."""
    with pytest.raises(configurator.ConfigError, match="--resume: compare.py decides them for each run"):
        compare_settings("--resume=True")


def test_time_to_target_takes_seeds_up_to_torchs_largest_and_no_further():
    """--seeds=5 trains --seed and the 4 above it: the highest --seed is 2**64 - 5, whose last run seeds torch
    with 2**64 - 1, its largest."""
    mode = ("--mode=time-to-target", "--target_loss=3", "--seeds=5")
    assert compare_settings(*mode, f"--seed={2 ** 64 - 5}").seed == 2 ** 64 - 5
    with pytest.raises(configurator.ConfigError, match=f"give a --seed at most {2 ** 64 - 5}"):
        compare_settings(*mode, f"--seed={2 ** 64 - 4}")


@pytest.mark.parametrize("raised, status", [("RunFailed", 1), ("KeyboardInterrupt", 130)])
def test_a_failed_run_exits_1_and_ctrl_c_outside_a_run_130(monkeypatch, capsys, raised, status):
    """The exit statuses compare.py's docstring gives: 1 when a training run failed (not 2, a user's mistake),
    130 for Ctrl-C while no run trains."""

    def fails(cfg):
        if raised == "RunFailed":
            raise runs_lib.RunFailed("the baseline run b exited with status 1")
        raise KeyboardInterrupt
    monkeypatch.setattr(compare, "compare", fails)
    assert compare.main([]) == status
    err = capsys.readouterr().err
    assert err == ("error: the baseline run b exited with status 1\n" if raised == "RunFailed" else "")


@pytest.mark.parametrize("mode, section", [("time-to-target", "time-to-target"), ("matched", "matched-comparison")])
def test_the_results_section_each_mode_records_into_is_checked_before_any_run(tmp_path, monkeypatch, mode, section):
    """A results file whose section the mode records its verdict into is not an object: refused before the mode
    trains anything (else its runs train for hours and the verdict cannot be recorded)."""
    from results import ResultsFileError
    results = tmp_path / "results.json"
    results.write_text(json.dumps({section: ["not", "entries"]}))
    ran = []
    monkeypatch.setattr(time_to_target, "time_to_target_mode", ran.append)
    monkeypatch.setattr(compare, "matched_mode", ran.append)
    argv = [f"--mode={mode}", f"--results_file={results}"] + (["--target_loss=3"] if mode == "time-to-target" else [])
    with pytest.raises(ResultsFileError, match=f"its section '{section}' is a list"):
        compare.compare(compare_settings(*argv))
    assert ran == []


def test_the_baselines_micro_batch_hint_follows_a_micro_batch_refusal_only(tmp_path):
    """A refusal of the baseline run names --baseline_micro_batch_size only when the micro-batch is what it
    refuses; another mistake (a missing cache) is not pointed at that key."""
    hint = " (the baseline's micro-batch is --baseline_micro_batch_size)"
    common = [f"--data_dir={tmp_path / 'no-cache'}", "--device=cpu", "--tokens_per_update=4096", "--seq_len=1024"]
    with pytest.raises(runs_lib.CompareError) as refused:
        runs_lib.run_plan("baseline", settings.load(settings.TrainSettings, common + ["--micro_batch_size=3"]), hint)
    assert str(refused.value).endswith("valid sizes: [1, 2, 4]" + hint)
    with pytest.raises(runs_lib.CompareError) as refused:
        runs_lib.run_plan("baseline", settings.load(settings.TrainSettings, common + ["--micro_batch_size=4"]), hint)
    assert "has no meta.json" in str(refused.value) and "baseline_micro_batch_size" not in str(refused.value)


def recorded_as(status, edit):
    """test_compare's stand-in for train.py, whose entry is then changed by edit(entry) (a hand edit, or an entry
    another version of the code recorded)."""

    class Edited(FakeTrainPy):
        def __call__(self, side, cmd, signals):
            code = super().__call__(side, cmd, signals)
            arg = lambda key: next(a.split("=", 1)[1] for a in cmd if a.startswith(f"--{key}="))
            path, name = arg("results_file"), arg("name")
            record(path, [name], edit(lookup(path, [name])))
            return code
    return Edited(status)


@pytest.mark.parametrize("edit", [
    lambda e: dict(e, environment=dict(e["environment"], source_hash="0" * 64)),  # trained by other code
    lambda e: dict(e, final_validation=None),  # complete without the full validation the config asks for
], ids=["other-code", "no-final-validation"])
def test_a_complete_run_that_is_not_this_comparisons_trains_again(tiny, monkeypatch, capsys, edit):
    """A complete run is reused only when this code trained it (its losses are this code's) and it holds the full
    validation the verdict compares; else it trains again, its checkpoint replaced."""
    first, second = launch(tiny, monkeypatch, recorded_as("complete", edit))
    assert second[-1] == "--overwrite=True" and "reusing the complete run" not in capsys.readouterr().out


@pytest.mark.parametrize("status, why", [("failed", " (status failed: it ended unfinished)"), ("interrupted", "")])
def test_resuming_says_how_the_run_ended_unless_it_was_stopped(tiny, monkeypatch, capsys, status, why):
    first, second = launch(tiny, monkeypatch, FakeTrainPy(status))
    assert second[-1] == "--resume=True"
    assert f"baseline: resuming the stopped run k{why} from " in capsys.readouterr().out


def fake_runs(monkeypatch, fail=(), signal_during=None):
    """runs.train_all over runs a, b and c with train_or_reuse faked: the named ones fail; a SIGTERM arrives while
    signal_during trains. Returns the names trained, in order."""
    import types
    trained = []

    def train_or_reuse(side, c, identity, rerun, signals):
        trained.append(c.name)
        if c.name == signal_during:
            signals.signal = signal.SIGTERM  # came as the run ended: its own check had passed
        if c.name in fail:
            raise runs_lib.RunFailed(f"the {side} run {c.name} exited with status 1; its output is above")
    monkeypatch.setattr(runs_lib, "train_or_reuse", train_or_reuse)
    return [("seed", types.SimpleNamespace(name=n), None) for n in "abc"], types.SimpleNamespace(rerun=False), trained


def test_a_failed_run_ends_a_matched_comparison_and_a_time_to_target_one_goes_on(monkeypatch, capsys):
    """A matched comparison without one of its runs has no verdict: the first failure ends it. A time-to-target
    verdict counts a failed seed: the next seeds still train, and the failures come back by name."""
    todo, cfg, trained = fake_runs(monkeypatch, fail=("a",))
    with pytest.raises(runs_lib.RunFailed, match="the seed run a exited"):
        runs_lib.train_all(cfg, todo)
    assert trained == ["a"]
    todo, cfg, trained = fake_runs(monkeypatch, fail=("a", "c"))
    failed = runs_lib.train_all(cfg, todo, keep_going=True)
    assert trained == ["a", "b", "c"] and list(failed) == ["a", "c"]
    assert "seed: the seed run a exited with status 1; its output is above; going on with the next run" in \
        capsys.readouterr().out


def test_a_signal_between_runs_stops_before_the_next_one_begins(monkeypatch):
    todo, cfg, trained = fake_runs(monkeypatch, signal_during="a")
    with pytest.raises(runs_lib.Stopped, match="stopped by SIGTERM before the seed run b began; run this compare.py "
                                           "command again to go on"):
        runs_lib.train_all(cfg, todo)
    assert trained == ["a"]


def test_the_stop_message_says_how_to_go_on():
    """After a run that finished, the same command reuses it; with --rerun=True the same command would train every
    run afresh, so the message says to drop it."""
    done = runs_lib.stopped_message("baseline", "b", [], 0, "by SIGINT", rerun=False)
    assert done == ("stopped by SIGINT after the baseline run b finished; run this compare.py command again to go "
                    "on (it is reused)")
    again = runs_lib.stopped_message("baseline", "b", [], 1, "by SIGINT", rerun=True)
    assert "run this compare.py command again without --rerun=True to go on" in again
