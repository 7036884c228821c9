"""data/prepare.py on a few truncated books of the shared corpus and on small made-up corpora (CPU, no network)."""
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data import parts, sources
from data import prepare as prep
from data.prepare import PrepareError, prepare
from data.prepare import main as prepare_main

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "gutenberg"
META_KEYS = {"format", "tokenizer", "tokenizer_files_sha256", "vocab_size", "vocab_size_requested", "eot_token_id",
             "dtype", "train_tokens", "val_tokens", "train_documents", "val_documents", "source", "source_sha256",
             "split_rule", "train_sha256", "val_sha256", "inputs_identity", "cache_identity", "seconds", "created",
             "shuffle_seed", "shard_tokens", "train_shards", "val_shards"}
VOCAB = 512  # small, so the BPE trains in well under a second


def read_book(path, n=100_000):
    return gzip.open(path, "rt", encoding="utf-8").read()[:n]


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """3 train books and 1 val book, ~100 KB each: two as plain .txt, two as .txt.gz. Returns (folder, texts)."""
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    src = tmp_path_factory.mktemp("books")
    texts = {}
    picks = [("train", p) for p in sorted((CORPUS / "train").glob("*.txt.gz"))[:3]] + \
            [("val", sorted((CORPUS / "val").glob("*.txt.gz"))[0])]
    for i, (split, path) in enumerate(picks):
        (src / split).mkdir(exist_ok=True)
        text = read_book(path)
        name = path.name if i % 2 else path.name[:-3]  # alternate .txt.gz and plain .txt
        opener = gzip.open if name.endswith(".gz") else open
        with opener(src / split / name, "wt", encoding="utf-8") as f:
            f.write(text)
        texts[f"{split}/{name}"] = text
    return src, texts


@pytest.fixture(scope="module")
def built(books, tmp_path_factory):
    src, _ = books
    out = tmp_path_factory.mktemp("cache") / "books"
    return out, prepare(src, out, vocab_size=VOCAB, num_proc=2)  # 2 workers here; the other tests use 1


def load_bin(out, split, meta):
    """A split's tokens: its shards' in order."""
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta[f"{split}_shards"]])


def split_bytes(out, split, meta):
    return b"".join((out / s["file"]).read_bytes() for s in meta[f"{split}_shards"])


def shuffled(docs, first_ordinal=0, seed=0):
    """Documents in the documented shuffled order: by the first 8 bytes of sha256(f"{seed}:{ordinal}"), where the
    ordinal is the document's place in the source (train documents first, then val)."""
    key = lambda i: hashlib.sha256(f"{seed}:{first_ordinal + i}".encode()).digest()[:8]
    return [d for _, d in sorted(enumerate(docs), key=lambda p: key(p[0]))]


def split_docs(ids, eot):
    """Token ids of each document: the bin is documents each followed by EOT."""
    ends = np.flatnonzero(ids == eot)
    assert len(ends) and ends[-1] == len(ids) - 1
    return np.split(ids, ends + 1)[:-1]


def decode_docs(out, split, meta):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    return [tok.decode(d[:-1].tolist()) for d in split_docs(load_bin(out, split, meta), meta["eot_token_id"])]


def test_end_to_end(books, built):
    src, texts = books
    out, meta = built
    assert set(meta) == META_KEYS
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == meta["vocab_size_requested"] == VOCAB
    assert meta["eot_token_id"] == 0
    assert meta["tokenizer"] == f"bpe-{VOCAB}-trained" and meta["split_rule"] == "folders train/ and val/"
    assert meta["train_documents"] == 3 and meta["val_documents"] == 1
    for split in ("train", "val"):
        ids = load_bin(out, split, meta)
        shards = meta[f"{split}_shards"]
        assert [s["file"] for s in shards] == [f"{split}-000000.bin"] and shards[0]["tokens"] == len(ids)
        assert (out / shards[0]["file"]).stat().st_size == 2 * meta[f"{split}_tokens"] == 2 * len(ids)
        assert int((ids == meta["eot_token_id"]).sum()) == meta[f"{split}_documents"]
        assert ids.max() < meta["vocab_size"]
        assert hashlib.sha256(split_bytes(out, split, meta)).hexdigest() == meta[f"{split}_sha256"] == shards[0]["sha256"]
    # byte-level BPE round-trips exactly; documents are in the shuffled order of their places in the source
    train_texts = [texts[k] for k in sorted(texts) if k.startswith("train/")]
    assert decode_docs(out, "train", meta) == shuffled(train_texts) != train_texts
    assert decode_docs(out, "val", meta) == [texts[k] for k in texts if k.startswith("val/")]
    assert not list(out.parent.glob("books.tmp-*")) and not list(out.parent.glob("books.old-*"))


def test_identity_stable_and_input_changes_rebuild(books, built, tmp_path, capsys):
    src0, _ = books
    src = tmp_path / "src"
    shutil.copytree(src0, src)
    out = tmp_path / "cache"
    first = prepare(src, out, vocab_size=VOCAB, num_proc=1)
    assert first["cache_identity"] == built[1]["cache_identity"]  # same inputs elsewhere: same bytes
    mtime = (out / "train-000000.bin").stat().st_mtime_ns
    capsys.readouterr()
    again = prepare(src, out, vocab_size=VOCAB, num_proc=1)
    assert again == first and (out / "train-000000.bin").stat().st_mtime_ns == mtime
    assert "is up to date" in capsys.readouterr().out

    other = prepare(src, out, vocab_size=VOCAB + 64, num_proc=1)
    assert other["inputs_identity"] != first["inputs_identity"]
    assert other["cache_identity"] != first["cache_identity"] and other["vocab_size"] == VOCAB + 64
    assert json.loads((out / "meta.json").read_text()) == other

    book = next((src / "train").glob("*.txt"))
    book.write_text(book.read_text() + "\nOne more line at the end.\n")
    edited = prepare(src, out, vocab_size=VOCAB, num_proc=1)
    assert edited["source_sha256"] != first["source_sha256"]
    assert edited["inputs_identity"] != first["inputs_identity"]
    assert edited["train_sha256"] != first["train_sha256"] and edited["train_tokens"] > first["train_tokens"]
    assert (out / "train-000000.bin").stat().st_mtime_ns != mtime
    assert not list(tmp_path.glob("cache.tmp-*")) and not list(tmp_path.glob("cache.old-*"))


