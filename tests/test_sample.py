"""sample.py: generation from a train.py checkpoint with the cache folder's tokenizer, and the transformers export."""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import configurator
import hf
import env
import sample
import train
from data.loader import TokenCache
from tests.conftest import SHARED_CORPUS, write_cache
from tests.test_model_bounds import seeded, tiny_config, tokens
import settings

PROMPT = "It was the best of"


def bpe_tokenizer(text, vocab_size):
    """A byte-level BPE of vocab_size tokens trained on text, with <|endoftext|>, as data/prepare.py trains one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def tokenized_cache(folder, tokenizer, text):
    """A token cache of text in folder, with its tokenizer saved beside the tokens (as data/prepare.py writes)."""
    tokenizer.save_pretrained(folder)
    ids = np.array(tokenizer.encode(text), dtype=np.int64)
    split = len(ids) * 4 // 5
    return write_cache(folder, ids[:split], ids[split:], vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A cache tokenized by a byte-level BPE of 300 tokens saved in the folder, and a model trained on it."""
    root = tmp_path_factory.mktemp("sample")
    book = sorted((SHARED_CORPUS / "train").glob("*.txt.gz"))[0]
    text = gzip.open(book).read()[:60_000].decode("utf-8", errors="ignore")
    tokenizer = bpe_tokenizer(text[:8_000], 300)
    cache = tokenized_cache(root / "cache", tokenizer, text)
    out = root / "out"
    code = train.main([f"--data_dir={cache}", f"--out_dir={out}", f"--results_file={root / 'results.json'}",
                       "--name=sample-test", "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128",
                       "--seq_len=64", "--device=cpu", "--epochs=1", "--train_subset_tokens=4096",
                       "--tokens_per_update=512", "--micro_batch_size=8", "--val_subset_tokens=1024",
                       "--warmup_updates=2", "--learning_rate=1e-2", "--full_validation=False"])
    assert code == 0
    return {"out": out, "cache": cache, "tokenizer": tokenizer, "root": root, "text": text}


def config(trained, *args):
    return settings.Config(configurator.load_config(sample.DEFAULTS, [f"--out_dir={trained['out']}", "--device=cpu",
                                                                 "--max_new_tokens=12", *args]))


def test_samples_start_with_the_prompt_and_repeat_with_the_seed(trained):
    texts = sample.sample(config(trained, f"--prompt={PROMPT}", "--num_samples=3"))
    assert len(texts) == 3
    tokenizer = trained["tokenizer"]
    prompt_tokens = len(tokenizer.encode(PROMPT))
    for text in texts:
        assert text.startswith(PROMPT)
        assert len(tokenizer.encode(text)) > prompt_tokens
    assert sample.sample(config(trained, f"--prompt={PROMPT}", "--num_samples=3")) == texts
    assert sample.sample(config(trained, f"--prompt={PROMPT}", "--num_samples=3", "--seed=7")) != texts


def test_top_k_1_and_temperature_0_are_greedy(trained):
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    tokenizer = trained["tokenizer"]
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    greedy = tokenizer.decode(ids[0].tolist(), clean_up_tokenization_spaces=False)
    assert sample.sample(config(trained, f"--prompt={PROMPT}", "--top_k=1", "--temperature=1.0")) == [greedy]
    assert sample.sample(config(trained, f"--prompt={PROMPT}", "--temperature=0")) == [greedy]


def test_top_k_above_the_vocabulary_is_refused_and_the_vocabulary_is_all_tokens(trained, capsys):
    """A top_k larger than the model's vocabulary is a mistake, not "all tokens" (0 says that)."""
    vocab = sample.load_checkpoint(trained["out"], "cpu")[0].config.vocab_size
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--top_k={vocab + 1}"]) == 2
    one_line(capsys, f"top_k must be at most the model's vocabulary size, {vocab:,}", f"got {vocab + 1:,}")
    assert sample.sample(config(trained, f"--top_k={vocab}")) == sample.sample(config(trained, "--top_k=0"))


