"""Inputs a new user gets wrong, each refused in one line before any work (or given the right result): weights
and a token cache of different tokenizers (checkpoint.cache_mismatch, for train.py's init_from), a transformers
folder whose config.json disagrees with its weights, and results files that are not what the writers keep."""
import json

import pytest
import torch

import checkpoint
import hf
from data.loader import TokenCache
from model import ModelConfig, Transformer
from results import ResultsFileError, read_results, record
from tests.test_sample import bpe_tokenizer, tokenized_cache
import settings

TEXT = " ".join(f"The {w} walked to the {p} at {n} o'clock, and said: {q}!" for w, p, n, q in zip(
    ["miller", "baker", "weaver", "sailor", "farmer"] * 8, ["mill", "market", "river", "harbour", "field"] * 8,
    range(40), ["good morning", "what a day", "not again", "fair winds", "rain at last"] * 8))
OTHER_TEXT = " ".join(f"Quantum {w} number {n} collapses; {w}s entangle." for w, n in
                      zip(["photon", "electron", "muon", "quark"] * 10, range(40)))


def tiny_model(n_layers=2):
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=300, dim=64, n_layers=n_layers, n_heads=2, hidden_dim=128,
                                   max_seq_len=32))


@pytest.fixture(scope="module")
def tokenizers():
    return {"run": bpe_tokenizer(TEXT, 300), "other": bpe_tokenizer(OTHER_TEXT, 290)}


def trained_on(folder, cache):
    """A train.py checkpoint in folder as the run on `cache` saves it (what init_from and sampling read)."""
    model = tiny_model()
    path = folder / "ckpt.pt"
    checkpoint.save(path, model, torch.optim.AdamW(model.parameters()), 1,
                    dict(recipe={"cache_identity": TokenCache(cache).identity}, config={"data_dir": str(cache)},
                         model_config=model.config.to_dict()))
    return path


# ---------------------------------------------------------------- checkpoint.cache_mismatch (train.py's init_from)

def test_cache_mismatch_of_a_checkpoint(tmp_path, tokenizers):
    cache = tokenized_cache(tmp_path / "cache", tokenizers["run"], TEXT)
    initial = checkpoint.initial_weights(trained_on(tmp_path, cache))
    assert initial.cache_identity == TokenCache(cache).identity and initial.data_dir == cache
    assert checkpoint.cache_mismatch(initial, TokenCache(cache)) is None  # its own cache
    assert checkpoint.cache_mismatch(None, TokenCache(cache)) is None  # no init_from
    # another corpus in its tokenizer: what fine-tuning is; another tokenizer: other meanings for its ids
    same = tokenized_cache(tmp_path / "same", tokenizers["run"], TEXT[::-1])
    assert checkpoint.cache_mismatch(initial, TokenCache(same)) is None
    other = tokenized_cache(tmp_path / "other", tokenizers["other"], TEXT)
    problem = checkpoint.cache_mismatch(initial, TokenCache(other))
    assert f"init_from {initial.path} was trained on the token cache {cache}, whose tokenizer differs" in problem
    assert "data/prepare.py --tokenizer" in problem and "\n" not in problem
    # its cache prepared again with another tokenizer: the identity differs, and nothing is left to compare with
    tokenized_cache(cache, tokenizers["other"], TEXT)
    problem = checkpoint.cache_mismatch(initial, TokenCache(cache))
    assert f"token cache {cache} (cache_identity {initial.cache_identity[:12]}), which was prepared again" in problem
    assert "prepare it again as it was" in problem and "\n" not in problem
    problem = checkpoint.cache_mismatch(initial, TokenCache(same))
    assert f"{cache} no longer holds that cache to compare their tokenizers with" in problem


def test_cache_mismatch_of_a_transformers_folder(tmp_path, tokenizers):
    """A folder with a tokenizer must hold the cache's; one without has nothing to compare."""
    folder = tmp_path / "hf"
    hf.to_hf(tiny_model()).save_pretrained(folder)
    cache = tokenized_cache(tmp_path / "cache", tokenizers["run"], TEXT)
    other = tokenized_cache(tmp_path / "other", tokenizers["other"], TEXT)
    initial = checkpoint.initial_weights(folder)
    assert checkpoint.cache_mismatch(initial, TokenCache(other)) is None  # no tokenizer in the folder
    tokenizers["run"].save_pretrained(folder)
    assert checkpoint.cache_mismatch(initial, TokenCache(cache)) is None
    problem = checkpoint.cache_mismatch(initial, TokenCache(other))
    assert f"init_from {folder} holds a tokenizer that differs from the one of the token cache {other}" in problem
    assert f"--tokenizer {folder}" in problem


# ---------------------------------------------------------------- init_from: config.json against its weights