def in_val(text, fraction):
    """The documented held-out rule: first 8 bytes of sha256(text) as an integer / 2**64 < fraction."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64 < fraction


def test_held_out_split_is_by_whole_document(books, tmp_path):
    _, texts = books
    text = next(iter(texts.values()))
    docs = [f"Document {i}.\n" + text[i * 1500:(i + 1) * 1500] for i in range(40)]
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, d in enumerate(docs):
        (flat / f"doc{i:02d}.txt").write_text(d)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))

    meta = prepare(flat, tmp_path / "c-txt", vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    assert meta["split_rule"] == "held-out fraction 0.2 by document sha256"
    val = decode_docs(tmp_path / "c-txt", "val", meta)
    train = decode_docs(tmp_path / "c-txt", "train", meta)
    assert sorted(val) == sorted(d for d in docs if in_val(d, 0.2)) and 0 < len(val) < 40  # whole, the rule's ones
    assert sorted(train) == sorted(d for d in docs if not in_val(d, 0.2))
    assert not set(val) & set(train) and meta["val_documents"] + meta["train_documents"] == 40

    # the same documents as jsonl rows split and tokenize identically; a rerun elsewhere gives the same cache
    meta_jsonl = prepare(tmp_path / "docs.jsonl", tmp_path / "c-jsonl", vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    assert (meta_jsonl["train_sha256"], meta_jsonl["val_sha256"]) == (meta["train_sha256"], meta["val_sha256"])
    again = prepare(flat, tmp_path / "c-txt-2", vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    assert again["cache_identity"] == meta["cache_identity"]


def test_tiny_corpus_still_gets_a_val_document(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"d{i}.txt").write_text(f"Short document number {i}, with a few words in it.")
    meta = prepare(tmp_path / "src", tmp_path / "cache", vocab_size=300, val_fraction=0.001, num_proc=1)
    assert meta["val_documents"] == 1 and meta["train_documents"] == 2


def test_the_tiny_corpus_fallback_moves_a_document_with_its_copies(tmp_path):
    """The fallback moved one document to val and left its identical copy in train: val text seen in training."""
    (tmp_path / "src").mkdir()
    texts = [f"Short document number {i}, with a few words in it." for i in range(3)]
    # the copy is of the document the fallback picks: the smallest hash
    first = min(texts, key=lambda t: hashlib.sha256(t.encode()).digest()[:8])
    for i, text in enumerate(texts + [first]):
        (tmp_path / "src" / f"d{i}.txt").write_text(text)
    meta = prepare(tmp_path / "src", tmp_path / "cache", vocab_size=300, val_fraction=0.001, num_proc=1)
    val, train = (decode_docs(tmp_path / "cache", k, meta) for k in ("val", "train"))
    assert val == [first, first] and sorted(train) == sorted(t for t in texts if t != first)


def test_compressed_parquet_is_refused_in_one_line(tmp_path):
    """datasets reads parquet by its footer; a .parquet.gz failed deep inside with 'magic bytes not found'."""
    (tmp_path / "rows.parquet.gz").write_bytes(b"")
    with pytest.raises(PrepareError, match=r"rows.parquet.gz.*unsupported.*\.parquet$"):
        prepare(tmp_path / "rows.parquet.gz", tmp_path / "cache", vocab_size=300, num_proc=1)


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "data" / "prepare.py"), *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


KILLED = 97


def killed_after(monkeypatch, module, name, when, *args, **kwargs):
    """Exit code of prepare(*args, **kwargs) run in a forked process that dies (os._exit(KILLED): no finally, no
    cleanup, as when killed) right after module.<name> returns for arguments that `when` accepts. The code is its
    own, so an ordinary error (exit code 1) is not taken for the kill."""
    real = getattr(module, name)

    def then_die(*a, **k):
        result = real(*a, **k)
        if when(*a, **k):
            os._exit(KILLED)
        return result
    with monkeypatch.context() as patch:
        patch.setattr(module, name, then_die)
        child = multiprocessing.get_context("fork").Process(target=prepare, args=args, kwargs=kwargs)
        child.start()
        child.join(120)
    return child.exitcode


def test_killed_run_leaves_old_cache_or_none(books, tmp_path, monkeypatch):
    src, _ = books
    out = tmp_path / "cache"
    after_shards = (parts, "write_splits", lambda *a, **k: True)  # the shards written, meta.json not yet
    # no previous cache: a run killed after writing the shards leaves no DIR (only a tmp folder)
    assert killed_after(monkeypatch, *after_shards, src, out, vocab_size=VOCAB, num_proc=1) == KILLED
    assert not out.exists() and list(tmp_path.glob("cache.tmp-*"))
    meta = prepare(src, out, vocab_size=VOCAB, num_proc=1)  # the next run succeeds and removes the leftover
    assert not list(tmp_path.glob("cache.tmp-*"))
    meta_text, mtime = (out / "meta.json").read_text(), (out / "train-000000.bin").stat().st_mtime_ns

    # a previous cache: killed mid-build of other inputs, the old cache is untouched
    assert killed_after(monkeypatch, *after_shards, src, out, vocab_size=VOCAB + 64, num_proc=1) == KILLED
    assert (out / "meta.json").read_text() == meta_text
    # killed between moving the old cache aside and moving the new one in: the next run puts the old one back
    assert killed_after(monkeypatch, sources, "move_aside", lambda out: True, src, out, vocab_size=VOCAB + 64, num_proc=1) == KILLED
    assert not out.exists() and list(tmp_path.glob("cache.old-*"))
    assert prepare(src, out, vocab_size=VOCAB, num_proc=1) == meta  # recovered, up to date, no work done
    assert (out / "meta.json").read_text() == meta_text and (out / "train-000000.bin").stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob("cache.tmp-*")) and not list(tmp_path.glob("cache.old-*"))


def test_a_users_folders_named_like_prepares_leftovers_are_left_alone(books, tmp_path):
    """DIR.old-2024 and DIR.old-1 (a user's notes, a user's backup of the cache) were taken for prepare's old copies:
    deleted by an up-to-date run, or the backup renamed over DIR. Only a folder that prepare marked is its own."""
    src, _ = books
    out = tmp_path / "cache"
    prepare(src, out, vocab_size=VOCAB, num_proc=1)
    notes, backup, build = tmp_path / "cache.old-2024", tmp_path / "cache.old-1", tmp_path / "cache.tmp-7"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    shutil.copytree(out, backup)
    build.mkdir()
    meta = prepare(src, out, vocab_size=VOCAB, num_proc=1)  # up to date
    shutil.rmtree(out)
    again = prepare(src, out, vocab_size=VOCAB, num_proc=1)  # built again, not the backup renamed back
    assert again["cache_identity"] == meta["cache_identity"]
    assert (notes / "notes.txt").read_text() == "mine" and (backup / "meta.json").is_file() and build.is_dir()
    assert not (out / sources.ASIDE_MARK).exists()


def blank_corpus(tmp_path):
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("   \n\n")
    (tmp_path / "blank" / "b.txt").write_text("\t\n")
    return tmp_path / "blank"


def jsonl_without_text(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"body": "hello"}\n{"body": "world"}\n')
    return tmp_path / "rows.jsonl"


def csv_file(tmp_path):
    (tmp_path / "table.csv").write_text("text\nhello\n")
    return tmp_path / "table.csv"


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing", ["missing", "does not exist"]),
    (lambda d: str(d / "nothing-*.txt"), ["nothing-*.txt", "matches no file"]),
    (blank_corpus, ["blank", "no documents with text"]),
    (csv_file, ["table.csv", "unsupported", ".jsonl"]),
    (jsonl_without_text, ["rows.jsonl", "no 'text' column", "body"]),
])
def test_bad_input_is_one_clear_error_and_touches_nothing(tmp_path, make, words):
    src = make(tmp_path)
    out = tmp_path / "cache"
    out.mkdir()
    old = json.dumps({"format": 2, "tokenizer": "test", "vocab_size": VOCAB, "dtype": "uint16", "eot_token_id": 0})
    (out / "meta.json").write_text(old)  # an existing cache (prepare's meta.json) that must survive the error
    with pytest.raises(PrepareError) as e:
        prepare(src, out, vocab_size=VOCAB, num_proc=1)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert os.listdir(out) == ["meta.json"] and (out / "meta.json").read_text() == old
    assert not list(tmp_path.glob("cache.tmp-*")) and not list(tmp_path.glob("cache.old-*"))


def test_out_under_a_file_is_one_clear_error_before_any_work(tmp_path, books, capsys):
    """The folder for --out was made after the tokenizer was trained, and a failure was a traceback."""
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", str(books[0]), "--out", str(tmp_path / "afile" / "cache"), "--vocab_size", "300"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "afile" in err[0] and "cannot be made" in err[0], err


def test_an_out_where_no_lock_can_be_made_is_one_clear_error_not_a_hang(tmp_path, books, capsys):
    """filelock retries a lock file it cannot create for ever: prepare sat silent under /proc."""
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", str(books[0]), "--out", "/proc/tiny-llm-cache", "--vocab_size", "300"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out /proc/tiny-llm-cache: cannot write there" in err[0], err


def test_zst_files_without_zstandard_are_one_clear_error(tmp_path, monkeypatch):
    """datasets reads .zst through the zstandard package; without it the error would come from deep inside."""
    import importlib.util
    from data import prepare as prepare_module
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part-0.jsonl.zst").write_bytes(b"")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else find_spec(name, *a))
    with pytest.raises(PrepareError, match=r"has \.zst files, which need the zstandard package \(pip install zstandard\)"):
        prepare_module.find_local(str(tmp_path / "src"))


def test_max_vocab_and_hub_errors(books, built, monkeypatch):
    out, _ = built
    with pytest.raises(PrepareError, match=f"has {VOCAB} tokens but the model's vocabulary holds 256"):
        prepare(books[0], out.parent / "x", vocab_size=VOCAB, max_vocab=256)
    assert prep.parse_hf("hf:HuggingFaceFW/fineweb-edu:sample-10BT@train") == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")
    assert prep.parse_hf("hf:roneneldan/TinyStories") == ("roneneldan/TinyStories", None, None)
    monkeypatch.setattr(prep, "hub_reachable", lambda: False)  # never touch the network from a test
    with pytest.raises(PrepareError, match="cannot reach the Hugging Face hub to load dataset 'roneneldan/TinyStories'"):
        prepare("hf:roneneldan/TinyStories", out.parent / "x")
    assert not (out.parent / "x").exists()


def test_hub_code_path_on_a_local_dataset_folder(tmp_path, monkeypatch):
    """hf:NAME runs datasets.load_dataset(NAME); a local folder as NAME exercises that path without a network."""
    hub = tmp_path / "hub"
    hub.mkdir()
    for split, n in (("train", 30), ("validation", 4)):
        rows = [{"text": f"{split} story {i}: once upon a time there was a fox. " * (i % 4 + 1), "id": i} for i in range(n)]
        (hub / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets
    monkeypatch.setattr(prep, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # not the user's cache
    meta = prepare(f"hf:{hub}", tmp_path / "c1", vocab_size=300, num_proc=1)
    assert meta["split_rule"] == "dataset split validation"
    assert (meta["train_documents"], meta["val_documents"]) == (30, 4)
    meta = prepare(f"hf:{hub}", tmp_path / "c2", vocab_size=300, num_proc=1, streaming=True, max_documents=10)
    assert (meta["train_documents"], meta["val_documents"]) == (10, 4)
    meta = prepare(f"hf:{hub}@validation", tmp_path / "c3", vocab_size=300, num_proc=1)  # no other split: held out
    assert meta["split_rule"].startswith("held-out") and meta["train_documents"] + meta["val_documents"] == 4


def test_cli_prints_one_error_line_and_exits_2(tmp_path):
    r = run_cli("--source", tmp_path / "no-such-corpus", "--out", tmp_path / "cache")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: ") and "no-such-corpus" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "cache").exists()


def test_out_that_holds_something_else_is_refused_and_kept(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "important.txt").write_text("keep")
    with pytest.raises(PrepareError, match="exists and is not a token cache"):
        prepare(src, precious, vocab_size=300, num_proc=1)
    assert (precious / "important.txt").read_text() == "keep" and os.listdir(precious) == ["important.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare(src, empty, vocab_size=300, num_proc=1)["train_tokens"] > 0  # an empty folder is fine


def test_out_with_a_meta_json_of_its_own_is_refused_and_kept(tmp_path, capsys):
    """Any meta.json passed for a cache, and prepare replaced the folder whole: results.csv was deleted."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    (tmp_path / "userdir").mkdir()
    files = {"meta.json": '{"note": 1}\n', "results.csv": "precious\n"}  # a meta.json of its own, not prepare's
    for name, text in files.items():
        (tmp_path / "userdir" / name).write_text(text)
    err = cli_error(capsys, "--source", src, "--out", tmp_path / "userdir", "--vocab_size", 300, "--val_fraction", 0.3,
                    "--num_proc", 1)
    assert f"--out {str(tmp_path / 'userdir')!r} exists and is not a token cache; give a new folder" in err, err
    assert {f.name: f.read_text() for f in (tmp_path / "userdir").iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "userdir"]  # no build, lock or old copy beside it


