"""tune.py end to end: a real sweep of bench.py processes on the CPU, and the settings refused before any run.
The strategy's rules, with a fake clock and fake measurements, are in test_tune_strategy.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import configurator
import env
import sweep as sweep_lib
import train
import tune
from results import read_results, record
from tests.conftest import flash_attn_4_installed
import settings

# An eager tiny model: screens and confirmations of a few updates, and four levers, two of which cannot run: a
# micro-batch size that does not divide the update, and cuDNN attention, which has no CPU kernel. Every screen
# counts as close to the incumbent's (tune_screen_noise), so tune_confirm alone decides which go on.
TINY = ["--preset=20m", "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128", "--seq_len=64",
        "--tokens_per_update=512", "--device=cpu", "--cpu_threads=1", "--train_subset_tokens=60000",
        "--warmup=1", "--steps=2", "--windows=1", "--tune_screen_warmup=1", "--tune_screen_steps=2",
        "--tune_compile_modes=eager", "--tune_micro_batch_sizes=2,3", "--tune_backends=auto,cudnn",
        "--tune_loss_impls=full,fused", "--tune_confirm=1", "--tune_screen_noise=0.99"]


def test_cpu_sweep_screens_confirms_selects_reports_and_reuses(tmp_path, text_cache, capsys, monkeypatch):
    monkeypatch.setattr(env, "source_hash", lambda root=env.REPO: "the same code")  # whatever is edited meanwhile
    results = tmp_path / "results.json"
    tuned = tmp_path / "tuned"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tuned}",
                   "--budget=5", "--name=cpu-tune"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    # what cannot run here: one line each, and never a candidate
    assert "skipping micro_batch_size=3: micro_batch_size 3" in out  # 3 does not divide the 8 sequences of an update
    assert "skipping attention_backend=cudnn: attention_backend 'cudnn' runs only on CUDA GPUs" in out
    tuning = read_results(results)["tuning"]
    inc, candidates = tuning["incumbent"], tuning["candidates"]
    assert [r["change"] for r in tuning["refused"]] == ["micro_batch_size=3", "attention_backend=cudnn"]
    assert {k: v for k, v in candidates[0].items() if k not in sweep_lib.STAGES} == inc
    assert inc["lever"] == "incumbent" and inc["micro_batch_size"] == 8
    # the machine once for the sweep; each run keeps only what was its own
    assert tuning["environment"]["cache_identity"] and "cache_identity" not in candidates[0]["screen"]["environment"]
    # the incumbent with the confirmation's protocol (bench's keys), every candidate with the screen's
    assert candidates[0]["confirm"]["protocol"]["steps"] == 2 and candidates[0]["confirm"]["status"] == "ok"
    assert inc["tokens_per_second"] == candidates[0]["confirm"]["tokens_per_second"]  # the measured rate
    assert all(c["screen"]["protocol"]["warmup"] == 1 for c in candidates if c["screen"]["status"] == "ok")
    assert [c["change"] for c in candidates[1:]] == ["loss_impl=fused", "micro_batch_size=2"]
    confirmed = [c for c in candidates if c["confirm"]]
    best_screen = max(candidates[1:], key=lambda c: c["screen"]["tokens_per_second"])
    assert [c["name"] for c in confirmed] == [inc["name"], best_screen["name"]]  # tune_confirm=1 of the screened
    assert all(c["screen"]["status"] == "ok" and c["confirm"]["status"] == "ok" for c in confirmed)
    selected = tuning["selected"]
    assert selected["name"] in [c["name"] for c in confirmed] and selected["status"] == "selected"
    assert selected["tokens_per_second"] >= inc["tokens_per_second"]  # never slower than the incumbent
    assert tuning["gain_over_incumbent"] == pytest.approx(selected["tokens_per_second"] / inc["tokens_per_second"] - 1)
    assert tuning["budget_minutes"] == 5 and tuning["budget_exhausted"] is False
    split = tuning["budget_split"]
    assert split["compile_seconds"] > 0 and split["measure_seconds"] > 0
    assert tuning["elapsed_minutes"] * 60 >= split["screen_seconds"] + split["confirm_seconds"] - 1e-6

    # what a person reads: progress while it runs, then the table, the budget and the selected config
    assert any(line.startswith("[screen ") and "min" in line for line in out.splitlines())
    assert out.index("running incumbent (the config's own): confirm") < out.index("running loss_impl=fused: screen")
    for column in ("candidate", "screen tok/s", "x inc", "confirm tok/s", "gain", "compile s", "peak GiB", "status"):
        assert column in out
    assert "budget: " in out and "compiling" in out and f"selected {selected['change']}" in out

    # compare.py --tuned=True reads tuning.selected.config_path: it reproduces the candidate with the base recipe
    path = Path(selected["config_path"])
    assert path.parent == tuned and path.read_text() in out
    cfg = configurator.load_config(train.DEFAULTS, [str(path)])
    assert cfg["micro_batch_size"] == selected["micro_batch_size"] and cfg["loss_impl"] == selected["loss_impl"]
    assert cfg["compile"] is False and cfg["n_layers"] == 2 and cfg["data_dir"] == str(text_cache)
    assert "results_file" not in path.read_text()  # the sweep's own file is no setting
    run = train.train(settings.Config(cfg, epochs=1, results_file=str(results), out_dir=str(tmp_path / "run"),
                                   full_validation=False, val_subset_tokens=512))
    assert run["status"] == "complete"

    # a rerun with the same code, config and machine measures nothing again (errors would be: an error may have
    # been the budget's cut or a passing fault; test_only_successes_are_reused)
    assert tune.main(argv) == 0
    again = read_results(results)["tuning"]
    assert [c["name"] for c in again["candidates"]] == [c["name"] for c in candidates]
    assert [(c["change"], s) for c in again["candidates"] for s in sweep_lib.STAGES
            if c[s] and not c[s]["reused"]] == []
    assert again["selected"]["tokens_per_second"] == selected["tokens_per_second"]
    assert again["environment"] == tuning["environment"]  # reused runs came back with the whole fingerprint


def test_only_successes_are_reused(tmp_path, text_cache, monkeypatch):
    """A rerun reuses an earlier sweep's measurement of the same candidate, protocol, machine and code; never an
    error, which may have been the budget's cut or a passing fault."""
    monkeypatch.setattr(env, "source_hash", lambda root=env.REPO: "the same code")
    results = tmp_path / "results.json"
    cfg = settings.Config(tune.DEFAULTS, data_dir=str(text_cache), results_file=str(results),
                       tuned_dir=str(tmp_path / "tuned"))
    runner = tune.BenchRunner(cfg)
    ok, failed = dict(cfg, micro_batch_size=4), dict(cfg, micro_batch_size=2)
    protocol = dict(sweep_lib.PROTOCOLS["screen"], data_mode="real")
    run = lambda c, status: {"status": status, "source_hash": runner.source, "tokens_per_second": 1.0,
                             "wall_seconds": 9.0, "measurements": [{"seconds": 2.0, "updates": 20}],
                             "candidate_identity": runner.identity(c, protocol), "environment": {"gpu": None}}
    record(results, ["tuning"], {"environment": {"cpu": "x"},
                                 "candidates": [{"screen": run(ok, "ok"), "confirm": None},
                                                {"screen": run(failed, "error"), "confirm": None}]})
    again = tune.BenchRunner(cfg).previous
    assert list(again) == [(runner.identity(ok, protocol), "screen")]  # each stage reuses its own measurement
    assert again[runner.identity(ok, protocol), "screen"]["environment"] == {"cpu": "x", "gpu": None}
    # a later sweep that did not measure it (a smaller budget: not started) leaves the earlier measurement reusable
    record(results, ["tuning"], {"candidates": [{"screen": None, "confirm": None}]})
    assert list(tune.BenchRunner(cfg).previous) == [(runner.identity(ok, protocol), "screen")]

    def previous(section):  # a results file holding only this tuning section
        alone = tmp_path / f"alone-{len(list(tmp_path.glob('alone-*')))}.json"
        record(alone, ["tuning"], section)
        return tune.BenchRunner(settings.Config(cfg, results_file=str(alone))).previous
    # a section edited by hand: what is not a record is left out, the rest still reused
    assert previous({"environment": "x", "candidates": [5, {"screen": dict(run(ok, "ok"), environment=3)}]})[
        runner.identity(ok, protocol), "screen"]["environment"] == {}
    # a success whose figures were edited by hand is measured again, not a TypeError when the sweep estimates
    for broken in ({"wall_seconds": None}, {"measurements": [{"seconds": "2", "updates": 20}]}, {"measurements": 3},
                   {"tokens_per_second": "fast"}, {"candidate_identity": ["a", "list"]}):
        assert previous({"candidates": [{"screen": dict(run(ok, "ok"), **broken)}]}) == {}, broken
    assert previous([1, 2]) == {}
    # a screen and a confirmation of one protocol (the CPU sweep's): the confirmation's rate stood in for the
    # screen's on a rerun, which then ranked the screens otherwise and could select another candidate
    again = previous({"candidates": [{"screen": dict(run(ok, "ok"), tokens_per_second=10.0),
                                      "confirm": dict(run(ok, "ok"), tokens_per_second=8.0)}]})
    identity = runner.identity(ok, protocol)
    assert (again[identity, "screen"]["tokens_per_second"], again[identity, "confirm"]["tokens_per_second"]) == (10, 8)


