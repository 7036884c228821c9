"""evaluate.py: a checkpoint and its export evaluate to the same loss (train.py's full validation), bits per byte
follow from the loss and the bytes, the export loads the way lm-evaluation-harness loads a pretrained= folder, and
bad inputs are one line."""
import dataclasses
import gzip
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import evaluate
import model
import sample
import train
import trainer
from data import prepare
from results import read_results
from tests.conftest import SHARED_CORPUS, write_cache
from tests.test_model import tiny_config
from tests.test_sample import bpe_tokenizer

SEQ_LEN = 64
EOT = 0  # <|endoftext|>, the BPE's only special token


def prepared_cache(folder, tokenizer, documents, val_documents):
    """A token cache as data/prepare.py writes one: each document's tokens followed by end-of-text, the tokenizer
    beside them."""
    def tokens(docs):
        return np.concatenate(prepare.encode_batch({"text": docs}, tokenizer, EOT)["ids"])
    tokenizer.save_pretrained(folder)
    return write_cache(folder, tokens(documents), tokens(val_documents), vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A model trained for 8 updates (with its full validation) on a cache of book pages, and its export."""
    if not SHARED_CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {SHARED_CORPUS}")
    root = tmp_path_factory.mktemp("evaluate")
    book = sorted((SHARED_CORPUS / "train").glob("*.txt.gz"))[0]
    text = gzip.open(book).read()[:48_000].decode("utf-8", errors="ignore")
    pages = [text[i:i + 4000] for i in range(0, len(text), 4000)]
    tokenizer = bpe_tokenizer(text[:8_000], 300)
    cache = prepared_cache(root / "cache", tokenizer, pages[:-2], pages[-2:])
    out, results_file = root / "out", root / "results.json"
    assert train.main([f"--data_dir={cache}", f"--out_dir={out}", f"--results_file={results_file}", "--name=ev",
                       "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128", f"--seq_len={SEQ_LEN}",
                       "--device=cpu", "--epochs=1", "--train_subset_tokens=4096", "--tokens_per_update=512",
                       "--micro_batch_size=8", "--val_subset_tokens=1024", "--warmup_updates=2",
                       "--learning_rate=1e-2", "--full_validation=True", "--eval_batch_size=4"]) == 0
    export = root / "hf"
    assert sample.main([f"--out_dir={out}", f"--export_hf={export}", "--device=cpu"]) == 0
    return dict(root=root, cache=cache, out=out, export=export, results=results_file, tokenizer=tokenizer,
                val_pages=pages[-2:], final=read_results(results_file)["ev"]["final_validation"])


def evaluated(run, *args):
    """evaluate.py's entry for these arguments, recorded in the run's results file."""
    cfg = evaluate.settings.load(evaluate.EvaluateSettings,
                                 [f"--results_file={run['results']}", "--device=cpu", *args])
    return evaluate.evaluate(cfg)


def test_a_checkpoint_and_its_export_give_the_same_loss_as_the_runs_full_validation(run):
    ckpt = evaluated(run, f"--init_from={run['out']}")
    export = evaluated(run, f"--init_from={run['export']}", f"--data_dir={run['cache']}")
    assert ckpt["weights"]["source"] == "checkpoint" and export["weights"]["source"] == "transformers"
    assert ckpt["weights"]["sha256"] == export["weights"]["sha256"]  # the export holds the very same weights
    assert ckpt["data"] == export["data"] and ckpt["seq_len"] == export["seq_len"] == SEQ_LEN
    for key in ("loss", "loss_std", "perplexity", "bits_per_byte"):
        assert export[key] == pytest.approx(ckpt[key], rel=1e-6), key
    assert export["tokens"] == ckpt["tokens"] and export["bytes"] == ckpt["bytes"]
    # the checkpoint's own cache, found from what it recorded; train.py's full validation scored the same tokens
    assert ckpt["tokens"] == run["final"]["tokens"]
    assert ckpt["loss"] == pytest.approx(run["final"]["loss"], rel=1e-6)


def test_the_entry_says_what_was_evaluated_and_its_bits_per_byte(run):
    entry = evaluated(run, f"--init_from={run['out']}", "--name=the-checkpoint")
    recorded = read_results(run["results"])["evaluation"]["the-checkpoint"]
    assert json.loads(json.dumps(entry)) == recorded
    assert recorded["weights"]["path"] == str(run["out"] / "ckpt.pt")
    assert recorded["data"]["split"] == "val" and recorded["data"]["cache"] == str(run["cache"])
    assert recorded["data"]["cache_identity"] == json.loads((run["cache"] / "meta.json").read_text())["cache_identity"]
    assert recorded["fingerprint"]["cache_identity"] == recorded["data"]["cache_identity"]
    assert recorded["perplexity"] == pytest.approx(math.exp(recorded["loss"]))
    # the scored tokens are every validation token but the first; their text is the pages but the first token's
    first = run["tokenizer"].decode([int(np.fromfile(run["cache"] / "val.bin", np.uint16)[0])])
    assert recorded["bytes"] == len("".join(run["val_pages"]).encode()) - len(first.encode())
    assert recorded["bits_per_byte"] == pytest.approx(
        recorded["loss"] * recorded["tokens"] / math.log(2) / recorded["bytes"])


def test_a_text_files_bits_per_byte_follow_from_its_loss_and_bytes(run, tmp_path):
    text = "It was the best of times, it was the worst of times.\nNaïve café, “quoted” <|endoftext|> — 東京.\n" * 3
    path = tmp_path / "notes.txt"
    path.write_bytes(text.encode())
    assert evaluate.main([f"--results_file={run['results']}", "--device=cpu", f"--init_from={run['out']}",
                          f"--text={path}"]) == 0
    entry = read_results(run["results"])["evaluation"][f"{run['out']}:{path}"]  # the default name
    ids = prepare.encode_batch({"text": [text]}, run["tokenizer"], EOT)["ids"][0]  # the document as prepare makes it
    assert entry["tokens"] == len(ids)  # each token of it is a target: the end-of-text before it is the first input
    assert entry["bytes"] == len(text.encode()) == path.stat().st_size
    assert entry["bits_per_byte"] == pytest.approx(entry["loss"] * entry["tokens"] / math.log(2) / entry["bytes"])
    assert entry["data"]["text"] == str(path) and "split" not in entry["data"]
    assert np.array_equal(evaluate.text_tokens(run["tokenizer"], text, EOT), [EOT, *ids])


def test_the_export_loads_as_lm_evaluation_harness_loads_a_pretrained_folder(run, tmp_path):
    """lm-eval's HFLM(pretrained=FOLDER): AutoConfig, AutoModelForCausalLM and AutoTokenizer (fast) from the folder;
    max_length from max_position_embeddings; its rolling log-likelihood starts each text from eos_token_id. Scored
    that way, a text's loss is evaluate.py's for the checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    folder = str(run["export"])
    config = AutoConfig.from_pretrained(folder, revision="main", trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(folder, revision="main", dtype="auto", trust_remote_code=False)
    model.eval()
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, revision="main", trust_remote_code=False, use_fast=True)
    assert tokenizer.eos_token is not None and tokenizer.eos_token_id == EOT
    assert config.max_position_embeddings == SEQ_LEN
    text = "It was the best of times, it was the worst of times."
    ids = [tokenizer.eos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], EOT]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits
    assert logits.shape == (1, len(ids) - 1, len(tokenizer)) == (1, len(ids) - 1, config.vocab_size)
    logprobs = torch.log_softmax(logits.float(), dim=-1)[0, torch.arange(len(ids) - 1), ids[1:]]
    path = tmp_path / "line.txt"
    path.write_text(text)
    ours = evaluated(run, f"--init_from={run['out']}", f"--text={path}")
    assert ours["tokens"] == len(ids) - 1
    assert -logprobs.mean().item() == pytest.approx(ours["loss"], rel=1e-5)