def test_a_tokenizer_that_cannot_be_loaded_is_an_error_not_a_substitute(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "hub_reachable", lambda: False)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the fox jumps over the dog. " * 50)
    with pytest.raises(PrepareError, match="could not load tokenizer 'gpt2-typo'.*leave --tokenizer out"):
        prepare(src, tmp_path / "out", tokenizer="gpt2-typo", num_proc=1)
    assert not (tmp_path / "out").exists()


def test_the_loader_reads_what_prepare_wrote(built):
    """The two halves of the cache format agree: TokenCache verifies and maps a cache that prepare() wrote."""
    from data.loader import TokenCache
    out, meta = built
    cache = TokenCache(out)
    assert cache.identity == meta["cache_identity"] and cache.vocab_size == meta["vocab_size"]
    assert len(cache.train) == meta["train_tokens"] and len(cache.val) == meta["val_tokens"]
    assert np.array_equal(np.asarray(cache.train), load_bin(out, "train", meta))


def cli_error(capsys, *args):
    """The CLI's stderr for a run that must fail: one line, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        prepare_main([str(a) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", ["notes.txt", "notes.txt.gz"])
def test_a_txt_that_is_not_utf8_names_the_file_and_the_byte_offset(tmp_path, capsys, name):
    """datasets' own error names neither: "An error occurred while generating the dataset"."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text("A first document, in plain UTF-8: caf\u00e9.")
    data = "Caf\u00e9 au lait, na\u00efve. ".encode() + b"r\xe9sum\xe9 in Latin-1"  # 0xe9 alone is not UTF-8
    with (gzip.open if name.endswith(".gz") else open)(src / name, "wb") as f:
        f.write(data)
    err = cli_error(capsys, "--source", src, "--out", tmp_path / "cache", "--vocab_size", 300, "--num_proc", 1)
    offset = data.index(b"\xe9")
    assert f"{src / name}" in err and f"offset {offset}" in err and "0xe9" in err and "must be UTF-8" in err, err
    assert not (tmp_path / "cache").exists()


