"""data/sources.py: which files of a --source are documents, how its train and val splits are found, what identifies
it, and how its documents are read."""
import json

import pytest

from data import sources


def jsonl(path, n=2):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(n)))
    return path


def test_hidden_files_and_folders_of_a_source_are_no_documents(tmp_path):
    """An editor's .swp copy, a .git or .cache folder inside a corpus folder hold files of supported types that are
    not the corpus: they are left out of it, whatever their extension."""
    src = tmp_path / "src"
    kept = [jsonl(src / "a.jsonl"), jsonl(src / "sub" / "b.jsonl")]
    jsonl(src / ".a.jsonl")
    jsonl(src / ".cache" / "c.jsonl")
    jsonl(src / "sub" / ".git" / "d.json")
    assert sources.data_files_in(src) == sorted(kept)
    split_files, _, rule, builder = sources.find_local(str(src))
    assert split_files == {"corpus": sorted(kept)} and rule is None and builder == "json"


def test_a_train_folder_without_a_val_folder_is_one_corpus_held_out_by_hash(tmp_path):
    """train/ alone names no split: every file is the corpus, and validation is held out from it by hash."""
    src = tmp_path / "src"
    files = [jsonl(src / "train" / "a.jsonl"), jsonl(src / "other" / "b.jsonl")]
    split_files, _, rule, _ = sources.find_local(str(src))
    assert split_files == {"corpus": sorted(files)} and rule is None


def test_a_glob_identifies_its_files_as_the_folder_that_holds_them_does(tmp_path):
    """The source's identity lists each file by its name below the glob's folder, as a folder source does: the same
    files given as DIR or as DIR/*.jsonl, or copied to another folder, are the same source (the cache is reused)."""
    def identity(source):
        return sources.find_source(str(source), streaming=False, max_documents=None, hub_reachable=lambda: False)[2]
    for name in ("one", "two"):
        jsonl(tmp_path / name / "a.jsonl")
        jsonl(tmp_path / name / "b.jsonl", n=3)
    folder, glob = identity(tmp_path / "one"), identity(f"{tmp_path / 'one'}/*.jsonl")
    assert folder == glob == identity(f"{tmp_path / 'two'}/*.jsonl")
    assert identity(tmp_path / "one") != sources.find_source(str(tmp_path / "one"), False, 1, lambda: False)[2]


def test_a_streamed_row_that_is_no_string_is_named_by_its_row_in_the_whole_split():
    """The row number in the error counts from the split's first row, not from the start of the batch it came in."""

    class Rows:
        def __init__(self, texts):
            self.texts = texts

        def iter(self, batch_size):
            for i in range(0, len(self.texts), batch_size):
                yield {"text": self.texts[i:i + batch_size]}

    class RowError(Exception):
        pass

    docs = sources.Documents(Rows(["a", None, "c", "d", 5, "f"]), "test rows",
                             row_error=lambda n, found: RowError(n, found))
    with pytest.raises(RowError) as info:
        list(docs.batches(size=2))
    assert info.value.args == (5, "a number")
    passed = sources.Documents(Rows(["a", None, "c"]), "x", row_error=RowError)  # a row without text: no error
    assert list(passed.batches(size=2)) == [["a", None], ["c"]]


def test_max_documents_beyond_a_local_sources_documents_reads_them_all(tmp_path):
    """--max_documents caps the documents read; a cap above what the files hold reads every document."""
    jsonl(tmp_path / "src" / "a.jsonl", n=3)
    read, _, _ = sources.find_source(str(tmp_path / "src"), streaming=False, max_documents=10,
                                     hub_reachable=lambda: False)
    (tmp_path / "build").mkdir()
    docs = read(tmp_path / "build")
    assert [t for batch in docs["corpus"].batches() for t in batch] == [f"document {i}" for i in range(3)]
    read, _, _ = sources.find_source(str(tmp_path / "src"), streaming=False, max_documents=2,
                                     hub_reachable=lambda: False)
    assert [t for batch in read(tmp_path / "build")["corpus"].batches() for t in batch] == ["document 0", "document 1"]
