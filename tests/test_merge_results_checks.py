"""scripts/merge_results.py: which of two states of one run is newer, entries without run_ids, FROM's history of a name
INTO lacks, and the command line's default file and exit statuses."""
import pytest

from results import read_results, record
from scripts import merge_results

RUN = "20250101T100000-1-aaaaaa"


def merged_run(tmp_path, into_state, from_state):
    into, source = tmp_path / "into.json", tmp_path / "from.json"
    record(into, ["run"], dict(into_state, run_id=RUN))
    record(source, ["run"], dict(from_state, run_id=RUN))
    counts = merge_results.merge(source, into)
    return counts, read_results(into)


@pytest.mark.parametrize("older, newer", [
    (dict(status="running", sessions=1, step=50), dict(status="running", sessions=2, step=40)),
    (dict(status="running", sessions=1, step=50), dict(status="running", sessions=1, step=80)),
    (dict(status="running", sessions=1, step=100), dict(status="complete", sessions=1, step=100)),
], ids=["resumed", "further", "finished"])
def test_the_state_of_a_run_further_along_wins_whichever_file_holds_it(tmp_path, older, newer):
    assert merged_run(tmp_path, older, newer) == ((1, 0), {"run": dict(newer, run_id=RUN)})
    assert merged_run(tmp_path / "other", newer, older) == ((0, 1), {"run": dict(newer, run_id=RUN)})


def test_an_equally_far_state_of_the_same_run_leaves_intos_entry_as_it_is(tmp_path):
    state = dict(status="complete", sessions=1, step=100)
    annotated = dict(state, final_validation={"loss": 3.2})
    assert merged_run(tmp_path, annotated, state) == ((0, 1), {"run": dict(annotated, run_id=RUN)})


def test_an_object_of_entries_without_run_ids_is_replaced_whole_and_the_old_one_kept(tmp_path):
    into, source = tmp_path / "into.json", tmp_path / "from.json"
    old = {"matmul": {"tflops": 700.0}, "memory": {"gbps": 4000.0}}
    record(into, ["ceilings-x"], old)
    record(source, ["ceilings-x"], {"matmul": {"tflops": 720.0}})
    assert merge_results.merge(source, into) == (1, 0)
    merged = read_results(into)
    assert merged["ceilings-x"] == {"matmul": {"tflops": 720.0}}
    assert [h["value"] for h in merged["history"]] == [old]


def test_what_from_replaced_under_a_name_into_lacks_joins_intos_history(tmp_path):
    into, source = tmp_path / "into.json", tmp_path / "from.json"
    record(into, ["benchmarks", "here"], {"run_id": "20250101T000000-a"})
    record(source, ["benchmarks", "new"], {"run_id": "20250102T000000-b"})
    record(source, ["benchmarks", "new"], {"run_id": "20250103T000000-c"})
    assert merge_results.merge(source, into) == (1, 0)
    merged = read_results(into)
    assert {name: e["run_id"] for name, e in merged["benchmarks"].items()} == {
        "here": "20250101T000000-a", "new": "20250103T000000-c"}
    assert [(h["path"], h["value"]["run_id"]) for h in merged["history"]] == [
        (["benchmarks", "new"], "20250102T000000-b")]


def test_the_command_line_merges_into_results_h200_json_by_default_and_refuses_a_third_path(tmp_path, monkeypatch,
                                                                                               capsys):
    monkeypatch.chdir(tmp_path)
    record(tmp_path / "results" / "h200.json", ["benchmarks", "a"], {"run_id": "20250101T000000-a"})
    record(tmp_path / "from.json", ["benchmarks", "b"], {"run_id": "20250102T000000-b"})
    assert merge_results.main(["from.json"]) == 0
    assert sorted(read_results(tmp_path / "results" / "h200.json")["benchmarks"]) == ["a", "b"]
    assert capsys.readouterr().out == "merged 1 entries of from.json into results/h200.json\n"
    assert merge_results.main(["from.json", "results/h200.json", "more.json"]) == 2
    assert capsys.readouterr().err.startswith("usage: python scripts/merge_results.py FROM.json [INTO.json]")