def write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": texts}), path)


@pytest.mark.parametrize("files, bad, where, found", [
    ({"rows.jsonl": ['{"text": "one"}', '', '{"text": "two"}', '{"text": 42}']}, "rows.jsonl", "line 4", "a number"),
    ({"rows.jsonl": ['{"text": 1}', '{"text": 2}']}, "rows.jsonl", "line 1", "a number"),  # a column of numbers
    ({"a.jsonl": ['{"text": "one"}'], "b.jsonl": ['{"text": ["x", "y"]}']}, "b.jsonl", "line 1", "an array"),
    ({"rows.json": ['[{"text": "one"}, {"text": {"p": 1}}]']}, "rows.json", "row 2", "an object"),
    ({"rows.parquet": [None, 7]}, "rows.parquet", "row 2", "of type int64"),
])
def test_a_text_that_is_not_a_string_names_the_file_the_row_and_the_type(tmp_path, capsys, files, bad, where, found):
    """Such a row would otherwise reach the document scan, which takes strings only, as a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    for name, rows in files.items():
        if name.endswith(".parquet"):
            write_parquet(src / name, rows)
        else:
            (src / name).write_text("\n".join(rows) + "\n")
    err = cli_error(capsys, "--source", src, "--out", tmp_path / "cache", "--vocab_size", 300, "--num_proc", 1)
    assert f"{src / bad}' {where} has a 'text' that is {found}, not a string" in err, err


@pytest.mark.parametrize("files, bad, problem", [
    # one file of other columns beside files with a 'text': datasets cannot join them ("An error occurred ...")
    ({"a.jsonl": ['{"text": "one"}'], "b.jsonl": ['{"content": "two", "id": 2}']}, "b.jsonl",
     "line 1 has no 'text' (its keys: content, id)"),
    ({"rows.jsonl": ['"first doc"', '"second doc"']}, "rows.jsonl", "line 1 is a string, not an object"),
    # a row without 'text' is an empty document: the row that breaks the file is named, not that one
    ({"rows.jsonl": ['{"text": "one"}'] * 3 + ['{"meta": 1}'] + ['{"text": "two"}'] * 11 + ['{"text": {"a": 1}}']
      + ['{"text": "three"}'] * 4}, "rows.jsonl", "line 16 has a 'text' that is an object, not a string"),
])
def test_a_row_that_is_no_document_names_the_file_and_the_row(tmp_path, capsys, files, bad, problem):
    """Each was datasets' first line only, naming neither the file nor the problem."""
    src = tmp_path / "src"
    src.mkdir()
    for name, rows in files.items():
        (src / name).write_text("\n".join(rows) + "\n")
    for streaming in ([], ["--streaming"]):
        err = cli_error(capsys, "--source", src, "--out", tmp_path / "cache", "--vocab_size", 300, "--num_proc", 1,
                        *streaming)
        assert f"{src / bad}' {problem}; each document must be an object" in err, err


