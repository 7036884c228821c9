"""tune.py: the sweep strategy with a fake clock, and a real sweep of bench.py processes on the CPU."""
from pathlib import Path

import pytest

import configurator
from results import read_results
import env
import train
import tune
from tests.conftest import flash_attn_4_installed


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def fake_measure(clock, rates, seconds=60.0, oom_from=None, tried=None):
    """A candidate 'runs' for `seconds` of fake time; its rate comes from `rates` by micro-batch size."""
    def measure(candidate, seconds_left):
        clock.now += seconds
        if tried is not None:
            tried.append(candidate)
        if oom_from is not None and candidate["micro_batch_size"] >= oom_from:
            return {"status": "error", "error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}
        bonus = {"cudnn": 1.05, "flash": 0.97}.get(candidate["attention_backend"], 1.0)
        bonus *= {"reduce-overhead": 1.02, "eager": 0.3}.get(candidate["compile_mode"] if candidate["compile"]
                                                             else "eager", 1.0)
        return {"status": "ok", "tokens_per_second": rates[candidate["micro_batch_size"]] * bonus}
    return measure


RATES = {4: 400.0, 8: 700.0, 16: 1300.0, 32: 1900.0, 64: 1950.0}
MODES = ["default", "reduce-overhead", "eager"]


def test_never_above_a_size_that_ran_out_of_memory():
    clock, tried = FakeClock(), []
    sweep = tune.Sweep([4, 8, 16, 32, 64], MODES, ["auto", "cudnn"], [0],
                       fake_measure(clock, RATES, oom_from=32, tried=tried), budget_seconds=3600, clock=clock)
    sweep.run()
    sizes = [c["micro_batch_size"] for c in tried]
    assert 64 not in sizes and sizes.count(32) == 1  # 32 ran out of memory once; nothing at or above it again
    best, result = sweep.best()
    assert best == tune.make_candidate(16, "reduce-overhead", "cudnn", 0)
    assert result["tokens_per_second"] == pytest.approx(1300 * 1.05 * 1.02)
    assert not sweep.exhausted


def test_out_of_memory_in_one_backend_does_not_skip_the_others_at_that_size():
    """The math kernel running out of memory at 32 skipped every later candidate at 32."""
    clock, tried = FakeClock(), []
    measure = fake_measure(clock, RATES, tried=tried)

    def math_runs_out_at_32(candidate, seconds_left):
        result = measure(candidate, seconds_left)
        if candidate["attention_backend"] == "math" and candidate["micro_batch_size"] >= 32:
            return {"status": "error", "error": "torch.OutOfMemoryError: CUDA out of memory."}
        return result
    sweep = tune.Sweep([8, 16, 32], ["default"], ["auto", "math", "cudnn"], [0], math_runs_out_at_32,
                       budget_seconds=3600, clock=clock)
    sweep.run()
    assert tune.make_candidate(32, "default", "cudnn", 0) in tried
    assert sweep.best()[0] == tune.make_candidate(32, "default", "cudnn", 0)


def test_knee_stops_the_size_search_and_modes_run_at_the_best_size():
    clock, tried = FakeClock(), []
    sweep = tune.Sweep([4, 8, 16, 32, 64, 128], MODES, ["auto"], [0],
                       fake_measure(clock, {**RATES, 128: 1960.0}, tried=tried), budget_seconds=3600, clock=clock)
    sweep.run()
    sizes = [c["micro_batch_size"] for c in tried if c["compile_mode"] == "default" and c["compile"]]
    assert sizes == [4, 8, 16, 32, 64]  # 64 gained under 3% over 32: the knee, so 128 is not tried
    later = tried[len(sizes):]
    assert {c["micro_batch_size"] for c in later} == {64}  # modes at the best size
    assert {("eager" if not c["compile"] else c["compile_mode"]) for c in later} == {"reduce-overhead", "eager"}


def test_budget_stops_before_a_candidate_that_would_not_finish():
    clock, tried = FakeClock(), []
    sweep = tune.Sweep([4, 8, 16, 32], MODES, ["auto", "flash", "cudnn"], [0],
                       fake_measure(clock, RATES, seconds=100, tried=tried), budget_seconds=450, clock=clock)
    sweep.run()
    assert sweep.exhausted
    assert len(tried) == 4 and clock.now == 400  # a fifth 100 s candidate would end past 450 s
    assert sweep.best()[0]["micro_batch_size"] == 32


def test_estimate_uses_measured_durations():
    clock = FakeClock()
    sweep = tune.Sweep([4], MODES, ["auto"], [0], fake_measure(clock, RATES), budget_seconds=1e9, clock=clock)
    sweep.results = [(tune.make_candidate(4, "default", "auto", 0), {"status": "ok"}, 30.0),
                     (tune.make_candidate(8, "eager", "auto", 0), {"status": "ok"}, 10.0)]
    assert sweep.estimate(tune.make_candidate(16, "default", "auto", 0)) == 30.0
    assert sweep.estimate(tune.make_candidate(16, "eager", "auto", 0)) == 10.0
    assert sweep.estimate(tune.make_candidate(16, "max-autotune", "auto", 0)) == 60.0  # compiles longer


TINY = ["--preset=20m", "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128", "--seq_len=64",
        "--tokens_per_update=512", "--device=cpu", "--cpu_threads=1", "--train_subset_tokens=60000",
        "--warmup=1", "--steps=2", "--windows=1", "--tune_compile_modes=eager", "--tune_micro_batch_sizes=2,4,3",
        "--tune_backends=auto,math,cudnn"]


def test_cpu_sweep_selects_records_errors_and_reuses(tmp_path, text_cache, capsys):
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}",
                   "--budget=5", "--name=cpu-tune"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "skipping micro-batch 3" in out  # 3 does not divide the 8 sequences of an update
    tuning = read_results(results)["tuning"]
    names = [c["name"] for c in tuning["candidates"]]
    assert names[:2] == ["micro-2-compile-0-auto-eager-threads-1", "micro-4-compile-0-auto-eager-threads-1"]
    cudnn = [c for c in tuning["candidates"] if c["attention_backend"] == "cudnn"]
    assert len(cudnn) == 1 and cudnn[0]["status"] == "error" and "backend" in cudnn[0]["error"]
    ok = [c for c in tuning["candidates"] if c["status"] == "ok"]
    best = max(ok, key=lambda c: c["tokens_per_second"])
    assert tuning["selected"]["name"] == best["name"]
    assert tuning["selected_config_path"] == best["config_path"]
    assert tuning["budget_minutes"] == 5 and tuning["budget_exhausted"] is False
    assert all(not c["reused"] for c in tuning["candidates"])
    for line in out.splitlines():
        if line.startswith("["):
            assert "min" in line and "best:" in line  # n of m, elapsed / budget, result, best so far

    # the written config reproduces the candidate with the base recipe
    cfg = configurator.load_config(train.DEFAULTS, [best["config_path"]])
    assert cfg["micro_batch_size"] == best["micro_batch_size"] and cfg["attention_backend"] == best["attention_backend"]
    assert cfg["compile"] is False and cfg["n_layers"] == 2 and cfg["data_dir"] == str(text_cache)
    assert "results_file" not in Path(best["config_path"]).read_text()  # the sweep's own file is no setting
    run = train.train(train.Config(cfg, epochs=1, results_file=str(results), out_dir=str(tmp_path / "run"),
                                   full_validation=False, val_subset_tokens=512))
    assert run["status"] == "complete"

    # a rerun with the same code, config and machine measures again only what failed (an error may have been
    # the budget's cut or a passing fault): here the cuDNN candidate, which fails the same way on a CPU
    assert tune.main(argv) == 0
    again = read_results(results)["tuning"]
    assert [c["name"] for c in again["candidates"]] == names
    assert all(c["reused"] == (c["status"] == "ok") for c in again["candidates"])
    assert [c["name"] for c in again["candidates"] if not c["reused"]] == [cudnn[0]["name"]]
    assert again["selected"]["tokens_per_second"] == tuning["selected"]["tokens_per_second"]