def test_a_candidate_config_states_its_levers_even_at_train_defaults(tmp_path, text_cache, monkeypatch):
    """compare.py --tuned layers the selected file over the given config: a lever left out because it equals
    train.py's default (micro-batch 8, eager) would silently keep the config's own value instead."""
    monkeypatch.setattr(env, "source_hash", lambda root=env.REPO: "the same code")
    results = tmp_path / "results.json"
    cfg = settings.Config(tune.DEFAULTS, data_dir=str(text_cache), results_file=str(results), micro_batch_size=16,
                          compile=True, tuned_dir=str(tmp_path / "tuned"))
    runner = tune.BenchRunner(cfg)
    candidate = dict({k: cfg[k] for k in tune.LEVER_KEYS}, micro_batch_size=8, compile=False)
    protocol = dict(sweep_lib.PROTOCOLS["screen"], data_mode="real")
    assert (candidate["micro_batch_size"], candidate["compile"]) == (train.DEFAULTS["micro_batch_size"],
                                                                     train.DEFAULTS["compile"])
    done = {"status": "ok", "source_hash": runner.source, "tokens_per_second": 1.0, "wall_seconds": 9.0,
            "measurements": [{"seconds": 2.0, "updates": 20}], "candidate_identity": runner.identity(candidate, protocol)}
    record(results, ["tuning"], {"candidates": [{"screen": done, "confirm": None}]})
    path = tune.BenchRunner(cfg)(candidate, "screen", protocol, timeout=60)["config_path"]  # reused: writes the file
    given = {k: cfg.get(k, default) for k, default in train.DEFAULTS.items()}  # the config compare.py was given
    layered = configurator.load_config(given, [path])
    assert (layered["micro_batch_size"], layered["compile"]) == (8, False)
    # the run's name is the file's, with the base config's hash: two sweeps' selections trained into one out/NAME
    assert layered["name"] == Path(path).stem and Path(path).stem.endswith(runner.base)