def test_help_lists_only_evaluations_keys(capsys):
    with pytest.raises(SystemExit) as done:
        evaluate.main(["--help"])
    assert done.value.code == 0
    keys = capsys.readouterr().out.split("\nsettings (", 1)[1]
    listed = [line.split("=", 1)[0].strip()[2:] for line in keys.splitlines() if line.strip().startswith("--")]
    assert listed == [f.name for f in dataclasses.fields(evaluate.EvaluateSettings)]
    assert set(listed) == {"text", "name", "results_file", "data_dir", "init_from", "seq_len", "device",
                           "eval_batch_size"}


def one_line_error(capsys, args, *words):
    assert evaluate.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for word in words:
        assert word in lines[0]


def test_bad_inputs_are_one_line(run, tmp_path, capsys):
    base = [f"--results_file={tmp_path / 'results.json'}", "--device=cpu"]
    one_line_error(capsys, base, "init_from is not set")
    one_line_error(capsys, [*base, f"--init_from={tmp_path / 'missing'}"], "neither")
    one_line_error(capsys, [*base, f"--init_from={run['out']}", f"--text={tmp_path / 'missing.txt'}"],
                   "is not a file")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    one_line_error(capsys, [*base, f"--init_from={run['out']}", f"--text={latin}"], "not UTF-8", "0xe9")
    (tmp_path / "empty.txt").write_text("")
    one_line_error(capsys, [*base, f"--init_from={run['out']}", f"--text={tmp_path / 'empty.txt'}"], "empty")
    one_line_error(capsys, [*base, f"--init_from={run['export']}", f"--data_dir={tmp_path / 'nowhere'}"],
                   "meta.json")
    one_line_error(capsys, [*base, "--seq_len=-1", f"--init_from={run['out']}"], "seq_len")
    assert not (tmp_path / "results.json").exists()  # nothing was recorded


