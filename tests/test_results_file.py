"""The results file's reading (results.py): what the other tests of it leave open."""
import pytest

from results import lookup, read_results, record


@pytest.mark.parametrize("content", ["", "\n", "  \n\t\n"])
def test_an_empty_or_blank_results_file_reads_as_no_entries_and_takes_a_record(tmp_path, content):
    """A file made by `touch` or `echo > results.json` holds no entries yet: it is not a JSON error."""
    path = tmp_path / "r.json"
    path.write_text(content)
    assert read_results(path) == {}
    record(path, ["runs", "a"], {"run_id": "1"})
    assert lookup(path, ["runs", "a", "run_id"]) == "1"
