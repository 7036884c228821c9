"""scripts/summarize.py: the end-of-run table of a results file, every number formatted (plots.fmt) and a missing
one shown as "-"."""
import re
from pathlib import Path

from results import record
from scripts import summarize

LONG_FLOAT = re.compile(r"\d\.\d{6,}")  # what an unformatted float prints as: 4.612184740974987


def test_every_figure_is_formatted_and_a_missing_one_is_a_dash(tmp_path, capsys):
    path = tmp_path / "results.json"
    record(path, ["benchmarks", "b-ok"], {"status": "ok", "tokens_per_second": 2158588.123456,
                                          "first_update_seconds": 2.81234567, "peak_memory_bytes": 3.66 * 2**30,
                                          "scaling_efficiency": 0.9123456,
                                          "measurements": [{"tokens_per_second": 2163634.98765, "loss": 6.291764321},
                                                           {"tokens_per_second": 2129406.5, "loss": 5.2037712345}]})
    record(path, ["benchmarks", "a-benchmark-with-a-long-name-failed"], {"status": "error", "error": "OutOfMemory"})
    record(path, ["profiles", "b-ok"], {"profiled_updates": 3, "kernel_ms": 44.87654321,
                                        "kernel_ms_by_category": {"matmul": 20.0123456, "attention": 0.0},
                                        "top_kernels": [{"name": "nvjet_tst", "category": "matmul", "count": 24,
                                                         "ms": 3.3333333}]})
    record(path, ["run-a"], {"status": "complete", "final_validation": {"loss": 4.612184740974987,
                                                                       "tokens_per_second": 2329920.7764497222},
                             "median_training_tokens_per_second": 542427.4027064744})
    record(path, ["run-b"], {"status": "failed", "final_validation": None})
    summarize.main(str(path), [])
    out = capsys.readouterr().out
    assert not LONG_FLOAT.search(out), out
    lines = out.splitlines()
    assert lines[0].split() == ["b-ok", "ok", "2,158,588", "first", "2.8s", "peak", "3.66", "dev", "-", "GiB",
                                "windows", "2,163,635", "/", "2,129,406", "eff", "0.91"]
    assert lines[1].split() == ["window", "losses", "6.29176", "/", "5.20377"]
    assert lines[2].split()[:4] == ["a-benchmark-with-a-long-name-failed", "error", "-", "first"]
    assert lines[2].endswith("OutOfMemory")
    assert lines[0].index(" ok ") + 3 == lines[2].index("error") + 5  # a long name keeps the status column in line
    assert lines[3] == "b-ok: 14.96 ms of kernels per update (matmul 6.67)"
    assert lines[4].split() == ["1.111", "ms", "x8", "matmul", "nvjet_tst"]
    assert lines[5].split() == ["run-a", "complete", "validation", "loss", "4.6122", "validation", "tok/s",
                                "2,329,921", "median", "training", "tok/s", "542,427"]
    assert lines[6].split() == ["run-b", "failed", "validation", "loss", "-", "validation", "tok/s", "-", "median",
                                "training", "tok/s", "-"]


def test_the_projects_results_file_prints_no_unformatted_float(capsys):
    summarize.main(str(Path(__file__).resolve().parent.parent / "results" / "h200.json"), [])
    out = capsys.readouterr().out
    assert "validation loss 4.6122" in out and not LONG_FLOAT.search(out)


def test_prefixes_keep_only_their_entries_and_a_partial_profile_is_named_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "results.json"
    record(path, ["benchmarks", "keep-a"], {"status": "ok", "tokens_per_second": 1.0})
    record(path, ["benchmarks", "drop-b"], {"status": "ok", "tokens_per_second": 2.0})
    record(path, ["profiles", "keep-a"], {"kernel_ms": 3.0})  # a hand-cut profile
    summarize.main(str(path), ["keep"])
    out = capsys.readouterr().out
    assert "keep-a" in out and "drop-b" not in out
    assert "keep-a: a partial profile (no profiled_updates or kernel_ms_by_category), left out" in out