def edited_export(folder, **config):
    """A transformers folder of a 2-layer model whose config.json then says `config`."""
    hf.to_hf(tiny_model()).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(saved, **config)))
    return folder


@pytest.mark.parametrize("config, words", [
    # fewer layers: transformers dropped the others' weights, printing only its table of unexpected keys
    ({"num_hidden_layers": 1}, "config.json says num_hidden_layers=1 but the weights hold 2 layers"),
    # more layers: the missing one would have been initialized at random
    ({"num_hidden_layers": 3}, "config.json says num_hidden_layers=3 but the weights hold 2 layers"),
    # another width: transformers' own RuntimeError of size mismatches
    ({"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4},
     "config.json says hidden_size=128 but the weights hold 64"),
    ({"intermediate_size": 256}, "config.json says intermediate_size=256 but the weights hold 128"),
    ({"vocab_size": 320}, "config.json says vocab_size=320 but the weights hold 300")])
def test_a_config_that_disagrees_with_its_weights_is_refused(tmp_path, config, words):
    folder = edited_export(tmp_path / "hf", **config)
    with pytest.raises(ValueError) as refused:
        checkpoint.initial_weights(folder)
    message = str(refused.value)
    assert message.startswith(f"init_from {str(folder)!r}: ") and words in message and "\n" not in message


def test_every_stored_weight_is_used(tmp_path):
    """An LM head saved beside the tied embedding is the embedding, or the folder is refused."""
    from safetensors.torch import load_file, save_file
    folder = edited_export(tmp_path / "hf")
    weights = load_file(folder / "model.safetensors")
    save_file(dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"].clone()}),
              folder / "model.safetensors", metadata={"format": "pt"})
    model = tiny_model()
    loaded = checkpoint.initial_weights(folder)
    assert all(torch.equal(loaded.state[k], v) for k, v in model.state_dict().items())
    save_file(dict(weights, **{"lm_head.weight": torch.zeros_like(weights["model.embed_tokens.weight"])}),
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        checkpoint.initial_weights(folder)
    save_file(dict(weights, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)}), folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the weights hold model.layers.0.mlp.extra.weight, which config.json has no place"):
        checkpoint.initial_weights(folder)


# ---------------------------------------------------------------- the results file

def test_a_history_that_is_not_a_list_is_one_line(tmp_path):
    """record() appended to it: AttributeError: 'dict' object has no attribute 'append'."""
    path = tmp_path / "results.json"
    for history in ({"a": 1}, "replaced", [1, 2]):
        path.write_text(json.dumps({"run": {"loss": 1.0}, "history": history}))
        with pytest.raises(ResultsFileError) as refused:
            record(path, ["run"], {"loss": 2.0})
        assert f"results file {path}: its field 'history' is a " in str(refused.value)
        assert "\n" not in str(refused.value)
        assert json.loads(path.read_text())["history"] == history  # left as it was


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_the_results_file_is_strict_json_with_null_for_non_finite_numbers(tmp_path):
    """A diverged run wrote NaN and Infinity, which jq, JavaScript and strict parsers refuse for the whole file."""
    path = tmp_path / "results.json"
    path.write_text('{"old": {"loss": NaN}}')  # as the writer left it before
    nan, inf = float("nan"), float("inf")
    record(path, ["diverged"], {"status": "complete", "final_validation": {"loss": nan, "loss_std": inf},
                                "training_curve": [{"update": 1, "loss": 2.5}, {"update": 2, "loss": nan}],
                                "grad_norms": [1.0, -inf], "nested": {"deeper": [[nan]]}})
    data = strict_json(path.read_text())
    entry = data["diverged"]
    assert entry["final_validation"] == {"loss": None, "loss_std": None}
    assert [p["loss"] for p in entry["training_curve"]] == [2.5, None]
    assert entry["grad_norms"] == [1.0, None] and entry["nested"] == {"deeper": [[None]]}
    assert data["old"] == {"loss": None} and read_results(path) == data


def test_train_refuses_init_from_weights_of_another_tokenizer_before_any_work(tmp_path, tokenizers, capsys):
    """--init_from a checkpoint onto a cache of another tokenizer trained without a word: the ids mean other
    tokens. train.py's setup asks checkpoint.cache_mismatch and refuses in one line, before its folder is made."""
    import train
    from tests.test_train import cli_args, small_config
    cache = tokenized_cache(tmp_path / "cache", tokenizers["run"], TEXT)
    source = trained_on(tmp_path, cache)
    other = tokenized_cache(tmp_path / "other", tokenizers["other"], TEXT)
    cfg = small_config(other, tmp_path, init_from=str(source), dim=0, n_layers=0, n_heads=0, hidden_dim=0,
                       seq_len=16, tokens_per_update=64, micro_batch_size=4, val_subset_tokens=64,
                       train_subset_tokens=0, full_validation=False)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: init_from ") and "whose tokenizer differs" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "results.json").exists()
    same = small_config(cache, tmp_path, init_from=str(source), dim=0, n_layers=0, n_heads=0, hidden_dim=0,
                        seq_len=16, tokens_per_update=64, micro_batch_size=4, val_subset_tokens=64,
                        train_subset_tokens=0, full_validation=False, epochs=1, name="same",
                        out_dir=str(tmp_path / "same"))
    assert train.main(cli_args(same)) == 0  # its own tokenizer's cache trains


@pytest.mark.parametrize("make, words", [
    (lambda tmp: "", "results file '' is empty"),
    (lambda tmp: (tmp / "d").mkdir() or str(tmp / "d"), "is a folder"),
    (lambda tmp: (tmp / "r.json").write_text("{not json") and str(tmp / "r.json"), "is not valid JSON"),
])
def test_a_results_file_that_cannot_be_one_is_refused_before_any_work(tmp_path, monkeypatch, make, words):
    """Before, an empty path or a folder passed the check and failed only when the run first recorded itself,
    after the model was built and its folder made (and "" left a stray ".lock" where the script ran)."""
    from results import check_writable
    monkeypatch.chdir(tmp_path)  # where "" would have put its lock
    path = make(tmp_path)
    with pytest.raises(ResultsFileError, match=words):
        check_writable(path)
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob(".lock"))


