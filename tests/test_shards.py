"""Sharded token caches (CPU, no network): the loader reads shards as it reads one file, a start checks them at
the cost of a stat, data/verify.py reads them whole, --shard jobs joined give one run's cache bit for bit, and the
documents are shuffled so that a prefix samples the whole corpus."""
import filecmp
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import write_cache
from data import shards, verify
from data.loader import IGNORE, CacheError, TokenCache, TrainData, eval_batch_count, eval_batches, recorded_identity
from data.prepare import PrepareError, join, prepare
from data.prepare import main as prepare_main

GUTENBERG = Path(__file__).resolve().parents[1] / "data" / "cache" / "gutenberg"


def write_sharded_cache(folder, train, val, vocab_size, shard_tokens):
    """A format-2 cache of these tokens, cut into shards of shard_tokens as data/prepare.py cuts them."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    meta = {"format": 2, "tokenizer": "test", "tokenizer_files_sha256": None, "source_sha256": "test",
            "split_rule": "test", "vocab_size": vocab_size, "dtype": "uint16", "eot_token_id": 0}
    for split, tokens in (("train", train), ("val", val)):
        writer = shards.ShardWriter(folder, split, "uint16", shard_tokens)
        for piece in np.array_split(np.asarray(tokens), 7):  # written in pieces that do not line up with the shards
            writer.write(piece)
        meta.update(writer.close())
    meta["cache_identity"] = recorded_identity(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_a_sharded_cache_gives_the_sequences_of_a_one_file_cache_of_the_same_tokens(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 256, 5_000), rng.integers(0, 256, 700)
    one = TokenCache(write_cache(tmp_path / "one", train, val, 256))
    sharded = TokenCache(write_sharded_cache(tmp_path / "sharded", train, val, 256, shard_tokens=997))
    assert len(sharded.shards["train"]) == 6 and [t for _, t, _ in sharded.shards["train"]] == [997] * 5 + [15]
    assert sharded.meta["train_sha256"] == one.meta["train_sha256"]  # the stream's hash: the one file's
    assert isinstance(sharded.train, shards.ShardedTokens) and len(sharded.train) == len(train)
    assert np.array_equal(np.asarray(sharded.train), train) and sharded.train[996] == train[996]
    assert np.array_equal(sharded.train[990:2000], train[990:2000])  # across a boundary, and within one shard:
    assert isinstance(sharded.train[10:20], np.memmap)  # a shard's own memmap, no copy
    for subset in (0, 3_000):  # all of it, and a subset that ends inside a shard
        a, b = (TrainData(c.train, 32, 12, seed=7, subset_tokens=subset) for c in (one, sharded))
        assert a.updates_per_epoch == b.updates_per_epoch and a.n_sequences == b.n_sequences
        for epoch in (0, 1):
            for update in range(a.updates_per_epoch):
                for rank in (0, 1):
                    (xa, ya), (xb, yb) = (d.micro_batches(epoch, update, 4, rank, 2) for d in (a, b))
                    assert ya == yb and all(x.equal(y) for pa, pb in zip(xa, xb) for x, y in zip(pa, pb))
    for (xa, ya), (xb, yb) in zip(eval_batches(one.val, 32, 8), eval_batches(sharded.val, 32, 8), strict=True):
        assert xa.equal(xb) and ya.equal(yb)


def test_the_old_one_file_cache_loads_with_its_identity():
    """The recorded results name data/cache/gutenberg by this identity: a format-1 cache, one train.bin."""
    if not (GUTENBERG / "meta.json").is_file():
        pytest.skip("no data/cache/gutenberg here")
    if json.loads((GUTENBERG / "meta.json").read_text()).get("format", 1) != 1:
        pytest.skip("data/cache/gutenberg here was prepared anew (shuffled, format 2), not the source-order cache")
    cache = TokenCache(GUTENBERG)
    assert cache.identity.startswith("620df27f") and cache.meta["format"] == 1
    assert isinstance(cache.train, np.memmap) and len(cache.train) == cache.meta["train_tokens"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 JSON-lines documents, sorted as a corpus by author is (document i speaks of topic i // 15), and a
    tokenizer for them (a trained BPE's cache folder)."""
    root = tmp_path_factory.mktemp("corpus")
    words = ["river", "castle", "engine", "garden"]
    rows = [{"text": f"Document {i} of {words[i // 15]}: " + " ".join(f"{words[i // 15]} {j * i % 97}"
                                                                      for j in range(40 + i)), "id": i}
            for i in range(60)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(root / "docs.jsonl", root / "tok", vocab_size=300, num_proc=1, val_fraction=0.1)
    return root / "docs.jsonl", root / "tok", [r["text"] for r in rows]


def documents(folder, split="train"):
    from transformers import AutoTokenizer
    cache, tok = TokenCache(folder), AutoTokenizer.from_pretrained(folder)
    ids = np.asarray(getattr(cache, split))
    ends = np.flatnonzero(ids == cache.meta["eot_token_id"])
    return [tok.decode(d[:-1].tolist()) for d in np.split(ids, ends + 1)[:-1]]


def test_shard_jobs_joined_are_one_runs_cache_bit_for_bit(corpus, tmp_path, capsys):
    src, tok, _ = corpus
    options = dict(tokenizer=str(tok), val_fraction=0.1, shard_tokens=1_000)
    one = prepare(src, tmp_path / "one", num_proc=2, **options)
    assert len(one["train_shards"]) > 3 and one["train_tokens"] % 1_000  # documents run on across shards
    for i in (2, 0, 1):  # in any order, as a Slurm array runs them
        prepare(src, tmp_path / "joined", num_proc=1, part=(i, 3), **options)
    prepare(src, tmp_path / "x", num_proc=1, part=(0, 4), **options)  # a part of another split of the work
    shutil.move(tmp_path / "x.part-0-of-4", tmp_path / "joined.part-0-of-4")
    with pytest.raises(PrepareError, match="parts of 3 and of 4 jobs"):
        join(tmp_path / "joined")
    shutil.rmtree(tmp_path / "joined.part-0-of-4")
    prepare_main(["--out", str(tmp_path / "joined"), "--join"])
    a, b = tmp_path / "one", tmp_path / "joined"
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) > 6
    assert all(filecmp.cmp(a / n, b / n, shallow=False) for n in names if n != "meta.json")
    timing = ("created", "seconds")
    joined = json.loads((b / "meta.json").read_text())
    assert {k: v for k, v in joined.items() if k not in timing} == {k: v for k, v in one.items() if k not in timing}
    assert not list(tmp_path.glob("joined.part-*"))  # the parts are removed once the cache is in place
    with pytest.raises(PrepareError, match="found no parts"):
        join(tmp_path / "joined")