def test_a_line_that_is_not_json_is_named(tmp_path, capsys):
    """datasets' own error says only that the dataset could not be generated."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "rows.jsonl").write_text('{"text": "one"}\n{"text": "two"}\nnot json\n')
    err = cli_error(capsys, "--source", src, "--out", tmp_path / "cache", "--vocab_size", 300, "--num_proc", 1)
    assert f"{src / 'rows.jsonl'}' line 3 is not JSON" in err and err.count("\n") == 1, err


def test_a_json_document_over_several_lines_is_not_taken_for_a_line_that_is_not_json(tmp_path, capsys):
    """A pretty-printed .json (which datasets reads whole) whose 'text' is not strings: the column's type is what is
    wrong, not its first line."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "rows.json").write_text('{\n  "text": [1, 2, 3]\n}\n')
    err = cli_error(capsys, "--source", src, "--out", tmp_path / "cache", "--vocab_size", 300, "--num_proc", 1)
    assert "holds List(Value('int64')), not strings" in err and "not JSON" not in err, err


def test_a_null_text_is_an_empty_document(tmp_path):
    rows = [{"text": "the fox jumps over the dog."}, {"text": None}, {"text": "a dog sleeps."}, {"text": "cats."}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare(tmp_path / "rows.jsonl", tmp_path / "cache", vocab_size=300, num_proc=1)
    assert meta["train_documents"] + meta["val_documents"] == 3


def test_a_hub_text_that_is_not_a_string_is_one_clear_error(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "train.jsonl").write_text("".join(json.dumps({"text": i}) + "\n" for i in range(5)))
    import datasets
    monkeypatch.setattr(prep, "hub_reachable", lambda: True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")  # not the user's cache
    with pytest.raises(PrepareError, match=r"'text' column of the Hugging Face dataset's train split holds "
                                           r"Value\('int64'\), not strings"):
        prepare(f"hf:{hub}", tmp_path / "c1", vocab_size=300, num_proc=1)
    with pytest.raises(PrepareError, match="row 1 of the Hugging Face dataset's train split has a 'text' that is "
                                           "a number, not a string"):
        prepare(f"hf:{hub}", tmp_path / "c2", vocab_size=300, num_proc=1, streaming=True)


def test_a_bpe_that_stops_short_of_vocab_size_says_so_and_meta_records_both(tmp_path, capsys):
    """A BPE asked for 70,000 tokens of a small corpus runs out of pairs to merge long before."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog. " * 5)
    prepare_main(["--source", str(src), "--out", str(tmp_path / "cache"), "--vocab_size", "70000", "--num_proc", "1"])
    meta = json.loads((tmp_path / "cache" / "meta.json").read_text())
    from transformers import AutoTokenizer
    reached = len(AutoTokenizer.from_pretrained(tmp_path / "cache"))
    assert meta["vocab_size"] == reached < 70000 and meta["vocab_size_requested"] == 70000
    assert meta["dtype"] == "uint16"  # what the BPE reached decides, not what was asked
    notes = [line for line in capsys.readouterr().out.splitlines() if "70,000" in line]
    assert len(notes) == 1 and f"stopped at {reached:,} tokens" in notes[0], notes


def test_a_vocabulary_over_65536_tokens_is_stored_as_uint32_and_read_back(tmp_path):
    """Token ids above 65,535 do not fit uint16: prepare writes uint32 and the loader reads the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from data.loader import TokenCache, TrainData
    vocab = {prep.EOT: 0, **{f"w{i}": i for i in range(1, 70_000)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token=prep.EOT))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token=prep.EOT).save_pretrained(tmp_path / "tok")
    src = tmp_path / "src"
    src.mkdir()
    docs = {f"d{d}.txt": [65_530 + 100 * d + i for i in range(20)] for d in range(4)}  # ids across 65,535
    for name, ids in docs.items():
        (src / name).write_text(" ".join(f"w{i}" for i in ids))
    meta = prepare(src, tmp_path / "cache", tokenizer=str(tmp_path / "tok"), num_proc=1)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000 and meta["vocab_size_requested"] is None
    cache = TokenCache(tmp_path / "cache")  # verifies sizes, hashes and the id range
    assert (tmp_path / "cache" / "train-000000.bin").stat().st_size == 4 * meta["train_tokens"]
    tokens = np.asarray(cache.train).tolist() + np.asarray(cache.val).tolist()
    assert sorted(tokens) == sorted([i for ids in docs.values() for i in ids] + [0] * len(docs))
    (x, y), = TrainData(cache.train, seq_len=8, sequences_per_update=1, seed=0).batches_of(np.array([0]), 1)[0]
    assert x[0].tolist() == np.asarray(cache.train[:8]).tolist() and max(cache.train[:9]) > 65_535


def test_a_local_source_shows_its_own_progress_and_no_download(tmp_path, capfd):
    """datasets labels its reading of 16 or more local files "Downloading data"."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"d{i:02d}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog. " * 5)
    prepare(src, tmp_path / "cache", vocab_size=300, num_proc=1)
    out, err = capfd.readouterr()
    assert "Downloading" not in out + err and "Generating" not in out + err, out + err
    assert "reading 20 files" in out and "tokenize" in err  # our line, and our bar


def process_state(pid):
    """(state letter, parent pid) of a process from /proc, or (None, None) when it is gone."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None, None
    return after_name[0], int(after_name[1])


def alive(pid):
    return process_state(pid)[0] not in (None, "Z", "X")  # a zombie has ended; only its exit status is left


def descendants(pid):
    found, parents = set(), {pid}
    while parents:
        children = {int(p.name) for p in Path("/proc").glob("[0-9]*") if process_state(p.name)[1] in parents}
        parents = {c for c in children if alive(c)} - found
        found |= parents
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_tokenizing_workers_and_removes_the_partial_build(built, tmp_path, signum):
    """Stopped with SIGTERM, prepare died alone: its workers tokenized on, each through its whole shard (~2 GB)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):  # ~6 MB: each of the 2 workers tokenizes for well over the 5 s this test waits
        (src / f"d{i:02d}.txt").write_text(" ".join(f"word{(i * 7919 + j) % 5003} and {j}" for j in range(7000)))
    out = tmp_path / "cache"
    run = subprocess.Popen([sys.executable, str(ROOT / "data" / "prepare.py"), "--source", str(src), "--out", str(out),
                            "--tokenizer", str(built[0]), "--num_proc", "2"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers, deadline = set(), time.time() + 90
    while len(workers) < 2 and run.poll() is None and time.time() < deadline:
        if list(tmp_path.glob("cache.tmp-*/tokenizer.json")):  # saved just before the tokenizing pool starts
            workers = descendants(run.pid)
        time.sleep(0.02)
    assert len(workers) >= 2, f"no tokenizing workers seen; exit code {run.poll()}"
    time.sleep(0.5)
    workers |= descendants(run.pid)  # the pool's workers and the process that collects their progress
    run.send_signal(signum)
    deadline = time.time() + 5
    while (run.poll() is None or any(map(alive, workers))) and time.time() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    for pid in left + ([run.pid] if run.poll() is None else []):
        os.kill(pid, signal.SIGKILL)
    err = run.communicate(timeout=30)[1]
    assert not left, f"{len(left)} of {len(workers)} workers outlived prepare"
    assert run.returncode == 128 + signum and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == f"error: stopped by {signal.Signals(signum).name}; the unfinished build was removed"
    assert not out.exists() and not list(tmp_path.glob("cache.tmp-*"))


def test_a_long_run_without_whitespace_is_noted_and_trained_in_pieces(tmp_path, capsys):
    """BPE training time grows with the square of such a run: a million characters took minutes, silently."""
    import random
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(0)
    run = "".join(rng.choice("ACGT") for _ in range(prep.LONG_RUN * 2 + 345))
    # each longer than LONG_RUN, so that the prose alone (below) passes long_runs' length check and is searched
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog. " * 200 for i in range(4)]
    assert min(map(len, texts)) > prep.LONG_RUN
    texts[2] += f"sequence {run} ends here."
    for i, text in enumerate(texts):
        (src / f"d{i}.txt").write_text(text)
    meta = prepare(src, tmp_path / "cache", vocab_size=300, val_fraction=0.001, num_proc=1)
    notes = [line for line in capsys.readouterr().out.splitlines() if "run of" in line]
    assert len(notes) == 1 and f"holds a run of {len(run):,} characters without whitespace" in notes[0], notes
    assert f"in pieces of {prep.LONG_RUN:,}" in notes[0]
    # the tokenizer still encodes the run whole: the cache decodes back to the documents
    docs = decode_docs(tmp_path / "cache", "train", meta) + decode_docs(tmp_path / "cache", "val", meta)
    assert sorted(docs) == sorted(texts)
    # what the trainer sees: the same text, no piece of the run longer than LONG_RUN
    batches = list(prep.bpe_training_texts([texts[:2], texts[2:]]))
    pieces = [p for batch in batches for p in batch]
    assert "".join(pieces) == "".join(texts) and max(map(len, pieces)) <= len(texts[2]) - len(run) + prep.LONG_RUN
    assert max(len(p) for p in pieces if set(p) <= set("ACGT")) <= prep.LONG_RUN

    capsys.readouterr()
    for i in (2, 3):
        (src / f"d{i}.txt").unlink()
    prepare(src, tmp_path / "plain", vocab_size=300, num_proc=1)  # prose alone: no note
    assert "run of" not in capsys.readouterr().out


def documents_drawn_below(fraction, n):
    """n different short texts whose held-out draws all fall below `fraction` (all go to val)."""
    texts = (f"Short document number {i}, with a few words in it." for i in itertools.count())
    return list(itertools.islice((t for t in texts if in_val(t, fraction)), n))


@pytest.mark.parametrize("texts, words", [
    (documents_drawn_below(0.5, 2), ["train split", "all 2 documents with text drew a held-out hash below "
                                     "--val_fraction 0.5", "at least 1 document on each side", "give a --val_fraction of at most 0."]),
    (["One document alone."], ["holds 1 document with text", "at least 2 different documents, 1 for train and 1 for val"]),
    (["The same text.", "The same text."], ["holds 2 documents with text, all copies of one text,", "2 different"]),
])
def test_an_empty_split_says_what_the_inputs_lack(tmp_path, capsys, texts, words):
    """2 different documents at --val_fraction 0.5 were told to "give at least 2 different documents"."""
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(texts):
        (src / f"d{i}.txt").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--source", str(src), "--out", str(tmp_path / "cache"), "--vocab_size", "300", "--num_proc", "1",
                      "--val_fraction", "0.5"])
    err = capsys.readouterr().err  # the scan's progress bar, then the error
    assert exit_info.value.code == 2 and "Traceback" not in err and err.count("error: ") == 1, err
    error = err.splitlines()[-1]
    assert error.startswith("error: ") and all(w in error for w in words), error
    assert not (tmp_path / "cache").exists()


def test_a_cache_whose_meta_disagrees_with_its_tokenizer_must_be_prepared_again(books, built, tmp_path):
    """An edited meta.json vocab_size led train.py to advise a vocab_size past the tokenizer's size."""
    from data.loader import CacheError, TokenCache
    out, meta = built
    cache = tmp_path / "cache"
    shutil.copytree(out, cache)
    edited = dict(meta, vocab_size=VOCAB + 88)
    (cache / "meta.json").write_text(json.dumps(edited))
    with pytest.raises(CacheError) as e:
        TokenCache(cache)
    message = str(e.value)
    assert f"says vocab_size {VOCAB + 88} but the cache's tokenizer has {VOCAB} tokens" in message, message
    assert "meta.json disagrees with its tokenizer" in message and "prepare the cache again" in message
    assert "\n" not in message
    # and preparing it again does rebuild it: the edited cache is not taken as up to date
    assert prepare(books[0], cache, vocab_size=VOCAB, num_proc=1)["vocab_size"] == VOCAB
    assert TokenCache(cache).vocab_size == VOCAB


@pytest.mark.parametrize("flag, value, words", [("--vocab_size", "0", "--vocab_size 0 is too small"),
                                                 ("--num_proc", "0", "--num_proc 0 must be at least 1")])
def test_a_zero_on_the_command_line_is_refused_not_taken_for_the_default(tmp_path, capsys, flag, value, words):
    """0 is a value given, not an option left out: before, --vocab_size 0 trained 32,000 tokens and --num_proc 0
    used every core, silently."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the fox jumps over the dog. " * 50)
    with pytest.raises(SystemExit) as exit_:
        prep.main(["--source", str(src), "--out", str(tmp_path / "cache"), flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert not (tmp_path / "cache").exists()


def test_out_filled_during_the_build_is_kept_and_the_build_discarded(tmp_path, monkeypatch):
    """--out was checked before the build only: files a user put into the new folder while it was tokenized were
    deleted when the built cache was swapped in."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    out = tmp_path / "new"
    build = prep.build

    def meanwhile(*args, **kwargs):
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        return build(*args, **kwargs)
    monkeypatch.setattr(prep, "build", meanwhile)
    with pytest.raises(PrepareError, match="was filled with other files during the build; they are kept"):
        prepare(src, out, vocab_size=300, num_proc=1)
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "new.lock", "src"]  # the build removed