def test_the_prompt_is_tokenized_as_the_training_documents_were(trained):
    """A literal "<|endoftext|>" in the prompt is text, as in every document the model trained on (and in
    evaluate.py's --text), not the document boundary."""
    from data.parts import encode_batch
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    tokenizer, eot = trained["tokenizer"], TokenCache(trained["cache"], verify=False).meta["eot_token_id"]
    text = "the end.<|endoftext|>It was"
    ids = sample.encode_prompt(tokenizer, text, model, trained["cache"])[0].tolist()
    assert ids + [eot] == encode_batch({"text": [text]}, tokenizer, eot)["ids"][0] and eot not in ids


def test_long_prompt_is_cropped_to_the_context(trained):
    long_prompt = "the " * 100  # more tokens than the 64-token context
    assert len(trained["tokenizer"].encode(long_prompt)) > 64
    [text] = sample.sample(config(trained, f"--prompt={long_prompt}", "--top_k=1"))
    assert text.startswith(long_prompt) and len(text) > len(long_prompt)


def test_empty_prompt_starts_a_document(trained):
    """An empty prompt continues the cache's end-of-text token (what precedes every training document), and
    that token is not part of the text."""
    eot = TokenCache(trained["cache"], verify=False).meta["eot_token_id"]
    assert trained["tokenizer"].convert_ids_to_tokens(eot) == "<|endoftext|>"
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    ids = torch.tensor([[eot]])
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    expected = trained["tokenizer"].decode(ids[0, 1:].tolist(), clean_up_tokenization_spaces=False)
    [text] = sample.sample(config(trained, "--prompt=", "--max_new_tokens=20", "--temperature=0"))
    assert text == expected and text and not text.startswith("<|endoftext|>")


def test_cli_prints_samples(trained, capsys):
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--prompt={PROMPT}",
                        "--max_new_tokens=5", "--num_samples=2"]) == 0
    out = capsys.readouterr().out
    assert out.count(PROMPT) == 2 and out.count("-" * 40) == 2