def test_cpu_sweep_runs_out_of_budget(tmp_path, text_cache):
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}",
                   "--budget=0.2", "--name=cpu-tune", "--tune_micro_batch_sizes=1,2,4,8",
                   "--tune_backends=auto,math,efficient,cudnn"]  # 12 s: room for a few of about 8 candidates
    tune.main(argv)
    tuning = read_results(results)["tuning"]
    assert tuning["budget_exhausted"] is True
    assert 1 <= len(tuning["candidates"]) < 7
    # the sweep ends within its budget: a candidate the rest cannot finish is not started, and a running one
    # is ended at the budget (a few seconds' slack for the process to exit)
    assert tuning["elapsed_minutes"] * 60 <= 0.2 * 60 + 5
    ok = [c for c in tuning["candidates"] if c["status"] == "ok"]
    assert ok, "no candidate finished within 12 s"
    assert tuning["selected"]["tokens_per_second"] == max(c["tokens_per_second"] for c in ok)
    selected = configurator.load_config(train.DEFAULTS, [tuning["selected_config_path"]])
    assert selected["micro_batch_size"] == tuning["selected"]["micro_batch_size"]


def test_unknown_backend_is_a_user_error(tmp_path, text_cache, capsys):
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", "--tune_backends=auto,fast"]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert "'fast'" in err and "cudnn" in err and not (tmp_path / "r.json").exists()


@pytest.mark.skipif(flash_attn_4_installed(), reason="flash-attn-4 is installed here")
def test_fa4_without_flash_attn_4_is_refused_before_any_candidate(tmp_path, text_cache, capsys):
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", "--tune_backends=auto,fa4"]
    assert tune.main(argv) == 2
    assert "needs the flash-attn-4 package" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_an_unwritable_tuned_dir_is_one_line_before_any_candidate(tmp_path, text_cache, capsys):
    (tmp_path / "afile").write_text("a file, not a folder")
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}",
                   f"--tuned_dir={tmp_path / 'afile' / 'tuned'}"]
    assert tune.main(argv) == 2
    out = capsys.readouterr()
    assert "tuned_dir" in out.err and "cannot be made" in out.err and "running" not in out.out


@pytest.mark.parametrize("arg, words", [("--budget=-1", "budget must be a positive"),
                                        ("--candidate_timeout=0", "candidate_timeout must be a positive"),
                                        ("--tune_compile_modes=", "tune_compile_modes is empty"),
                                        ("--tune_backends=,", "tune_backends is empty"),
                                        ("--data_mode=bogus", "data_mode 'bogus'"),
                                        ("--warmup=0", "warmup must be at least 1"),
                                        # each would fail every candidate, and the sweep record no selection
                                        ("--data_dir=/nonexistent/cache", "/nonexistent/cache"),
                                        ("--preset=bogus", "unknown model preset 'bogus'")])
def test_sweep_settings_are_checked_before_any_candidate(tmp_path, text_cache, capsys, arg, words):
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}", arg]
    assert tune.main(argv) == 2
    assert words in capsys.readouterr().err
    assert not results.exists() and not (tmp_path / "tuned").exists()