def test_the_tuning_record_states_the_machine_once_and_each_run_keeps_its_own_fields():
    run = lambda power: {"tokens_per_second": 1.0, "environment": {"gpu": "H200", "torch": "2.11", "power": power}}
    records = [{"name": "a", "screen": run(300), "confirm": run(600)}, {"name": "b", "screen": run(300), "confirm": None}]
    shared, compact = tune.shared_environment(records)
    assert shared == {"gpu": "H200", "torch": "2.11"}
    assert compact[0]["screen"]["environment"] == {"power": 300} and compact[1]["confirm"] is None
    assert records[0]["screen"]["environment"]["gpu"] == "H200"  # the sweep's own runs are left as they were
    assert tune.with_environment(compact[0]["confirm"], shared) == records[0]["confirm"]
    assert tune.shared_environment([{"name": "a", "screen": None, "confirm": None}])[0] is None


def test_generated_configs_go_where_git_ignores_them_and_never_over_a_tracked_file(tmp_path, text_cache, capsys,
                                                                                    monkeypatch):
    if subprocess.run(["git", "-C", str(env.REPO), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    assert tune.DEFAULTS["tuned_dir"] == "out/tuned"
    ignored = subprocess.run(["git", "-C", str(env.REPO), "check-ignore", "-q", "out/tuned/a.py"])
    assert ignored.returncode == 0
    assert (env.REPO / "config" / "tiny_cpu.py").resolve() in tune.tracked_files(env.REPO / "config")
    # a candidate's config that would land on a tracked file is refused before any run
    tracked = type("Everything", (), {"__contains__": lambda self, path: Path(path).name.startswith("micro-2-")})()
    monkeypatch.setattr(tune, "tracked_files", lambda folder: tracked)
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}",
                   f"--tuned_dir={tmp_path / 'tuned'}"]
    assert tune.main(argv) == 2
    out = capsys.readouterr()
    assert "a file git tracks" in out.err and "out/tuned" in out.err and "running" not in out.out
    assert not (tmp_path / "r.json").exists()