def test_a_source_folder_named_like_a_glob_is_that_folder(tmp_path):
    """An existing folder whose name holds [ ] was taken for a glob, which matched nothing."""
    src = tmp_path / "books [2024]"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    meta = prepare(src, tmp_path / "out", vocab_size=300, num_proc=1, val_fraction=0.5)
    assert meta["train_documents"] + meta["val_documents"] == 2


def test_documents_in_a_linked_folder_are_read_once(tmp_path):
    """os.walk skipped folders that are symbolic links (a ** glob follows them): their documents were dropped
    without a note; a link back up the tree is followed once, not forever."""
    elsewhere, src = tmp_path / "elsewhere", tmp_path / "src"
    elsewhere.mkdir()
    src.mkdir()
    for folder, names in ((src, ("a.txt", "b.txt")), (elsewhere, ("c.txt", "d.txt"))):
        for name in names:
            (folder / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    (src / "linked").symlink_to(elsewhere)
    (elsewhere / "loop").symlink_to(src)
    meta = prepare(src, tmp_path / "out", vocab_size=300, num_proc=1, val_fraction=0.5)
    assert meta["train_documents"] + meta["val_documents"] == 4


def test_an_out_that_is_a_link_is_built_at_its_target(tmp_path):
    """The build folder and the old copy went beside the link: a link to a folder not made yet failed at the
    rename, after all the tokenizing, in a traceback; a link to an empty folder was renamed aside for good."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    (tmp_path / "big").mkdir()
    for target in (tmp_path / "big" / "new", tmp_path / "big" / "empty"):
        if target.name == "empty":
            target.mkdir()
        link = tmp_path / f"link-{target.name}"
        link.symlink_to(target)
        assert prepare(src, link, vocab_size=300, num_proc=1)["train_tokens"] > 0
        assert link.is_symlink() and (target / "meta.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "link-empty", "link-new", "src"]


def test_a_tokenizer_whose_files_disagree_with_its_config_is_refused_before_tokenizing(tmp_path):
    """tokenizer_config.json naming an eos that tokenizer.json lacks: transformers adds it (one token more), the
    cache recorded that size, its own loader refused the cache, and every later prepare built it again."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.txt", "b.txt"):
        (src / name).write_text(f"{name}: the fox jumps over the dog. " * 50)
    prepare(src, tmp_path / "tok", vocab_size=300, num_proc=1)
    folder = tmp_path / "tokx"
    folder.mkdir()
    saved = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    saved["added_tokens"] = []  # no special token left in the file
    saved["model"]["vocab"].pop(prep.EOT, None)
    (folder / "tokenizer.json").write_text(json.dumps(saved))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "eos_token": "<eos>"}))
    with pytest.raises(PrepareError, match=r"tokenizer\.json holds \d+ tokens but loaded it has \d+"):
        prepare(src, tmp_path / "out", tokenizer=str(folder), num_proc=1)
    assert not (tmp_path / "out").exists()