def test_a_run_that_fails_to_build_gives_its_folder_back(text_cache, tmp_path, monkeypatch):
    """The run lock is taken before the trainer is built; a trainer that fails (out of memory, say) must release
    it, so that the same process can train that run again."""
    import train
    from tests.test_train import small_config
    cfg = small_config(text_cache, tmp_path, epochs=1)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
    with monkeypatch.context() as patch:
        patch.setattr(train.Trainer, "from_plan", staticmethod(out_of_memory))
        with pytest.raises(torch.OutOfMemoryError) as failure:
            train.train(cfg)
    # the traceback is still held (as a notebook or a caller holds it), and with it the half-built run: its lock
    # must have been released, not left to the garbage collector
    assert failure.traceback
    assert train.train(settings.Config(cfg, overwrite=True))["status"] == "complete"  # not "another train.py"


@pytest.mark.parametrize("args, words", [
    (["--seq_len=0"], "argument --seq_len: must be at least 1, got 0"),
    (["--seq_len=-8"], "argument --seq_len: must be at least 1, got -8"),
    (["--seq_len=2048", "--tokens=4096"], "--seq_len 2048 is longer than the model's context of 1024 tokens"),
    (["--device=gpu"], "--device 'gpu' is no device; give cuda, cuda:N or cpu"),  # both were tracebacks
    *([(["--device=cuda:0"], "--device=cuda:0 but PyTorch sees no GPU")] if not torch.cuda.is_available() else []),
])
def test_parity_refuses_a_seq_len_the_model_cannot_take_in_one_line(tmp_path, capsys, args, words):
    """Before, 0 divided by zero, a negative length failed in view() and one past the context in the forward."""
    from scripts import parity
    try:
        status = parity.main(["--preset=20m", "--device=cpu", f"--results_file={tmp_path / 'r.json'}", *args])
    except SystemExit as exc:  # argparse's refusal
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and words in err and "Traceback" not in err, err
    assert not (tmp_path / "r.json").exists()


def test_parity_refuses_a_gpu_index_it_cannot_see(tmp_path, capsys, monkeypatch):
    """cuda:7 on a machine of one GPU passed the checks, to CUDA's traceback at the model's move."""
    from scripts import parity
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    status = parity.main(["--preset=20m", "--device=cuda:7", f"--results_file={tmp_path / 'r.json'}"])
    err = capsys.readouterr().err
    assert status == 2 and "--device=cuda:7 but PyTorch sees 1 GPU(s); give cuda:0 to cuda:0" in err, err


@pytest.mark.parametrize("script", ["ceilings", "loss_microbench"])
@pytest.mark.parametrize("name", ["benchmarks", "history"])
def test_a_gpu_script_refuses_a_name_that_would_replace_a_section(capsys, monkeypatch, script, name):
    """--name=benchmarks replaced the whole benchmarks section with the script's entry; --name=history failed after
    the GPU work. Its own section's name (the default) stays accepted."""
    import importlib
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))  # as run: common beside it
    module = importlib.import_module(script)
    monkeypatch.setattr("sys.argv", [f"{script}.py", f"--name={name}"])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"name {name!r} is a section of the results file" in err, err
