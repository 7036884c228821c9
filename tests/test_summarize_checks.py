"""scripts/summarize.py: name prefixes in every section, a file of one entry, a profile of no updates, and the command
line's usage and missing-file errors."""
import runpy
import sys

import pytest

from results import record
from scripts import summarize

SCRIPT = summarize.__file__


def test_a_prefix_keeps_the_names_that_start_with_it_in_every_section_and_says_when_none_does(tmp_path, capsys):
    path = tmp_path / "results.json"
    profile = {"profiled_updates": 2, "kernel_ms": 4.0, "kernel_ms_by_category": {"matmul": 4.0}}
    for name in ("20m-a", "x-20m-b"):
        record(path, ["benchmarks", name], {"status": "ok", "tokens_per_second": 1.0})
        record(path, ["profiles", name], profile)
        record(path, [f"run-{name}"], {"status": "complete", "final_validation": {"loss": 4.0}})
    summarize.main(str(path), ["20m", "run-20m"])
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["20m-a", "20m-a:", "run-20m-a"]
    summarize.main(str(path), ["50m"])
    assert capsys.readouterr() == ("", f"no entry of {path} starts with 50m\n")


def test_a_file_of_one_run_prints_its_line(tmp_path, capsys):
    path = tmp_path / "results.json"
    record(path, ["run-a"], {"status": "complete", "final_validation": {"loss": 4.25}})
    summarize.main(str(path), [])
    assert capsys.readouterr().out.split()[:5] == ["run-a", "complete", "validation", "loss", "4.2500"]


def test_a_profile_of_no_updates_is_named_partial_not_divided_by(tmp_path, capsys):
    path = tmp_path / "results.json"
    record(path, ["profiles", "p"], {"profiled_updates": 0, "kernel_ms": 4.0, "kernel_ms_by_category": {"matmul": 4.0}})
    summarize.main(str(path), [])
    assert capsys.readouterr().out == "p: a partial profile (no profiled_updates or kernel_ms_by_category), left out\n"


@pytest.mark.parametrize("argv, said", [([], "usage: python scripts/summarize.py RESULTS.json [PREFIX ...]"),
                                        (["missing.json"], "error: results file missing.json does not exist")])
def test_the_command_line_says_its_usage_and_a_missing_file_in_one_line(monkeypatch, tmp_path, argv, said):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(SCRIPT, run_name="__main__")
    assert exit_info.value.code == said


def test_a_slowest_kernel_row_without_some_fields_prints_dashes_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "results.json"
    kernels = [{"name": "gemm", "category": "matmul", "count": 4, "ms": 3.0}, {"name": "cut by hand"}]
    record(path, ["profiles", "p"], {"profiled_updates": 2, "kernel_ms": 4.0, "kernel_ms_by_category": {"matmul": 4.0},
                                     "top_kernels": kernels})
    summarize.main(str(path), [])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["1.500", "ms", "x2", "matmul", "gemm"], ["-", "ms", "x-", "-", "cut", "by", "hand"]]