def test_unknown_backend_is_a_user_error(tmp_path, text_cache, capsys):
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", "--tune_backends=auto,fast"]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert "'fast'" in err and "cudnn" in err and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("key", ["--cold=True", "--profile=True", "--partial_probe=True", "--presets=20m"])
def test_bench_modes_a_screen_does_not_run_are_not_offered(tmp_path, text_cache, capsys, key):
    """A candidate's bench.py run takes the protocol's warmup, steps, windows and data mode; bench.py's other modes
    would be accepted and dropped, so they are unknown keys here."""
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", key]
    assert tune.main(argv) == 2
    assert f"unknown config key '{key[2:].split('=')[0]}'" in capsys.readouterr().err


@pytest.mark.skipif(flash_attn_4_installed(), reason="flash-attn-4 is installed here")
def test_fa4_named_where_it_cannot_run_is_refused_before_any_candidate(tmp_path, text_cache, capsys):
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", "--tune_backends=auto,fa4"]
    assert tune.main(argv) == 2
    err = capsys.readouterr().err
    assert "tune_backends names fa4, but fa4 runs on Hopper and Blackwell GPUs only, not on the cpu; leave it out" in err
    assert not (tmp_path / "r.json").exists()


def test_an_unwritable_tuned_dir_is_one_line_before_any_candidate(tmp_path, text_cache, capsys):
    (tmp_path / "afile").write_text("a file, not a folder")
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}",
                   f"--tuned_dir={tmp_path / 'afile' / 'tuned'}"]
    assert tune.main(argv) == 2
    out = capsys.readouterr()
    assert "tuned_dir" in out.err and "cannot be made" in out.err and "running" not in out.out


@pytest.mark.parametrize("arg, words", [("--budget=-1", "budget must be positive"),
                                        ("--budget=1e999", "budget must be a finite number"),
                                        ("--candidate_timeout=0", "candidate_timeout must be positive"),
                                        ("--name=tuning", "is a section of the results file"),
                                        ("--tune_compile_modes=,", "tune_compile_modes is empty"),
                                        ("--tune_compile_modes=fast", "'fast' is not one of eager, default"),
                                        ("--tune_loss_impls=liger", "'liger' is not one of full, fused, quack_chunked"),
                                        ("--tune_compile_scopes=layers", "'layers' is not one of model, blocks"),
                                        ("--tune_activation_memory_budgets=0.8,1.5", "must lie in (0, 1], got 1.5"),
                                        ("--tune_micro_batch_sizes=4,x", "list of int"),
                                        ("--tune_micro_batch_sizes=0", "micro_batch_size must be at least 1"),
                                        ("--tune_screen_warmup=0", "tune_screen_warmup must be at least 1"),
                                        ("--tune_screen_steps=-1", "tune_screen_steps must be 0 or more"),
                                        ("--tune_confirm=0", "tune_confirm must be at least 1"),
                                        ("--tune_screen_noise=2", "tune_screen_noise must lie in [0, 1]"),
                                        ("--tune_noise=-0.1", "tune_noise must be 0 or more"),
                                        ("--data_mode=bogus", "data_mode 'bogus'"),
                                        ("--warmup=0", "warmup must be at least 1"),
                                        # each would fail every candidate, and the sweep select nothing
                                        ("--data_dir=/nonexistent/cache", "/nonexistent/cache"),
                                        ("--preset=bogus", "preset 'bogus'"),
                                        ("--micro_batch_size=3", "micro_batch_size 3")])
def test_sweep_settings_are_checked_before_any_candidate(tmp_path, text_cache, capsys, arg, words):
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}", arg]
    assert tune.main(argv) == 2
    assert words in capsys.readouterr().err
    assert not results.exists() and not (tmp_path / "tuned").exists()


def test_the_budget_starts_before_the_checks_and_the_plan(tmp_path, text_cache, monkeypatch):
    """--budget is the sweep's whole time: the checks, the plan and the machine's fingerprint come out of it, so the
    sweep's clock starts before tune.py resolves the plan (a budget started after them overran by their time)."""
    import time
    seen = {}
    real_resolve = tune.plan_lib.resolve

    def resolve(*args, **kwargs):
        seen.setdefault("resolve", time.monotonic())
        return real_resolve(*args, **kwargs)

    class Stop(Exception):
        pass

    def sweep(*args, started=None, **kwargs):
        seen["started"] = started
        raise Stop
    monkeypatch.setattr(tune.plan_lib, "resolve", resolve)
    monkeypatch.setattr(tune, "Sweep", sweep)
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", f"--tuned_dir={tmp_path / 't'}"]
    with pytest.raises(Stop):
        tune.tune(settings.load(tune.TuneSettings, argv))
    assert seen["started"] is not None and seen["started"] <= seen["resolve"]