def test_export_hf_loads_in_transformers_with_equal_logits(trained, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM
    folder = tmp_path / "hf"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([hf_tokenizer.encode(PROMPT, add_special_tokens=False)])
    assert ids[0].tolist() == trained["tokenizer"].encode(PROMPT)
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


def test_init_from_checks_the_weights_transformers_loads_and_refuses_a_tensor_they_lack(trained, tmp_path,
                                                                                        monkeypatch):
    """An export sharded again beside a stale model.safetensors that lacks a tensor: transformers loads the single
    file (before the index), so the shape check reads that one too; and a tensor that from_pretrained would
    initialize at random is refused even where the shape check cannot read the files."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    folder, lacking = tmp_path / "hf", "model.layers.0.mlp.down_proj.weight"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    single = folder / "model.safetensors"
    stale = {k: v for k, v in load_file(single).items() if k != lacking}
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, max_shard_size="100KB")
    save_file(stale, single, metadata={"format": "pt"})
    assert (folder / "model.safetensors.index.json").is_file() and hf.weight_files(folder) == [single]
    with pytest.raises(ValueError, match=f"init_from '{folder}': its weights do not match config.json: the weights "
                                         f"lack {lacking}"):
        checkpoint.initial_weights(folder)
    monkeypatch.setattr(hf, "stored_shapes", lambda folder: None)  # headers the shape check cannot read
    with pytest.raises(ValueError, match=f"init_from '{folder}': the weights transformers loads from it lack: "
                                         f"{lacking}; export the folder again"):
        checkpoint.initial_weights(folder)


def test_a_failed_export_leaves_the_folder_as_it_was(trained, tmp_path, monkeypatch):
    """A crash between the weights and the tokenizer left a folder that loaded neither way."""
    folder = tmp_path / "hf"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    from transformers import PreTrainedTokenizerFast  # what sample.load_tokenizer gives

    def disk_full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", disk_full)
    monkeypatch.setattr(sample, "to_hf", lambda m, _to_hf=hf.to_hf, **ids: _perturbed(_to_hf(m, **ids)))
    with pytest.raises(sample.SampleError, match=f"--export_hf {folder} could not be written .*No space left"):
        sample.sample(config(trained, f"--export_hf={folder}"))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_export_stopped_among_its_renames_leaves_no_loadable_mixture_and_the_next_export_mends_it(
        trained, tmp_path, monkeypatch):
    """Files were renamed into place one by one, config.json among them, so a failure midway left new weights beside
    the earlier config.json, a folder transformers loaded as neither export. The earlier config.json goes first now
    and the new one comes last; files of the earlier export that the new one does not write go too."""
    import os
    from transformers import AutoModelForCausalLM
    folder = tmp_path / "hf"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a shard of another transformers version's export")
    replace = os.replace

    def fails_at_the_weights(src, dst):
        if str(dst).endswith("model.safetensors"):
            raise OSError(5, "Input/output error")
        replace(src, dst)
    monkeypatch.setattr(sample.os, "replace", fails_at_the_weights)
    with pytest.raises(sample.SampleError, match="could not be written"):
        sample.sample(config(trained, f"--export_hf={folder}"))
    assert not (folder / "config.json").exists() and (folder / sample.EXPORT_MARK).is_file()
    with pytest.raises((OSError, ValueError)):  # transformers: no config.json, no model
        AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.setattr(sample.os, "replace", replace)
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    assert not (folder / "model-00001-of-00002.safetensors").exists()
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    ids = torch.tensor([trained["tokenizer"].encode(PROMPT)])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits, model(ids),
                                   atol=1e-4, rtol=0)


def test_export_refuses_a_transformers_folder_of_the_users_own(trained, tmp_path, capsys):
    """Any Llama folder that save_pretrained wrote passed for an earlier export and was replaced unasked."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path / "mine"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    trained["tokenizer"].save_pretrained(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    capsys.readouterr()  # save_pretrained's progress bar
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 2
    one_line(capsys, f"--export_hf {folder} is not an earlier export of sample.py", sample.EXPORT_MARK)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_data_dir_given_at_the_default_path_is_the_folder_given(trained, tmp_path, monkeypatch, capsys):
    """--data_dir=data/cache/gutenberg (the training default) was taken for "not given": the run's own cache
    decoded, and a cache with another tokenizer at that path was not refused."""
    other = tokenized_cache(tmp_path / "data" / "cache" / "gutenberg", bpe_tokenizer(trained["text"][8_000:16_000],
                                                                                     280), trained["text"][:20_000])
    monkeypatch.chdir(tmp_path)
    assert other.resolve() == (tmp_path / settings.defaults(settings.TrainSettings)["data_dir"]).resolve()
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", "--data_dir=data/cache/gutenberg"]) == 2
    one_line(capsys, "whose tokenizer differs from the one in data/cache/gutenberg")


def test_a_damaged_tokenizer_is_one_line(trained, tmp_path, capsys):
    import shutil
    cache = shutil.copytree(trained["cache"], tmp_path / "cache")
    (cache / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--data_dir={cache}"]) == 2
    one_line(capsys, f"the tokenizer in {cache} could not be loaded")


class FixedLogits(torch.nn.Module):
    """A model whose next-token logits are always `logits`, for generate()."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits)
        self.config = type("Config", (), {"max_seq_len": 8})()

    def forward(self, idx):
        return self.logits.expand(idx.shape[0], idx.shape[1], -1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_tokens_are_drawn_from_the_softmax_of_the_logits_over_the_temperature(temperature):
    logits = [0.0, 1.0, 2.0, -1.0]
    rows = 20_000
    out = sample.generate(FixedLogits(logits), torch.zeros(rows, 1, dtype=torch.long), 1, temperature, top_k=0,
                          generator=torch.Generator().manual_seed(0))
    seen = torch.bincount(out[:, 1], minlength=4).float() / rows
    expected = torch.softmax(torch.tensor(logits) / temperature, dim=0)
    torch.testing.assert_close(seen, expected, atol=0.015, rtol=0)  # about 4 standard errors at 20,000 rows
    top2 = sample.generate(FixedLogits(logits), torch.zeros(rows, 1, dtype=torch.long), 1, temperature, top_k=2,
                           generator=torch.Generator().manual_seed(0))
    assert set(top2[:, 1].tolist()) == {1, 2}


def test_an_export_folder_that_cannot_be_made_is_one_line(trained, tmp_path, capsys):
    (tmp_path / "afile").write_text("a file, not a folder")
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={tmp_path / 'afile' / 'hf'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--export_hf" in err[0] and "cannot be made" in err[0], err


def _perturbed(hf):
    with torch.no_grad():
        next(hf.parameters()).add_(1.0)  # so that new weights would differ from the exported ones
    return hf


def test_missing_checkpoint_and_tokenizer_are_one_line_errors(trained, tmp_path, capsys):
    assert sample.main([f"--out_dir={tmp_path / 'nothing'}", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no checkpoint at ") and "ckpt.pt" in err and "train.py" in err
    assert err.count("\n") == 1 and "Traceback" not in err

    # The same checkpoint pointing at a cache folder without a tokenizer.
    ckpt = torch.load(trained["out"] / "ckpt.pt", weights_only=False)
    bare = write_cache(tmp_path / "bare", [1, 2, 3], [1, 2], vocab_size=300)
    ckpt["config"]["data_dir"] = str(bare)
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    assert sample.main([f"--out_dir={tmp_path / 'run'}", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no tokenizer in {bare}") and "data/prepare.py" in err
    assert err.count("\n") == 1


def test_bad_settings_are_errors(trained, capsys):
    assert sample.main([f"--out_dir={trained['out']}", "--temperature=-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert sample.main([f"--out_dir={trained['out']}", "--num_samples=0"]) == 2
    assert "num_samples" in capsys.readouterr().err
    assert sample.main([f"--out_dir={trained['out']}", "--temperature=1e-40"]) == 2  # logits / t would overflow
    assert "at least 0.001" in capsys.readouterr().err
    a_file = trained["root"] / "a-file"
    a_file.write_text("not a folder")
    assert sample.main([f"--out_dir={trained['out']}", f"--export_hf={a_file}"]) == 2
    assert "is a file" in capsys.readouterr().err and a_file.read_text() == "not a folder"


def test_a_corrupt_checkpoint_is_one_line_error(tmp_path, capsys):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert sample.main([f"--out_dir={tmp_path}", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint ") and "is it a train.py checkpoint" in err and err.count("\n") == 1


def test_the_run_data_dir_is_found_from_another_folder(trained, tmp_path, monkeypatch):
    """A checkpoint records data_dir as train.py was given it (relative to where it ran, the repository):
    sampling and scripts/parity.py both find it from another folder."""
    import os
    ckpt = torch.load(trained["out"] / "ckpt.pt", weights_only=False)
    ckpt["config"]["data_dir"] = os.path.relpath(trained["cache"], env.REPO)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    assert checkpoint.run_data_dir(ckpt).resolve() == trained["cache"].resolve()
    assert sample.main([f"--out_dir={tmp_path}", "--device=cpu", "--max_new_tokens=4", "--prompt=The"]) == 0
    from scripts import parity
    assert parity.main([f"--checkpoint={tmp_path / 'ckpt.pt'}", "--device=cpu", "--tokens=128", "--seq_len=64",
                        f"--results_file={tmp_path / 'r.json'}"]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["trained-parity"][0]["trained"] is True


class EndOfTextAt:
    """A logits processor that makes end-of-text the only choice once the sequence has `length` tokens."""

    def __init__(self, eot, length):
        self.eot, self.length = eot, length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.eot] = 0.0
        return scores


def test_the_export_ends_text_at_the_caches_end_of_text_token(trained, tmp_path):
    """With eos_token_id null in config.json, transformers' generate() would never stop by itself."""
    from transformers import LlamaForCausalLM, LogitsProcessorList
    folder = tmp_path / "hf"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    eot = TokenCache(trained["cache"], verify=False).meta["eot_token_id"]
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((folder / name).read_text())
        assert (saved["eos_token_id"], saved["bos_token_id"]) == (eot, eot), name
    hf_model = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([trained["tokenizer"].encode(PROMPT)])
    with torch.no_grad():  # the model is made to pick end-of-text as its third token: generation ends there
        out = hf_model.generate(ids, max_new_tokens=20, do_sample=False,
                                logits_processor=LogitsProcessorList([EndOfTextAt(eot, ids.shape[1] + 2)]))
    assert out.shape[1] == ids.shape[1] + 3 and out[0, -1].item() == eot and eot not in out[0, :-1].tolist()
    model, _ = sample.load_checkpoint(trained["out"], "cpu")
    assert hf.to_hf(model).config.eos_token_id is None  # a caller without a cache names no end-of-text


def test_exported_files_all_have_the_mode_the_umask_gives(trained, tmp_path):
    """safetensors writes its file owner-only (0600); every exported file gets what open() gives (0644 under
    umask 022)."""
    import os
    folder = tmp_path / "hf"
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def run_on(trained, folder, data_dir):
    """The trained checkpoint copied into folder, recording data_dir as the cache it was trained on."""
    ckpt = torch.load(trained["out"] / "ckpt.pt", weights_only=False)
    ckpt["config"]["data_dir"] = str(data_dir)
    folder.mkdir(parents=True)
    torch.save(ckpt, folder / "ckpt.pt")
    return folder


def one_line(capsys, *words):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_a_cache_prepared_again_is_refused_for_samples_and_exports(trained, tmp_path, capsys):
    """The run's cache prepared again with another vocabulary: sampling decoded with the new tokenizer, and the
    export wrote the model beside a tokenizer of other ids; both exited 0."""
    import shutil
    cache = shutil.copytree(trained["cache"], tmp_path / "cache")
    run = run_on(trained, tmp_path / "run", cache)
    assert sample.main([f"--out_dir={run}", "--device=cpu", "--max_new_tokens=2"]) == 0  # as it was: fine
    tokenized_cache(cache, bpe_tokenizer(trained["text"][8_000:16_000], 280), trained["text"][:20_000])
    capsys.readouterr()
    for extra in ([], [f"--export_hf={tmp_path / 'hf'}"]):
        assert sample.main([f"--out_dir={run}", "--device=cpu", *extra]) == 2
        one_line(capsys, f"checkpoint {run / 'ckpt.pt'}", f"token cache {cache}", "prepared again",
                 "cache_identity", "--data_dir=")
    assert not (tmp_path / "hf").exists()


def test_data_dir_names_the_folder_whose_tokenizer_decodes(trained, tmp_path, capsys):
    """--data_dir was ignored unsaid: a moved cache could not be named, another tokenizer was not refused."""
    import shutil
    expected = sample.sample(config(trained, f"--prompt={PROMPT}"))
    moved = shutil.copytree(trained["cache"], tmp_path / "moved")
    run = run_on(trained, tmp_path / "run", tmp_path / "gone")  # the cache it was trained on moved away
    args = [f"--out_dir={run}", f"--prompt={PROMPT}"]
    with pytest.raises(sample.SampleError, match="no tokenizer in"):
        sample.sample(config(trained, *args))
    assert sample.sample(config(trained, *args, f"--data_dir={moved}")) == expected
    # another corpus in the run's tokenizer is fine; another tokenizer is refused while the run's cache is there
    same = tokenized_cache(tmp_path / "same", trained["tokenizer"], trained["text"][:20_000])
    assert sample.sample(config(trained, f"--prompt={PROMPT}", f"--data_dir={same}")) == expected
    other = tokenized_cache(tmp_path / "other", bpe_tokenizer(trained["text"][8_000:16_000], 280),
                            trained["text"][:20_000])
    capsys.readouterr()
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--data_dir={other}"]) == 2
    one_line(capsys, f"token cache {trained['cache']}, whose tokenizer differs from the one in {other}")


def test_export_refuses_a_folder_that_is_not_an_earlier_export(trained, tmp_path, capsys):
    """--export_hf at a token cache rewrote its tokenizer files, leaving the hash in its meta.json stale."""
    import shutil
    cache = shutil.copytree(trained["cache"], tmp_path / "cache")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"a run's checkpoint")
    for folder, words in ((cache, ["meta.json", "train.bin", "it is a token cache"]),
                          (tmp_path / "run", ["ckpt.pt", "it is a run's folder"])):
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 2
        one_line(capsys, f"--export_hf {folder}", "an earlier export", *words)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # an empty folder, and an earlier export (replaced), are what an export may write into
    (tmp_path / "empty").mkdir()
    for _ in range(2):
        assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={tmp_path / 'empty'}"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "empty").iterdir()}
    (tmp_path / "empty" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={tmp_path / 'empty'}"]) == 2
    one_line(capsys, "notes.txt")


def test_a_prompt_that_is_not_utf8_is_one_line(trained, capsys):
    """Bytes that are not UTF-8 reach argv as lone surrogates, which the tokenizer refused with a TypeError."""
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--prompt={prompt}"]) == 2
    one_line(capsys, "--prompt is not valid UTF-8", "byte 0xe9 at character 3")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a machine without a GPU")
def test_sampling_without_a_device_key_runs_where_the_user_is_and_says_which(trained, capsys):
    """`python sample.py config/20m_gh200.py` on a laptop was refused ("pass --device=cpu"): sampling a small model on
    a CPU is normal. Training a GPU recipe there is still refused."""
    assert sample.main([f"--out_dir={trained['out']}", "--prompt=The", "--max_new_tokens=3"]) == 0
    assert "parameters, cpu;" in capsys.readouterr().err
    assert sample.DEFAULTS["device"] == "auto" and settings.defaults(settings.TrainSettings)["device"] == "cuda"


def test_an_export_killed_while_it_saved_does_not_block_the_next(trained, tmp_path):
    """A first export killed (SIGKILL) before its files were in place left only its staging folder, and every
    later --export_hf to that folder was refused as "not an earlier export" until it was deleted by hand."""
    folder = tmp_path / "hf"
    (folder / f"{sample.EXPORT_STAGING}x1y2" / "nested").mkdir(parents=True)
    (folder / f"{sample.EXPORT_STAGING}x1y2" / "model.safetensors").write_bytes(b"half")
    assert sample.main([f"--out_dir={trained['out']}", "--device=cpu", f"--export_hf={folder}"]) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert "config.json" in names and not [n for n in names if n.startswith(sample.EXPORT_STAGING)]
    # staging left beside a user's file is still refused: the folder is not an export's
    (folder / f"{sample.EXPORT_STAGING}z").mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(sample.SampleError, match="holds files that an export does not write \\(notes.txt\\)"):
        sample.check_export_folder(folder)


def test_parity_mistakes_with_a_checkpoint_are_one_line(trained, tmp_path, capsys):
    """More tokens than the validation split holds failed in view(); a model that no transformers class computes
    (value embeddings) failed in to_hf with a sentence about sample.py's --export_hf."""
    from scripts import parity
    base = ["--device=cpu", "--seq_len=64", f"--results_file={tmp_path / 'r.json'}"]
    assert parity.main([f"--checkpoint={trained['out'] / 'ckpt.pt'}", "--tokens=10000000", *base]) == 2
    one_line(capsys, "--tokens 10,000,000 is more than the validation split", "give at most that")
    out = tmp_path / "ve"
    assert train.main([f"--data_dir={trained['cache']}", f"--out_dir={out}", f"--results_file={tmp_path / 't.json'}",
                       "--name=ve", "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128", "--seq_len=64",
                       "--device=cpu", "--epochs=1", "--train_subset_tokens=1024", "--tokens_per_update=512",
                       "--micro_batch_size=8", "--val_subset_tokens=512", "--full_validation=False",
                       "--value_embeddings=1"]) == 0
    capsys.readouterr()
    assert parity.main([f"--checkpoint={out / 'ckpt.pt'}", "--tokens=128", *base]) == 2
    err = one_line(capsys, "value_embeddings=1", "there is no parity to check")
    assert "--export_hf" not in err and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("change", ["lacks a tensor", "has one more", "averages a tensor the model lacks"])
def test_a_checkpoint_whose_weights_are_not_its_models_is_refused_in_one_line(trained, tmp_path, capsys, change):
    """The weights load strictly: a missing tensor would keep its random initial values, an extra one would be
    dropped, each unsaid."""
    ckpt = torch.load(trained["out"] / "ckpt.pt", weights_only=False)
    name = next(iter(ckpt["model"]))
    if change == "lacks a tensor":
        del ckpt["model"][name]
    elif change == "has one more":
        ckpt["model"]["extra.weight"] = torch.zeros(2)
    else:
        ckpt["ema"] = {"decay": 0.9, "accumulator": {"extra.weight": torch.zeros(2)}}
    (tmp_path / "run").mkdir()
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    assert sample.main([f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--max_new_tokens=2"]) == 2
    one_line(capsys, f"checkpoint {tmp_path / 'run' / 'ckpt.pt'} could not be loaded",
             "extra.weight" if change != "lacks a tensor" else name)


def test_the_lowest_temperature_the_refusal_names_is_accepted():
    assert sample.temperature_problem(1e-3) is None and sample.temperature_problem(0) is None
    assert sample.temperature_problem(9e-4) == "temperature must be 0 (greedy) or at least 0.001, got 0.0009"


def test_generation_past_the_context_sees_the_last_max_seq_len_tokens():
    """No KV cache: each step runs the context again, cropped to its last max_seq_len tokens, so a prompt longer
    than the context continues as its last max_seq_len tokens do, and each token is the argmax of the model on
    the max_seq_len tokens before it."""
    config = tiny_config(max_seq_len=8)
    m = seeded(config).eval()
    prompt = tokens(config, 1, 13)
    out = sample.generate(m, prompt, 6, temperature=0)
    assert torch.equal(out[:, :13], prompt)
    assert torch.equal(out[:, 13:], sample.generate(m, prompt[:, -8:], 6, temperature=0)[:, 8:])
    with torch.no_grad():
        for t in range(13, 19):
            assert out[0, t] == m(out[:, t - 8:t])[0, -1].argmax(), t


class Tokenizer:
    """A tokenizer stand-in with its own end-of-text id."""
    eos_token_id = 5


def test_a_caches_end_of_text_id_of_zero_is_the_one_an_empty_prompt_starts_from(tmp_path):
    """Id 0 is a real end-of-text id (the test caches', a byte vocabulary's): the cache's id wins over the
    tokenizer's eos, even when it is 0."""
    cache = write_cache(tmp_path / "cache", [1, 2, 0, 3, 4], [5, 0, 6], 256)
    assert json.loads((cache / "meta.json").read_text())["eot_token_id"] == 0
    assert sample.eot_token(Tokenizer(), cache) == 0 and sample.start_token(Tokenizer(), cache) == 0
    assert sample.eot_token(Tokenizer(), tmp_path / "no-cache") == 5  # no cache: the tokenizer's own


def test_a_config_files_data_dir_as_recorded_is_the_runs_own_cache_found_from_another_folder(tmp_path, monkeypatch):
    """`python sample.py CONFIG` sets data_dir as the run recorded it (relative to the repository, where train.py
    ran): it is the run's own cache, found from any folder as checkpoint.run_data_dir finds it."""
    import os
    import types
    cache = tmp_path / "somewhere" / "cache"
    cache.mkdir(parents=True)
    recorded = os.path.relpath(cache, env.REPO)
    ckpt = {"config": {"data_dir": recorded}}
    monkeypatch.chdir(tmp_path / "somewhere")
    assert not Path(recorded).exists()  # not from here
    assert sample.tokenizer_folder(types.SimpleNamespace(data_dir=recorded), ckpt).resolve() == cache.resolve()
    assert sample.tokenizer_folder(types.SimpleNamespace(data_dir=""), ckpt).resolve() == cache.resolve()


def test_a_tokenizer_json_alone_is_a_tokenizer(tmp_path):
    """tokenizers' own file without transformers' tokenizer_config.json loads (load_tokenizer's check names
    either)."""
    text = "the cat sat on the mat and the dog sat on the log " * 40
    bpe_tokenizer(text, 280).save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    tokenizer = sample.load_tokenizer(tmp_path / "tok")
    assert tokenizer.decode(tokenizer.encode("the cat sat")) == "the cat sat"


def test_an_export_into_a_sharded_token_cache_is_refused_naming_it_a_token_cache(tmp_path):
    """A cache of shards holds meta.json and train-000000.bin, no train.bin: it is still a token cache, and the
    refusal says so."""
    folder = tmp_path / "cache"
    folder.mkdir()
    for name in ("meta.json", "train-000000.bin", "val-000000.bin", "tokenizer.json"):
        (folder / name).write_text("x")
    with pytest.raises(sample.SampleError, match=r"\): it is a token cache, and the export would replace"):
        sample.check_export_folder(folder)
