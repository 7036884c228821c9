"""compare.py: matched runs through real train.py subprocesses, the verdict both ways, and the read-only mode."""
import numpy as np
import pytest

import configurator
from results import lookup, read_results, record
import compare
import env
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


@pytest.fixture
def tiny(text_cache, tmp_path, monkeypatch):
    """A tiny config and a results file in tmp_path, which is also the working folder (out/ goes there)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.py"
    path.write_text(TINY.format(cache=str(text_cache)))
    return str(path), str(tmp_path / "results.json")


def test_matched_runs_agree_and_are_reused_and_rereadable(tiny, tmp_path, capsys):
    config, results = tiny
    # 1 x 4 accumulation against 4 x 1: the same updates, summed in another order.
    argv = [config, "--name=m", f"--results_file={results}", "--baseline_micro_batch_size=1", "--micro_batch_size=4"]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert "[baseline] " in out and "[optimized] " in out and "verdict" in out
    c = lookup(results, ["matched-comparison"])
    assert c["baseline"] == "m-baseline" and c["optimized"] == "m-optimized"
    assert c["recipe_identity_equal"] and c["recipe_differences"] == []
    assert c["losses_agree"] and c["recipe_equal_except_execution"] and c["label"] == "matched run"
    assert abs(c["loss_difference"]) <= c["tolerance"] and "3 * sqrt" in c["tolerance_rule"]
    assert c["speed_ratio"] == pytest.approx(
        lookup(results, ["m-optimized", "median_training_tokens_per_second"])
        / lookup(results, ["m-baseline", "median_training_tokens_per_second"]))
    for name in ("m-baseline", "m-optimized"):
        run = c[name]
        assert run["result"]["status"] == "complete"
        assert not {"environment", "config", "recipe"} & set(run["result"])
        assert len(run["validation_curve"]) == 2
        assert {"tokens", "loss", "seconds"} <= set(run["validation_curve"][0])
        assert run["final_validation"]["loss"] == run["result"]["final_validation"]["loss"]
    runs = read_results(results)
    assert runs["m-baseline"]["config"]["micro_batch_size"] == 1
    assert runs["m-optimized"]["config"]["micro_batch_size"] == 4
    assert c["plot"] == "out/m-comparison.png"
    png = (tmp_path / c["plot"]).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    # The same command again reuses both complete runs instead of training.
    assert compare.main(argv) == 0
    assert capsys.readouterr().out.count("reusing the complete run") == 2
    again = read_results(results)
    assert again["m-baseline"]["run_id"] == runs["m-baseline"]["run_id"]

    # Read-only: two finished runs by name; the earlier comparison moves to the history.
    plot = tmp_path / "read-only.png"
    assert compare.main([f"--results_file={results}", "--baseline=m-baseline", "--optimized=m-optimized",
                         f"--plot={plot}"]) == 0
    c2 = lookup(results, ["matched-comparison"])
    assert c2["run_id"] != c["run_id"] and c2["recipe_equal_except_execution"] and c2["plot"] == str(plot)
    assert c2["loss_difference"] == c["loss_difference"]
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


def test_recipe_change_is_refused_unless_allowed(tiny, capsys):
    config, results = tiny
    argv = [config, "--name=r", f"--results_file={results}", "--baseline_micro_batch_size=1",
            "--micro_batch_size=4", "--optimized_overrides=--learning_rate=1e-4 --min_lr=1e-5"]
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
    runs = read_results(results)
    assert runs["r-optimized"]["config"]["learning_rate"] == 1e-4
    assert runs["r-baseline"]["config"]["learning_rate"] == 1e-2

    # Read-only comparison of the same runs is refused too, naming the field.
    capsys.readouterr()
    assert compare.main([f"--results_file={results}", "--baseline=r-baseline", "--optimized=r-optimized"]) == 2
    assert "learning_rate" in capsys.readouterr().err


def test_mistakes_are_one_line_errors(tiny, capsys):
    config, results = tiny
    # The default baseline micro-batch (8) does not divide the 4 sequences of an update.
    assert compare.main([config, f"--results_file={results}", "--micro_batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert "baseline run" in err and "baseline_micro_batch_size" in err and "valid sizes: [1, 2, 4]" in err
    for argv, words in (([f"--results_file={results}", "--baseline=a"], "--optimized"),
                        ([config, f"--results_file={results}", "--tuned=True"], "tune.py"),
                        ([config, "--optimized_overrides=--learnin_rate=1"], "learning_rate"),
                        ([config, "--full_validation=False"], "full_validation")):
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
    3 x sqrt(2) x their standard deviation, and never narrow it."""
    results = tmp_path / "results.json"
    record(results, ["base"], finished(4.600, speed=500.0))
    record(results, ["far"], finished(4.650, speed=2000.0))
    for i, loss in enumerate((4.59, 4.62, 4.65)):
        record(results, [f"repeat-{i}"], finished(loss))
    read = lambda optimized, *extra: compare.main([f"--results_file={results}", "--baseline=base",
                                                   f"--optimized={optimized}", f"--plot={tmp_path / 'p.png'}", *extra])
    assert read("far") == 1  # 0.05 apart; validation tolerance 3 * sqrt(2) * 3 / 1000 = 0.0127
    c = lookup(results, ["matched-comparison"])
    assert not c["losses_agree"] and c["tolerance"] == pytest.approx(3 * 2 ** 0.5 * 3.0 / 1000)
    assert c["speed_ratio"] == pytest.approx(4.0) and "not shown" in capsys.readouterr().out
    assert read("far", "--noise_runs=repeat-0,repeat-1,repeat-2") == 0
    c = lookup(results, ["matched-comparison"])
    std = float(np.std([4.59, 4.62, 4.65], ddof=1))
    assert c["losses_agree"] and c["training_noise_std"] == pytest.approx(std)
    assert c["tolerance"] == pytest.approx(3 * 2 ** 0.5 * std)
    # Noise runs of another recipe, or the compared runs themselves, would widen the tolerance at will: the pair
    # as its own noise gives at least 3 x their difference, so any two runs would pass.
    capsys.readouterr()
    assert read("far", "--noise_runs=base,far") == 2
    assert "a run being compared" in capsys.readouterr().err
    record(results, ["big-model"], dict(finished(5.9), recipe={"seed": "r1", "model": {"dim": 768}}))
    assert read("far", "--noise_runs=repeat-0,big-model") == 2
    assert "noise run big-model is not the baseline's recipe (it differs in model)" in capsys.readouterr().err
    record(results, ["other-recipe"], finished(4.601, recipe="r2"))
    assert read("other-recipe") == 2  # a different recipe is refused, not compared
    assert "different recipes" in capsys.readouterr().err


