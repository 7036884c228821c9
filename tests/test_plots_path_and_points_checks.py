"""plots.py's path checks, table cells and points: suffix case, the name-length edge, x=0, runs without curves."""
import os

import pytest

import plots
from tests.test_plots import PNG_MAGIC, run_entry


def test_an_upper_case_suffix_is_a_plot_path_and_is_written(tmp_path):
    out = tmp_path / "RUNS.PNG"
    plots.check_path(out)
    plots.save_plot(out, [("a", run_entry(0.0))])
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_the_longest_name_the_file_system_allows_for_the_temporary_file_is_accepted_and_written(tmp_path):
    """The refusal says "at most N bytes": a name of exactly N is written, one of N + 1 refused."""
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    at_most = longest - 14
    fits = tmp_path / ("a" * (at_most - 4) + ".png")
    plots.check_path(fits)
    plots.save_plot(fits, [("a", run_entry(0.0))])
    assert fits.read_bytes().startswith(PNG_MAGIC)
    with pytest.raises(plots.PlotError, match=f"its name is too long for its file system \\(at most {at_most} bytes"):
        plots.check_path(tmp_path / ("a" * (at_most - 3) + ".png"))


def test_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """As root every folder is writable: the check is made to see a read-only one."""
    monkeypatch.setattr(plots.os, "access", lambda path, mode: False)
    with pytest.raises(plots.PlotError, match=f"--plot {tmp_path / 'r.png'}: cannot create or write into {tmp_path}"):
        plots.check_path(tmp_path / "r.png", option="--plot")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, True, "3.0"])
def test_a_cell_of_no_finite_number_is_a_dash(value):
    """NaN (a diverged run in an older file), a bool or a string edited in by hand are no figure to print."""
    assert plots.fmt(value, ".2f", " s") == "-"
    assert plots.fmt(2.5, ".2f", " s") == "2.50 s"


def test_a_point_at_x_zero_is_drawn():
    """The validation before the first update is at 0 tokens and 0 seconds: a point, not a missing x."""
    entry = {"validation_curve": [{"tokens": 0, "training_seconds": 0.0, "loss": 5.5},
                                  {"tokens": 100, "training_seconds": 1.0, "loss": 4.0}]}
    assert plots.points(entry, "validation_curve", "tokens") == ([0, 100], [5.5, 4.0])
    assert plots.points(entry, "validation_curve", "training_seconds") == ([0.0, 1.0], [5.5, 4.0])


def test_a_run_without_any_curve_is_not_called_diverged():
    """A failed run recorded no point: it has no curve, which is not "no finite loss"."""
    diverged = {"validation_curve": [{"tokens": 10, "loss": None}]}
    assert plots.without_finite_losses([("failed", {"status": "failed"}), ("diverged", diverged)]) == ["diverged"]


def test_ten_runs_take_matplotlibs_ten_colours():
    assert [plots.line_style(i, 10) for i in range(10)] == [{"color": f"C{i}"} for i in range(10)]
    assert "linestyle" in plots.line_style(0, 11)