def test_a_cache_of_another_tokenizer_is_refused_for_a_checkpoint_and_an_export(run, tmp_path, capsys):
    other = bpe_tokenizer(" ".join(run["val_pages"]), 280)
    cache = prepared_cache(tmp_path / "other", other, run["val_pages"][:1], run["val_pages"][1:])
    base = [f"--results_file={tmp_path / 'results.json'}", "--device=cpu", f"--data_dir={cache}"]
    one_line_error(capsys, [*base, f"--init_from={run['out']}"], "tokenizer differs", "evaluate on")
    one_line_error(capsys, [*base, f"--init_from={run['export']}"], "tokenizer that differs", "evaluate on")



def test_a_data_dir_given_at_the_default_path_is_the_cache_evaluated(run, tmp_path, monkeypatch, capsys):
    """--data_dir=data/cache/gutenberg (train.py's default) was taken for "not given": a checkpoint was evaluated
    on its own cache, unsaid, and a cache with another tokenizer at that path was not refused; an export, which
    records no cache, still takes that default path when --data_dir is not given."""
    import shutil
    other = bpe_tokenizer(" ".join(run["val_pages"]), 280)
    prepared_cache(tmp_path / "data" / "cache" / "gutenberg", other, run["val_pages"][:1], run["val_pages"][1:])
    monkeypatch.chdir(tmp_path)
    base = [f"--results_file={tmp_path / 'results.json'}", "--device=cpu"]
    one_line_error(capsys, [*base, f"--init_from={run['out']}", "--data_dir=data/cache/gutenberg"],
                   "tokenizer differs")
    one_line_error(capsys, [*base, f"--init_from={run['export']}"], "tokenizer that differs")
    shutil.rmtree(tmp_path / "data" / "cache" / "gutenberg")
    shutil.copytree(run["cache"], tmp_path / "data" / "cache" / "gutenberg")
    assert evaluated(run, f"--init_from={run['export']}")["loss"] == pytest.approx(run["final"]["loss"], abs=1e-4)

def test_merging_results_files_keeps_each_evaluation_entry(tmp_path):
    """scripts/merge_results.py merges evaluation.NAME entry by entry, as it does benchmarks.NAME."""
    import importlib.util
    from results import record
    spec = importlib.util.spec_from_file_location("merge_results", evaluate.env.REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    record(here, ["evaluation", "out/a"], {"loss": 1.0})
    record(there, ["evaluation", "out/b"], {"loss": 2.0})
    assert merge_results.merge(there, here) == (1, 0)
    assert read_results(here)["evaluation"] == {"out/a": {"loss": 1.0}, "out/b": {"loss": 2.0}}


def test_the_evaluation_pass_gives_the_mean_and_spread_of_every_counted_tokens_loss():
    """Trainer.evaluate's and evaluate.py's pass: over several batches with ignored targets, the loss is the mean of
    the counted tokens' losses and loss_std their population spread (matched.py's tolerance is loss_std over the
    square root of tokens, so a wrong spread widens what "the same loss" means)."""
    torch.manual_seed(0)
    m = model.Transformer(tiny_config()).eval()
    batches = [(torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))) for _ in range(3)]
    batches[1][1][0, 5:] = -100
    batches[2][1][2, :] = -100
    with torch.no_grad():
        per_token = torch.cat([torch.nn.functional.cross_entropy(m(x).flatten(0, 1).double(), y.flatten(),
                                                                 ignore_index=-100, reduction="none")
                               for x, y in batches])
    counted = per_token[torch.cat([y.flatten() for _, y in batches]) != -100]
    scored = trainer.mean_token_loss(m, batches, "cpu")
    assert scored["tokens"] == counted.numel() == 3 * 48 - 11 - 16
    assert scored["loss"] == pytest.approx(counted.mean().item(), rel=1e-6)
    assert scored["loss_std"] == pytest.approx(counted.std(unbiased=False).item(), rel=1e-5)
    assert scored["loss_std"] > 0.05  # random targets: a spread to get wrong