def test_tuned_config_and_overrides_layer_on_the_optimized_side_only(tiny, tmp_path, capsys):
    config, results = tiny
    tuned = tmp_path / "tuned.py"
    tuned.write_text("micro_batch_size = 2\nloss_impl = 'chunked'\n")
    record(results, ["tuning"], {"selected": {"config_path": str(tuned)}})
    argv = [config, "--name=t", f"--results_file={results}", "--tuned=True", "--baseline_micro_batch_size=1",
            "--loss_impl=chunked", "--optimized_overrides=--eval_batch_size=4"]
    base, opt = compare.side_configs(compare.train.Config(configurator.load_config(compare.DEFAULTS, argv)))
    assert (base.name, opt.name) == ("t-baseline", "t-optimized")
    assert (base.micro_batch_size, base.loss_impl, base.eval_batch_size) == (1, "full", 32)
    assert (opt.micro_batch_size, opt.loss_impl, opt.eval_batch_size) == (2, "chunked", 4)
    assert base.results_file == opt.results_file == results
    assert "baseline" not in base and "tuned" not in opt  # compare's own keys never reach train.py

    tuned.unlink()
    assert compare.main(argv) == 2
    assert "tuned.py" in capsys.readouterr().err


def test_the_table_names_every_execution_setting_off_its_default():
    """The matched table says how each side ran, down to the settings that made it lean or fast."""
    cfg = dict(train.DEFAULTS, micro_batch_size=32, compile=True, compile_scope="blocks",
               compile_mode="reduce-overhead", activation_memory_budget=0.8, loss_impl="fused")
    summary = compare.execution_summary(cfg)
    assert summary.startswith("mb 32, compile True")
    for shown in ("compile_scope blocks", "compile_mode reduce-overhead", "activation_memory_budget 0.8",
                  "loss_impl fused"):
        assert shown in summary
    assert "attention_backend" not in summary and "loss_chunk_tokens" not in summary  # at their defaults
    assert compare.execution_summary(dict(train.DEFAULTS)) == "mb 8, compile False"