def test_the_smallest_bpe_is_the_256_bytes_and_end_of_text(tmp_path):
    """A byte-level BPE holds every byte and <|endoftext|>: 257 tokens at least. 256 is refused before any work
    (else the cache held 257 tokens, one more than asked)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the fox jumps over the dog. " * 20)
    with pytest.raises(PrepareError, match="--vocab_size 256 is too small"):
        prepare(src, tmp_path / "small", vocab_size=256, num_proc=1)
    assert not (tmp_path / "small").exists()
    assert prep.tokenizer_identity(None, 257, None) == (None, "bpe-257-trained", 257, None)  # a BPE to train


def test_a_seed_salts_the_held_out_draw_and_a_new_seed_builds_the_cache_anew(books, built, tmp_path):
    """--seed N draws the held-out documents by sha256(b"N:" + text) (docs/DATA.md): another split, so another
    cache; preparing the same --out with another seed builds it again rather than finding it up to date."""
    _, texts = books
    text = next(iter(texts.values()))
    docs = [f"Document {i}.\n" + text[i * 1500:(i + 1) * 1500] for i in range(40)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    salted = lambda d: int.from_bytes(hashlib.sha256(b"5:" + d.encode()).digest()[:8], "big") / 2**64 < 0.2
    out, options = tmp_path / "cache", dict(tokenizer=str(built[0]), val_fraction=0.2, num_proc=1)
    plain = prepare(src, out, **options)
    seeded = prepare(src, out, seed=5, **options)
    assert plain["split_rule"] == "held-out fraction 0.2 by document sha256"
    assert seeded["split_rule"] == "held-out fraction 0.2 by document sha256 seed 5"
    assert seeded["inputs_identity"] != plain["inputs_identity"]
    val = sorted(decode_docs(out, "val", seeded))
    assert val == sorted(d for d in docs if salted(d)) != sorted(d for d in docs if in_val(d, 0.2))
    assert sorted(decode_docs(out, "train", seeded)) == sorted(d for d in docs if not salted(d))


def test_a_vocabulary_of_65537_tokens_is_the_smallest_stored_as_uint32(tmp_path):
    """uint16 holds ids 0 .. 65,535, so 65,536 tokens at most: a vocabulary of one more is stored as uint32, and its
    last id, 65,536, is read back as itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from data.loader import TokenCache
    size = 2**16 + 1
    vocab = {prep.EOT: 0, **{f"w{i}": i for i in range(1, size)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token=prep.EOT))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token=prep.EOT).save_pretrained(tmp_path / "tok")
    src = tmp_path / "src"
    src.mkdir()
    docs = [[size - 1, 1, size - 2], [size - 1] * 3, [5, size - 1]]
    for d, ids in enumerate(docs):
        (src / f"d{d}.txt").write_text(" ".join(f"w{i}" for i in ids))
    meta = prepare(src, tmp_path / "cache", tokenizer=str(tmp_path / "tok"), num_proc=1)
    assert meta["vocab_size"] == size and meta["dtype"] == "uint32"
    cache = TokenCache(tmp_path / "cache")
    tokens = np.asarray(cache.train).tolist() + np.asarray(cache.val).tolist()
    assert sorted(tokens) == sorted([i for ids in docs for i in ids] + [0] * len(docs))