def test_the_bytes_of_a_split_decoded_in_pieces_are_its_documents_bytes(monkeypatch):
    """The validation split is decoded in pieces cut after end-of-text tokens: cut there, no character is split and
    every token is decoded once, so the bytes are the documents' own whatever the size of a piece. Documents that
    begin and end with a character of several byte tokens show a cut anywhere else."""
    documents = ["東 one café", "東京 two naïve “quoted” 東", "plain three", "東"]
    tokenizer = bpe_tokenizer(" ".join(documents[2:]) * 20, 280)
    ids = np.concatenate(prepare.encode_batch({"text": documents}, tokenizer, EOT)["ids"])
    assert len(tokenizer.encode("東", add_special_tokens=False)) > 1  # a character over several tokens
    expected = sum(len(d.encode("utf-8")) for d in documents)  # end-of-text tokens are no text
    for piece in (1, 2, 7, evaluate.DECODE_PIECE):
        monkeypatch.setattr(evaluate, "DECODE_PIECE", piece)
        for tokens in (ids, ids[:-1]):  # a split that ends with a document's end-of-text, or within it
            decoded = []  # the pieces' lengths; more pieces than tokens: a piece that does not move on

            def decode(piece_ids, **options):
                decoded.append(len(piece_ids))
                assert len(decoded) <= len(tokens), "decoding does not move on"
                return tokenizer.decode(piece_ids, **options)
            assert evaluate.decoded_bytes(SimpleNamespace(decode=decode), tokens, EOT) == expected, piece
            assert sum(decoded) == len(tokens), piece  # each token decoded once


def test_a_seq_len_of_its_own_scores_the_split_in_windows_of_that_length(run):
    """--seq_len=N scores windows of N tokens that do not overlap, each token after the first a target once: the
    loss is the export's (transformers' forward) over those windows, by hand."""
    from transformers import AutoModelForCausalLM
    half = SEQ_LEN // 2
    entry = evaluated(run, f"--init_from={run['out']}", f"--seq_len={half}", "--name=half")
    val = torch.from_numpy(np.fromfile(run["cache"] / "val.bin", np.uint16).astype(np.int64))
    export = AutoModelForCausalLM.from_pretrained(str(run["export"])).eval()
    whole = (len(val) - 1) // half  # windows of half targets, then one of the rest
    windows = [val[:whole * half + 1].unfold(0, half + 1, half), val[whole * half:][None]]
    with torch.no_grad():
        per_token = torch.cat([torch.nn.functional.cross_entropy(export(w[:, :-1]).logits.flatten(0, 1).float(),
                                                                 w[:, 1:].flatten(), reduction="none")
                               for w in windows if w.shape[1] > 1])
    assert entry["seq_len"] == half and entry["tokens"] == len(val) - 1 == per_token.numel()
    assert entry["loss"] == pytest.approx(per_token.mean().item(), rel=1e-5)


def test_the_perplexity_of_an_untrained_or_diverged_model_is_recorded(run, monkeypatch):
    """An untrained model's loss is about ln(vocabulary): its perplexity is the vocabulary, 32,000 for ln(32,000). A
    diverged model's loss is recorded too: exp(1000) overflows a float, so its perplexity is capped, not an error."""
    def scored_at(loss):
        monkeypatch.setattr(evaluate, "score", lambda model, tokens, *args: (
            {"loss": loss, "loss_std": 0.0, "tokens": len(tokens) - 1}, None))
        entry = evaluated(run, f"--init_from={run['out']}", f"--name=loss-{loss:g}")
        assert entry["loss"] == loss
        assert entry["bits_per_byte"] == pytest.approx(loss * entry["tokens"] / math.log(2) / entry["bytes"])
        return entry
    assert scored_at(math.log(32_000))["perplexity"] == pytest.approx(32_000)
    assert scored_at(1000.0)["perplexity"] >= math.exp(700)