def test_a_missing_part_or_a_bad_shard_option_is_one_clear_error(corpus, tmp_path, capsys):
    src, tok, _ = corpus
    prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(1, 3))
    # a user's copy of a part is no part: --join would have joined it and then removed it
    (tmp_path / "c.part-1-of-3").rename(tmp_path / "c.part-1-of-3.bak")
    with pytest.raises(PrepareError, match="found no parts"):
        join(tmp_path / "c")
    (tmp_path / "c.part-1-of-3.bak").rename(tmp_path / "c.part-1-of-3")
    with pytest.raises(PrepareError, match=r"2 of the 3 parts are missing \(0/3, 2/3\); run those --shard jobs"):
        join(tmp_path / "c")
    for i in (0, 2):
        prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(i, 3))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("keep")
    with pytest.raises(PrepareError, match="exists and is not a token cache"):  # the join would replace it whole
        join(tmp_path / "c")
    assert os.listdir(tmp_path / "c") == ["notes.txt"]
    (tmp_path / "c" / "meta.json").write_text('{"note": 1}')  # a meta.json of its own makes it no cache
    with pytest.raises(PrepareError, match="exists and is not a token cache"):
        join(tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c")) == ["meta.json", "notes.txt"]
    capsys.readouterr()
    for args, words in ((["--shard", "3/3"], "--shard 3/3 is not I/N with 0 <= I < N"),
                        (["--shard", "1/2", "--vocab_size", "300"], "--shard 1/2 needs a --tokenizer"),
                        (["--shuffle_seed", "-2"], "--shuffle_seed -2 must be a seed of at least 0, or -1"),
                        (["--shard_tokens", "0"], "--shard_tokens 0 must be at least 1")):
        with pytest.raises(SystemExit) as exit_info:
            prepare_main(["--source", str(src), "--out", str(tmp_path / "d"), *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_a_shard_jobs_part_folder_that_is_a_users_is_refused_and_kept(corpus, tmp_path):
    """--shard I/N replaced DIR.part-I-of-N whole without a look at it, deleting whatever a user kept there."""
    src, tok, _ = corpus
    part = tmp_path / "c.part-0-of-2"
    part.mkdir()
    files = {"meta.json": '{"note": 1}\n', "results.csv": "precious\n"}
    for name, text in files.items():
        (part / name).write_text(text)
    with pytest.raises(PrepareError) as e:
        prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(0, 2))
    assert str(e.value) == (f"--shard's part folder {str(part)!r} exists and is not a token cache's part; give an "
                            f"--out whose part folder is new, empty, or an existing part")
    assert {f.name: f.read_text() for f in part.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.part-0-of-2"]  # no build, lock or cache beside it
    shutil.rmtree(part)
    first = prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(0, 2))
    again = prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(0, 2), shuffle_seed=1)
    assert again["inputs_identity"] != first["inputs_identity"]  # a part prepare wrote is still replaced
    assert json.loads((part / "meta.json").read_text()) == again


def test_a_prefix_of_a_shuffled_cache_mixes_documents_from_the_whole_corpus(corpus, tmp_path):
    src, tok, texts = corpus
    shuffled = prepare(src, tmp_path / "shuffled", tokenizer=str(tok), num_proc=1, val_fraction=0.1)
    ordered = prepare(src, tmp_path / "ordered", tokenizer=str(tok), num_proc=1, val_fraction=0.1, shuffle_seed=-1)
    other = prepare(src, tmp_path / "other", tokenizer=str(tok), num_proc=1, val_fraction=0.1, shuffle_seed=5)
    assert (shuffled["shuffle_seed"], ordered["shuffle_seed"], other["shuffle_seed"]) == (0, -1, 5)
    docs = {name: documents(tmp_path / name) for name in ("shuffled", "ordered", "other")}
    assert docs["ordered"] == [t for t in texts if t in docs["ordered"]]  # the source's order, as caches made before
    assert sorted(docs["shuffled"]) == sorted(docs["ordered"]) == sorted(docs["other"])  # the same documents,
    assert docs["shuffled"] != docs["other"]  # in an order of their seed
    topic = lambda d: int(d.split()[1]) // 15  # which quarter of the corpus a document comes from
    prefix = docs["shuffled"][:len(docs["shuffled"]) // 4]
    assert sorted({topic(d) for d in prefix}) == [0, 1, 2, 3]  # a quarter of the cache holds every quarter's
    assert {topic(d) for d in docs["ordered"][:len(prefix)]} == {0}  # where the source's order holds the first's
    assert sorted(documents(tmp_path / "shuffled", "val")) == sorted(documents(tmp_path / "ordered", "val"))


def test_the_trained_tokenizer_is_the_same_in_any_order_and_a_cache_made_again_keeps_its_identity(corpus, tmp_path):
    """The BPE learns from the train documents in the source's order, whatever order the cache's are in. Made again
    in the source's order with its own tokenizer, a cache has its identity again (so data/cache/gutenberg's, which
    the recorded results name): the tokenizer's files are kept as they are, not re-saved."""
    src, _, _ = corpus
    metas = [prepare(src, tmp_path / f"c{s}", vocab_size=300, num_proc=1, val_fraction=0.1, shuffle_seed=s)
             for s in (-1, 3)]
    assert metas[0]["tokenizer_files_sha256"] == metas[1]["tokenizer_files_sha256"]
    assert metas[0]["train_tokens"] == metas[1]["train_tokens"] and metas[0]["train_sha256"] != metas[1]["train_sha256"]
    again = prepare(src, tmp_path / "again", tokenizer=str(tmp_path / "c-1"), num_proc=1, val_fraction=0.1,
                    shuffle_seed=-1)
    assert again["cache_identity"] == metas[0]["cache_identity"] and again["tokenizer"] != metas[0]["tokenizer"]


def damage(cache, how):
    meta = json.loads((cache / "meta.json").read_text())
    shard = cache / meta["train_shards"][1]["file"]
    data = shard.read_bytes()
    if how == "changed":  # the same size: a start cannot see it
        shard.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif how == "truncated":
        shard.write_bytes(data[:-2])
    elif how == "grown":
        shard.write_bytes(data + data[:2])
    elif how == "missing":
        shard.unlink()
    elif how == "meta edited":
        (cache / "meta.json").write_text(json.dumps(dict(meta, train_sha256="0" * 64)))
    elif how == "no tokenizer":
        (cache / "tokenizer.json").unlink()
        return "tokenizer.json"
    return shard.name


@pytest.mark.parametrize("how, at_start", [("changed", None), ("truncated", "truncated or foreign"),
                                           ("grown", "truncated or foreign"), ("missing", "has no train-000001.bin"),
                                           ("meta edited", "cache_identity is not the one its recorded hashes give"),
                                           ("no tokenizer", None)])  # verify said whole, prepare up to date
def test_a_damaged_shard_is_refused_at_start_cheaply_or_by_the_explicit_check(corpus, tmp_path, capsys, how, at_start):
    src, tok, _ = corpus
    prepare(src, tmp_path / "whole", tokenizer=str(tok), num_proc=1, shard_tokens=1_000)
    assert verify.main([str(tmp_path / "whole")]) == 0 and "whole (" in capsys.readouterr().out
    cache = tmp_path / "cache"
    shutil.copytree(tmp_path / "whole", cache)
    name = damage(cache, how)
    if at_start is None:
        TokenCache(cache)  # a start reads no shard's bytes
    else:
        with pytest.raises(CacheError, match=at_start):
            TokenCache(cache)
    assert verify.main([str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and (how == "meta edited" or name in err), err
    if how == "changed":
        assert "does not match its sha256 in meta.json" in err
    if how == "no tokenizer":  # and the same prepare builds it again rather than finding it up to date
        prepare(src, cache, tokenizer=str(tok), num_proc=1, shard_tokens=1_000)
        assert "wrote " in capsys.readouterr().out and verify.main([str(cache)]) == 0


def test_the_explicit_check_reads_a_one_file_cache_whole_too(text_cache, tmp_path):
    """A byte of a format-1 cache's val.bin changed at the same size: a start no longer hashes it; verify does."""
    from tokenizers import Tokenizer, models
    cache = tmp_path / "copy"
    shutil.copytree(text_cache, cache)
    with pytest.raises(CacheError, match="tokenizer.json is missing or does not load"):  # a hand-written cache's
        verify.verify(cache)
    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(256)}, unk_token="<0>")).save(str(cache / "tokenizer.json"))
    assert verify.verify(cache)["tokens"] == len(TokenCache(cache).train) + len(TokenCache(cache).val)
    (cache / "val.bin").write_bytes(b"\x01\x00" + (cache / "val.bin").read_bytes()[2:])
    TokenCache(cache)
    with pytest.raises(CacheError, match="val.bin does not match its sha256"):
        verify.verify(cache)


def test_a_streamed_local_source_gives_the_same_cache(corpus, tmp_path):
    """--streaming reads the files as they are tokenized (no arrow copy of the text): the same documents."""
    src, tok, _ = corpus
    a = prepare(src, tmp_path / "a", tokenizer=str(tok), num_proc=1)
    b = prepare(src, tmp_path / "b", tokenizer=str(tok), num_proc=1, streaming=True)
    assert a["cache_identity"] == b["cache_identity"] and a["train_documents"] == 59


def test_a_streamed_row_that_is_not_a_string_names_the_file_and_line(tmp_path, corpus):
    src, tok, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one document"}\n{"text": "another"}\n{"text": 7}\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl' line 3 has a 'text' that is a number, not a string"):
        prepare(bad, tmp_path / "c", tokenizer=str(tok), num_proc=1, streaming=True)