def test_a_tokenizer_of_exactly_the_models_vocabulary_fits(built):
    """--max_vocab N (the model's vocabulary) takes a tokenizer of N tokens, ids 0 .. N-1, and refuses N + 1."""
    out, meta = built
    assert prep.tokenizer_identity(str(out), 0, meta["vocab_size"])[2] == meta["vocab_size"] == VOCAB
    assert prep.tokenizer_identity(None, VOCAB, VOCAB)[2] == VOCAB  # a BPE to train
    with pytest.raises(PrepareError, match=f"has {VOCAB} tokens but the model's vocabulary holds {VOCAB - 1};"):
        prep.tokenizer_identity(str(out), 0, VOCAB - 1)
    with pytest.raises(PrepareError, match=f"has {VOCAB} tokens but the model's vocabulary holds {VOCAB - 1};"):
        prep.tokenizer_identity(None, VOCAB, VOCAB - 1)


def test_a_run_of_long_run_characters_is_cut_every_long_run_from_its_start(monkeypatch, capsys):
    """Runs of LONG_RUN characters or more, all whitespace or none, reach the BPE trainer cut every LONG_RUN
    characters from the run's start (at 8 here, by hand), the text otherwise whole and in order."""
    monkeypatch.setattr(prep, "LONG_RUN", 8)
    assert prep.long_runs("x" * 8) == [(0, 8)] and prep.long_runs("x" * 7) == prep.long_runs("x" * 7 + " ") == []
    text = "ab " + "x" * 8 + " " + "y" * 7 + " " * 20 + "z" * 19
    assert prep.long_runs(text) == [(3, 11), (19, 39), (39, 58)]  # 8 x's, 20 spaces, 19 z's
    (pieces,) = prep.bpe_training_texts([[text]])
    assert pieces == [text[:27], text[27:35], text[35:47], text[47:55], text[55:]]  # the spaces at 27, 35, z's 47, 55
    assert "holds a run of 20 whitespace characters" in capsys.readouterr().out
    assert list(prep.bpe_training_texts([["x" * 8]])) == [["x" * 8]]  # a run of exactly LONG_RUN: no cut, a note
    assert "holds a run of 8 characters without whitespace" in capsys.readouterr().out


def test_a_literal_end_of_text_inside_a_document_is_text_not_a_boundary(built):
    """A document that quotes "<|endoftext|>" is still one document: one end-of-text token, after it, and its text
    decodes back whole (a web page about tokenizers, say)."""
    from transformers import AutoTokenizer
    out, meta = built
    tok = AutoTokenizer.from_pretrained(out)
    docs = [f"GPT-2 ends each document with {prep.EOT} between them.", f"{prep.EOT}", "plain"]
    eot = meta["eot_token_id"]
    ids = prep.encode_batch({"text": docs}, tok, eot)["ids"]
    assert [x.count(eot) for x in ids] == [1, 1, 1] and all(x[-1] == eot for x in ids)
    assert [tok.decode(x[:-1]) for x in ids] == docs