def test_a_compile_cache_is_refused_before_any_candidate(tmp_path, text_cache, capsys):
    """Every candidate read and overwrote the one file, and the eager candidate was skipped for it."""
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}",
                   "--compile=True", f"--compile_cache={tmp_path / 'c.compile'}"]
    assert tune.main(argv) == 2
    assert "tune.py times each candidate's own start" in capsys.readouterr().err
    assert not results.exists() and not (tmp_path / "tuned").exists() and not (tmp_path / "c.compile").exists()


def test_a_half_minute_budget_on_the_tiny_config_answers_with_a_selection(tmp_path, text_cache, capsys):
    """tune.py always answers: config/tiny_cpu.py (a smaller model on the test cache, no candidate besides the
    incumbent, so that it costs what the incumbent's measurement does) with its protocol, bench.py's 20 + 3 x 100
    updates, and a half-minute budget ends with the incumbent selected, measured with the protocol that fitted."""
    results = tmp_path / "results.json"
    argv = [str(env.REPO / "config" / "tiny_cpu.py"), f"--data_dir={text_cache}", "--vocab_size=256", "--dim=64",
            "--n_layers=2", "--hidden_dim=128", "--train_subset_tokens=60000", "--cpu_threads=1",
            "--tune_compile_modes=eager", "--tune_backends=auto", "--tune_loss_impls=full",
            "--tune_micro_batch_sizes=16", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}",
            "--budget=0.5"]
    assert tune.main(argv) == 0
    out, tuning = capsys.readouterr().out, read_results(results)["tuning"]
    selected, [incumbent] = tuning["selected"], tuning["candidates"]
    assert selected["lever"] == "incumbent" and selected["tokens_per_second"] > 0
    assert tuning["full_protocol"] == {"warmup": 20, "steps": 100, "windows": 3}  # not fixed: chosen from it
    assert selected["protocol"] == (tuning["protocols"]["confirm"] if selected["measured_by"] == "confirm"
                                    else tuning["protocols"]["screen"])
    assert selected["protocol"] in sweep_lib.ladder(tuning["full_protocol"], tuning["protocols"]["screen"])
    run = incumbent[selected["measured_by"]]  # the protocol recorded is the one the run was measured with
    assert {k: run["protocol"][k] for k in selected["protocol"]} == selected["protocol"]
    assert run["tokens_per_second"] == selected["tokens_per_second"] and run["status"] == "ok"
    assert tuning["elapsed_minutes"] <= 0.55  # each run ends by the budget's end at the latest
    assert f"{selected['tokens_per_second']:,.0f} tok/s (+0.0% over the incumbent), measured with " \
           f"{sweep_lib.said(selected['protocol'])} (its " in out


def test_the_report_names_a_failed_stage_an_exhausted_budget_and_no_selection(capsys):
    """The report's lines for a sweep that went wrong: each failed stage's error under the table, what an exhausted
    budget cut (runs not started, confirmations on a shorter protocol than bench.py's) and that nothing was selected."""
    short, full = {"warmup": 3, "steps": 20, "windows": 1}, {"warmup": 20, "steps": 100, "windows": 3}
    failed = {"change": "micro_batch_size=32", "screen": {"status": "failed", "error": "OutOfMemoryError: 2 GiB"},
              "confirm": None, "screen_ratio": None, "tokens_per_second": None, "protocol": short,
              "compile_seconds": None, "peak_memory_bytes": None, "status": "failed", "not_started": []}
    waiting = dict(failed, change="loss_impl=fused", screen=None, status="not started", not_started=["screen"])
    tune.print_report({"incumbent": {"tokens_per_second": None, "protocol": short}, "candidates": [failed, waiting],
                       "budget_split": {k: 60.0 for k in ("elapsed_seconds", "screen_seconds", "confirm_seconds",
                                                          "compile_seconds", "measure_seconds", "other_seconds")},
                       "budget_minutes": 1, "budget_exhausted": True, "protocols": {"confirm": short},
                       "full_protocol": full, "minutes_to_finish": 7.2, "selected": None, "noise": 0.01})
    out = capsys.readouterr().out
    assert "  micro_batch_size=32, screen: OutOfMemoryError: 2 GiB" in out
    assert ("budget exhausted: some runs did not fit in what was left; confirmations ran 3 + 1 x 20 updates, not "
            "20 + 3 x 100 updates; screening every candidate and confirming the best with the full protocol would "
            "take about 8 min (--budget)") in out
    assert out.rstrip().endswith("no selection: the incumbent could not be measured (not even its screen), nor any "
                                 "candidate confirmed")