def readme_command(marker):
    """The words of the command in README.md that holds `marker` (its continuation lines joined)."""
    import shlex
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text().replace("\\\n", " ")
    return shlex.split(next(line for line in text.splitlines() if line.startswith("python ") and marker in line))


def test_the_readme_fineweb_edu_commands_on_local_json_lines(corpus, tmp_path):
    """README.md's FineWeb-edu commands, run on JSON-lines rows as the dataset streams them (its other columns
    beside "text") and a local tokenizer in place of the hub's: the cache, then config/fineweb_edu_20m.py on it."""
    import configurator
    import settings
    import train  # imported by most test files of the suite anyway (about 5 s alone here: its kernels' imports)
    _, tok, texts = corpus
    rows = [{"text": t, "id": f"<urn:uuid:{i}>", "dump": "CC-MAIN-2024-10", "url": f"https://example.org/{i}",
             "language": "en", "language_score": 0.95, "token_count": len(t) // 4, "score": 3.1, "int_score": 3}
            for i, t in enumerate(texts)]
    (tmp_path / "fineweb.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = readme_command("fineweb-edu:sample-10BT")
    assert words[:2] == ["python", "data/prepare.py"] and "--streaming" in words
    local = {"--source": str(tmp_path / "fineweb.jsonl"), "--tokenizer": str(tok), "--out": str(tmp_path / "fw")}
    args = [local.get(prev, w) for prev, w in zip(["", *words[2:]], words[2:])]
    prepare_main(args)
    meta = json.loads((tmp_path / "fw" / "meta.json").read_text())
    assert meta["train_documents"] + meta["val_documents"] == len(texts) and meta["shuffle_seed"] == 0
    train_words = readme_command("config/fineweb_edu_20m.py")
    assert train_words[:2] == ["python", "train.py"]
    cfg = configurator.load_config(train.DEFAULTS, [train_words[2]])
    assert cfg["data_dir"] == "data/cache/fineweb-edu" and cfg["vocab_size"] == 0  # the vocabulary follows the cache
    cfg.update(data_dir=str(tmp_path / "fw"), device="cpu", compile=False, loss_impl="full", compile_mode="default",
               dim=32, n_layers=2, n_heads=2, hidden_dim=64, seq_len=32, train_subset_tokens=0, tokens_per_update=256,
               micro_batch_size=8, val_subset_tokens=128, eval_batch_size=8, stop_after_updates=2, cpu_threads=1,
               results_file=str(tmp_path / "results.json"), out_dir=str(tmp_path / "out"))
    entry = train.train(settings.Config(cfg))
    assert entry["status"] == "interrupted" and entry["step"] == 2  # stopped, as asked, after 2 updates
    assert entry["environment"]["cache_identity"] == meta["cache_identity"]


def test_a_part_cut_short_is_refused_and_the_parts_kept(corpus, tmp_path):
    """A bucket file cut short (an interrupted copy from another node) was read short: the joined cache lacked its
    tokens, loaded without a word, and the parts that would have shown it were deleted."""
    src, tok, _ = corpus
    for i in range(2):
        prepare(src, tmp_path / "c", tokenizer=str(tok), num_proc=1, part=(i, 2))
    bucket = sorted((tmp_path / "c.part-1-of-2").glob("bucket-*.bin"))[-1]
    size = bucket.stat().st_size
    os.truncate(bucket, size // 4 * 2)
    index = tmp_path / "c.part-1-of-2" / "index.npy"
    whole_index = index.read_bytes()
    # cut short, missing (the two were tracebacks), or the index cut short
    for damage in (lambda: None, bucket.unlink, lambda: index.write_bytes(whole_index[:len(whole_index) // 2])):
        damage()
        with pytest.raises(PrepareError, match=r"the part '.*c\.part-1-of-2' is not whole .*make it again with its "
                                               r"--shard job"):
            join(tmp_path / "c")
        assert not (tmp_path / "c").exists() and (tmp_path / "c.part-0-of-2").is_dir()


def test_another_shard_size_cuts_the_cache_again(corpus, tmp_path):
    """--shard_tokens is part of what was asked for: preparing the same --out with another size cuts it again (the
    same tokens, so the same cache_identity) rather than keeping the old shards as up to date."""
    src, tok, _ = corpus
    out = tmp_path / "c"
    first = prepare(src, out, tokenizer=str(tok), num_proc=1, shard_tokens=1_000)
    again = prepare(src, out, tokenizer=str(tok), num_proc=1, shard_tokens=400)
    assert again["inputs_identity"] != first["inputs_identity"] and again["cache_identity"] == first["cache_identity"]
    n = again["train_tokens"]
    assert again["shard_tokens"] == 400 and n == first["train_tokens"] and n % 400
    assert [s["tokens"] for s in again["train_shards"]] == [400] * (n // 400) + [n % 400]
    names = [shards.shard_name("train", i) for i in range(n // 400 + 1)]
    assert sorted(p.name for p in out.glob("train-*.bin")) == names


def test_eval_batches_of_sharded_tokens_score_every_token_once_at_any_length():
    """Every length of a split modulo seq_len, over shard boundaries: every token after the first is a target once,
    in order, its input the token before it, however short the last window (one target when the length is 2 past a
    multiple of seq_len); padding is input 0, target ignored; the batch count is known ahead."""
    seq_len, batch = 8, 3
    for n in range(2, 3 * seq_len + 3):
        positions = np.arange(n, dtype=np.int64)  # each token's value is its position
        batches = list(eval_batches(shards.ShardedTokens(np.array_split(positions, 3)), seq_len, batch))
        windows = math.ceil((n - 1) / seq_len)
        assert len(batches) == eval_batch_count(n, seq_len, batch) == math.ceil(windows / batch), n
        x, y = (np.concatenate([t.numpy() for t in ts]) for ts in zip(*batches))
        assert x.shape == y.shape == (len(batches) * batch, seq_len)
        scored = y != IGNORE
        assert y[scored].tolist() == list(range(1, n)), n
        assert np.array_equal(x[scored], y[scored] - 1) and not x[~scored].any(), n


def test_a_split_of_one_token_has_no_target_and_is_refused(tmp_path):
    """One token is no sequence: nothing to train on, and a validation over no target would give loss 0.0, below
    any target. Two tokens are one target."""
    train, val = np.arange(100) % 256, np.arange(50) % 256
    for split in ("train", "val"):
        tokens = {"train": train, "val": val, split: np.array([7])}
        with pytest.raises(CacheError, match=f"holds 1 tokens, as meta.json says: the cache's {split} split is empty"):
            TokenCache(write_cache(tmp_path / split, tokens["train"], tokens["val"], 256))
    cache = TokenCache(write_cache(tmp_path / "two", train, [7, 9], 256))
    (x, y), = eval_batches(cache.val, 32, 4)
    assert (y != IGNORE).sum() == 1 and (x[0, 0], y[0, 0]) == (7, 9)
