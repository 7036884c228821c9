"""compare.py's matched mode (matched.py): refusals and verdict fields that the end-to-end tests in test_compare.py
leave open, on hand-made entries and configs, without training."""
import pytest

import compare
import configurator
import matched
import settings
from results import record
from tests.test_compare import finished


def matched_config(tmp_path, *argv):
    return settings.Config(configurator.load_config(compare.DEFAULTS, [
        "config/tiny_cpu.py", f"--results_file={tmp_path / 'r.json'}", *argv]))


@pytest.mark.parametrize("key", ["--overwrite=True", "--resume=True", "--results_file=elsewhere.json"])
def test_optimized_overrides_may_not_set_what_compare_sets_for_each_run(tmp_path, key):
    cfg = matched_config(tmp_path, f"--optimized_overrides={key} --micro_batch_size=8")
    with pytest.raises(matched.CompareError, match=f"--optimized_overrides sets {key[2:].split('=')[0]}, which"):
        matched.side_configs(cfg)


def test_a_baseline_without_full_validation_is_refused_even_where_the_optimized_side_has_it(tmp_path):
    """The verdict compares both runs' full validation losses: the baseline's is needed as much as the other's."""
    cfg = matched_config(tmp_path, "--full_validation=False", "--optimized_overrides=--full_validation=True",
                         "--allow_recipe_change=True")
    base, optimized = matched.side_configs(cfg)
    assert (base.full_validation, optimized.full_validation) == (False, True)
    with pytest.raises(matched.CompareError, match="set full_validation=True"):
        matched.check_before_training(cfg, [base, optimized])


def test_the_baseline_alone_as_a_noise_run_is_refused(tmp_path):
    """The baseline as its own noise run adds a zero difference: a noise estimate of nothing."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600), config={"seed": 7}))
    record(results, ["opt"], finished(4.601))
    with pytest.raises(matched.CompareError, match="--noise_runs names base, a run being compared"):
        matched.compare_runs(results, "base", "opt", False, tmp_path / "p.png", noise_runs="base", noise_seed_runs=0)


def test_a_training_noise_below_the_validation_noise_never_narrows_the_tolerance(tmp_path):
    """A noise run that happens to land next to the baseline measures a small training noise: the validation
    noise stays the floor, and a difference within it still agrees."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600), config={"seed": 7}))
    record(results, ["repeat"], finished(4.6001))
    record(results, ["opt"], finished(4.601))
    c = matched.compare_runs(results, "base", "opt", False, tmp_path / "p.png", noise_runs="repeat",
                             noise_seed_runs=0)
    validation = 3 * 2 ** 0.5 * 3.0 / 1000
    assert c["training_noise_tolerance"] == pytest.approx(3 * 0.0001)
    assert c["validation_tolerance"] == c["tolerance"] == pytest.approx(validation)
    assert c["losses_agree"] and c["recipe_equal_except_execution"]


def test_an_entry_without_a_config_is_an_unknown_execution_not_the_same_one(tmp_path, capsys):
    """Two runs whose executions cannot be told (one entry records no config) are not called the same execution,
    which would say that any speed ratio between them is noise."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600), config={"seed": 7, "device": "cpu"}))
    record(results, ["opt"], finished(4.601, speed=2000.0))
    c = matched.compare_runs(results, "base", "opt", False, tmp_path / "p.png", noise_seed_runs=0)
    assert c["same_execution"] is None and c["execution_differences"] is None
    assert c["speed_ratio"] == pytest.approx(2.0) and c["speed_verdict"] == "noise not measured"
    out = capsys.readouterr().out
    assert "execution unknown (an entry records no config)" in out and "same execution" not in out


def test_a_noise_run_with_a_recipe_key_the_baseline_leaves_at_its_default_is_refused(tmp_path):
    """A key off its default is in one recipe only (the other leaves it out): a difference all the same."""
    results = tmp_path / "results.json"
    record(results, ["base"], dict(finished(4.600), config={"seed": 7}))
    record(results, ["opt"], finished(4.601))
    record(results, ["averaged"], dict(finished(4.602), recipe={"seed": "r1", "ema": 0.9}))
    with pytest.raises(matched.CompareError, match=r"noise run averaged is not the baseline's recipe \(it differs "
                                                   r"in ema\)"):
        matched.compare_runs(results, "base", "opt", False, tmp_path / "p.png", noise_runs="averaged",
                             noise_seed_runs=0)