def test_an_interrupted_sweep_records_what_it_measured_and_a_rerun_reuses_it(tmp_path, text_cache, capsys,
                                                                             monkeypatch):
    """The tuning section was written only when the sweep ended: a Ctrl-C or a scheduler's SIGTERM at minute 44 of
    45 left nothing a rerun could reuse, and every run was measured again."""
    monkeypatch.setattr(env, "source_hash", lambda root=env.REPO: "the same code")
    results = tmp_path / "results.json"
    argv = TINY + [f"--data_dir={text_cache}", f"--results_file={results}", f"--tuned_dir={tmp_path / 'tuned'}",
                   "--budget=5"]
    measure, calls = tune.BenchRunner.__call__, []

    def stopped_at_the_third(self, *args, **kwargs):
        calls.append(args[:2])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(self, *args, **kwargs)
    monkeypatch.setattr(tune.BenchRunner, "__call__", stopped_at_the_third)
    assert tune.main(argv) == 130
    assert "interrupted: the runs measured so far are recorded" in capsys.readouterr().err
    tuning = read_results(results)["tuning"]
    measured = [(c["name"], s) for c in tuning["candidates"] for s in sweep_lib.STAGES if c[s]]
    assert tuning["interrupted"] is True and tuning["selected"] is None and len(measured) == 2
    monkeypatch.setattr(tune.BenchRunner, "__call__", measure)
    assert tune.main(argv) == 0
    again = read_results(results)["tuning"]
    reused = [(c["name"], s) for c in again["candidates"] for s in sweep_lib.STAGES if c[s] and c[s]["reused"]]
    assert reused == measured and "interrupted" not in again


def test_what_a_measurement_depends_on_names_it_and_each_base_config_has_its_own_files(tmp_path, text_cache,
                                                                                        monkeypatch):
    """A measurement was reused across a replaced cache under synthetic data (the model's vocabulary follows it),
    another torch or the compiler's environment variables; and two sweeps of different configs wrote their
    candidates to the same files, so one's selection came to hold the other's model."""
    from tests.conftest import write_cache
    cfg = settings.Config(tune.DEFAULTS, data_dir=str(text_cache), results_file=str(tmp_path / "r.json"),
                          tuned_dir=str(tmp_path / "tuned"), data_mode="synthetic")
    candidate, protocol = {k: cfg[k] for k in tune.LEVER_KEYS}, dict(sweep_lib.PROTOCOLS["screen"])
    identity = lambda c: tune.BenchRunner(c).identity(candidate, protocol)
    first = identity(cfg)
    other = write_cache(tmp_path / "other", np.arange(4096) % 300, np.arange(1024) % 300, vocab_size=300)
    assert identity(settings.Config(cfg, data_dir=str(other))) != first
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    assert identity(cfg) != first
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE")
    monkeypatch.setattr(env, "package_versions", lambda: {"torch": "another"})
    assert identity(cfg) != first
    wider = settings.Config(cfg, dim=128)
    assert tune.BenchRunner(wider).config_path(candidate) != tune.BenchRunner(cfg).config_path(candidate)


def test_a_timed_out_run_ends_with_its_children(tmp_path):
    """subprocess.run's timeout killed bench.py alone: its compile workers went on, sharing the next candidate's
    GPU and CPU."""
    import os
    import time
    pid_file = tmp_path / "grandchild"
    script = (f"import subprocess, sys, time\nchild = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)'])\nopen({str(pid_file)!r}, 'w').write(str(child.pid))\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        tune.run_whole([sys.executable, "-c", script], timeout=3)
    grandchild = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/status").read_text()
        except FileNotFoundError:
            break
        if "\nState:\tZ" in state:  # killed, not yet reaped by its new parent
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the run's child {grandchild} still runs after the timeout")
    assert tune.run_whole([sys.executable, "-c", "print('ok')"], timeout=30).stdout == "ok\n"
