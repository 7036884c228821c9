"""The results file's reading and its history (results.py): what the other tests of it leave open."""
import pytest

from results import lookup, read_results, record, record_many


@pytest.mark.parametrize("content", ["", "\n", "  \n\t\n"])
def test_an_empty_or_blank_results_file_reads_as_no_entries_and_takes_a_record(tmp_path, content):
    """A file made by `touch` or `echo > results.json` holds no entries yet: it is not a JSON error."""
    path = tmp_path / "r.json"
    path.write_text(content)
    assert read_results(path) == {}
    record(path, ["runs", "a"], {"run_id": "1"})
    assert lookup(path, ["runs", "a", "run_id"]) == "1"


def test_values_another_file_replaced_come_first_in_the_history_before_what_this_write_replaces(tmp_path):
    """record_many's replaced entries were replaced before this write: the history stays in the order the values
    were replaced, the older ones first, each as it was."""
    path = tmp_path / "r.json"
    record(path, ["runs", "a"], {"run_id": "1", "loss": 3.0})
    elsewhere = {"path": ["runs", "a"], "replaced_at": 1.0, "value": {"run_id": "0", "loss": 4.0}}
    record_many(path, [(["runs", "a"], {"run_id": "2", "loss": 2.0})], replaced=[elsewhere])
    data = read_results(path)
    assert data["runs"]["a"] == {"run_id": "2", "loss": 2.0}
    assert data["history"][0] == elsewhere
    assert [h["value"]["run_id"] for h in data["history"]] == ["0", "1"]
