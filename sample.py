"""Generate text from a trained checkpoint, or export it for any Llama-compatible tool.

    python sample.py --out_dir=out/tiny-cpu --prompt="Once upon a time" --num_samples=3
    python sample.py config/tiny_cpu.py                   # out_dir follows the config's name, as in train.py
    python sample.py --out_dir=out/tiny-cpu --export_hf=hf/tiny-cpu   # LlamaForCausalLM folder + tokenizer

The checkpoint is out_dir/ckpt.pt as train.py writes it; the tokenizer is the one data/prepare.py saved in
the run's data_dir, or in --data_dir when that names another folder (the cache moved, say). A cache prepared
again since the run trained, or another cache with another tokenizer, is refused: its token ids are not the
ones the weights know. Samples go to stdout, one after another, each followed by a line of dashes. An export
names the cache's end-of-text token as its eos and bos (config.json and generation_config.json), so
transformers' generate() stops where a document ends; it goes into a new or empty folder, or replaces an
earlier export.
"""
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

import checkpoint
import plan as plan_lib
import results
import settings
from configurator import ConfigError
from settings import RUN, Execution, Paths, Recipe, setting
from data.loader import CacheError, TokenCache, prepare_command
from data.parts import encode_text
from hf import export_problem, to_hf

# ---------------------------------------------------------------- settings (sampling's; name, out_dir, data_dir,
# device and seed mean what they mean in train.py, whose other keys a config file may set and sampling ignores)

def prompt_problem(text):
    """A prompt the tokenizer can take: bytes that are not UTF-8 reach Python's argv as lone surrogates
    (surrogateescape), which the tokenizer refuses with a TypeError that names neither the prompt nor the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"lone surrogate U+{char:04X}"
        return (f"--prompt is not valid UTF-8 text ({what} at character {exc.start}); give the prompt in UTF-8 (the "
                f"terminal's or the file's encoding)")
    return None


def temperature_problem(t):
    if not (t == 0 or t >= 1e-3):  # below, logits / temperature overflow
        return f"temperature must be 0 (greedy) or at least 0.001, got {t}"
    return None


# Each new token runs the whole context again (generate() keeps no KV cache): 100,000 tokens take minutes on a
# GPU and hours on a CPU, and a billion would run for ever, printing nothing until the end.
MAX_NEW_TOKENS = 100_000


def new_tokens_problem(n):
    if n > MAX_NEW_TOKENS:
        return (f"max_new_tokens must be at most {MAX_NEW_TOKENS:,} (each token runs the whole context again, and "
                f"the samples print at the end), got {n:,}")
    return None


def top_k_problem(top_k, vocab_size):
    """Checked once the model is loaded: a top_k above its vocabulary would silently sample among all tokens."""
    if top_k > vocab_size:
        return (f"top_k must be at most the model's vocabulary size, {vocab_size:,} (0 or {vocab_size:,}: all "
                f"tokens), got {top_k:,}")
    return None


@dataclasses.dataclass
class Sampling:
    """sampling and export"""
    prompt: str = setting("Once upon a time", '"" starts from the end-of-text token, i.e. a new document',
                          rule=prompt_problem)
    max_new_tokens: int = setting(200, f"tokens generated after the prompt (at most {MAX_NEW_TOKENS:,})",
                                  bounds=">= 0", rule=new_tokens_problem)
    temperature: float = setting(0.8, "0 is greedy decoding", rule=temperature_problem)
    top_k: int = setting(50, "sample only among the k likeliest tokens (0: all of them)", bounds=">= 0")
    num_samples: int = setting(1, "samples, one after another", bounds=">= 1")
    export_hf: str = setting("", "a folder: save the model as transformers' LlamaForCausalLM (Qwen3ForCausalLM "
                                 "with qk_norm) there, with the tokenizer (new, empty, or an earlier export)")



SampleSettings = settings.compose(
    "SampleSettings", Sampling, settings.pick(Paths, "name", "out_dir", "data_dir"),
    settings.pick(Execution, "device", device=setting("auto", "auto (a GPU if there is one, else the CPU), cuda or "
                                                              "cpu", choices=settings.DEVICES)),
    settings.pick(Recipe, "seed"),
    data_dir=setting("", "the token cache whose tokenizer encodes and decodes (\"\": the run's own; another one must "
                         "hold the same tokenizer)", RUN))
SampleSettings.rules = staticmethod(lambda cfg: check_export_folder(Path(cfg.export_hf)) if cfg.export_hf else None)
DEFAULTS = settings.defaults(SampleSettings)


class SampleError(ValueError):
    """A user mistake: a missing checkpoint or tokenizer, a bad setting. Reported in one line."""


def load_checkpoint(out_dir, device):
    """(model in eval mode on device, the checkpoint dict) from out_dir/ckpt.pt."""
    path = checkpoint.in_folder(out_dir)
    if not path.is_file():
        raise SampleError(f"no checkpoint at {path}; train one first (python train.py CONFIG --name=NAME saves "
                          f"out/NAME/ckpt.pt) or pass the --out_dir of a trained run")
    try:
        model, ckpt = checkpoint.load_model(path)
    except ValueError as exc:
        raise SampleError(str(exc)) from None
    return model.to(device).eval(), ckpt


def load_tokenizer(data_dir, vocab_size=0):
    """The tokenizer data/prepare.py saved into the token cache folder the run trained on (vocab_size, the
    model's, completes the prepare command suggested when it is missing)."""
    folder = Path(data_dir)
    if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise SampleError(f"no tokenizer in {folder} (the run's data_dir); data/prepare.py saves it there: "
                          f"{prepare_command(folder, vocab_size)}")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # a damaged file fails with whatever the parser meets (a KeyError, a TypeError)
        raise SampleError(f"the tokenizer in {folder} could not be loaded ({exc}); prepare the cache again") from None


def tokenizer_folder(cfg, ckpt):
    """The token cache folder whose tokenizer encodes and decodes: data_dir when it names another folder than the
    run's (a cache moved or copied, say), else the one the run trained on. A data_dir unset, or as the checkpoint
    records it (a config file's), is the run's own (found from here as checkpoint.run_data_dir says)."""
    if cfg.data_dir not in (ckpt["config"]["data_dir"], ""):
        return Path(cfg.data_dir)
    return checkpoint.run_data_dir(ckpt)


def check_cache(ckpt, path, data_dir):
    """Refuse a tokenizer that is not the checkpoint's: data_dir's cache must be the one the run trained on (its
    recorded cache_identity), or hold the same tokenizer as that one, which must then still be there."""
    problem = checkpoint.tokenizer_mismatch(
        f"checkpoint {path}", (ckpt.get("recipe") or {}).get("cache_identity"), checkpoint.run_data_dir(ckpt),
        data_dir, "pass --data_dir=FOLDER of a cache prepared with the run's tokenizer")
    if problem:
        raise SampleError(problem)


def eot_token(tokenizer, data_dir):
    """The end-of-text id that ends every training document: the cache's, else the tokenizer's eos (or None)."""
    try:
        eot = TokenCache(data_dir, verify=False).meta.get("eot_token_id")
    except CacheError:  # no or a damaged cache beside the tokenizer: the tokenizer's own end-of-text
        eot = None
    return eot if eot is not None else tokenizer.eos_token_id


def start_token(tokenizer, data_dir):
    """What an empty prompt starts from: the end-of-text token that ends every training document."""
    eot = eot_token(tokenizer, data_dir)
    if eot is None:
        raise SampleError("the prompt is empty and the tokenizer has no end-of-text token to start from; "
                          "give a --prompt")
    return eot


def encode_prompt(tokenizer, text, model, data_dir):
    """The prompt as (1, T) token ids on the CPU, as the cache tokenizes its text, checked against the model before
    any kernel sees them."""
    ids = encode_text(tokenizer, text) if text else [start_token(tokenizer, data_dir)]
    idx = torch.tensor([ids], dtype=torch.long)
    try:
        # On the CPU the model checks the id range (it skips that on the GPU); only the context is fed.
        model.check_input(idx[:, -model.config.max_seq_len:])
    except ValueError as exc:
        raise SampleError(f"the prompt does not fit the model: {exc}; was the checkpoint trained with this "
                          f"tokenizer?") from None
    return idx


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0, generator=None):
    """idx (B, T) extended by max_new_tokens sampled tokens; temperature 0 (or top_k 1) is greedy.

    No KV cache: each step runs the whole context again, cropped to the model's max_seq_len. For these small
    models and a few hundred tokens that takes seconds, and it keeps the model code free of inference paths.
    """
    context = model.config.max_seq_len
    for _ in range(max_new_tokens):
        logits = model(idx[:, -context:])[:, -1, :].float()
        if temperature == 0:
            next_ids = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if 0 < top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat((idx, next_ids), dim=1)
    return idx


# What an export writes (sample.export: its mark, transformers' save_pretrained of the model and of the tokenizer),
# the files a transformers version may add to them, and export()'s staging folders that a killed export leaves.
EXPORT_MARK = "tiny_llm_export.json"  # written first into each export: what --export_hf may replace
EXPORT_FILES = {EXPORT_MARK, "config.json", "generation_config.json", "model.safetensors",
                "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "tokenizer.model"}
EXPORT_STAGING = ".export-"


def is_export_file(name):
    return (name in EXPORT_FILES or name.startswith(EXPORT_STAGING)
            or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name) is not None)


def check_export_folder(folder):
    """--export_hf replaces the files of an export: the folder must be new, empty, or an earlier export (its mark,
    and nothing else than an export writes). A token cache there would get another tokenizer under its recorded
    hash; a run's folder would mix its checkpoint with an export; a transformers folder of the user's own (without
    the mark) would be replaced without being asked."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise SampleError(f"--export_hf {folder} is a file; give a folder (new or existing)")
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError as exc:
        raise SampleError(f"--export_hf {folder} cannot be read ({exc.strerror}); give a writable folder") from None
    foreign = [n for n in names if not is_export_file(n)]
    left = [n for n in names if not n.startswith(EXPORT_STAGING)]  # an export killed before its files were in place
    if not left or (not foreign and EXPORT_MARK in names):
        return
    kind = ": it is a token cache" if {"meta.json", "train.bin"} & set(names) else \
        ": it is a run's folder" if checkpoint.FILE_NAME in names else ""
    listed = ", ".join(foreign[:4] + ["..."] * (len(foreign) > 4))
    what = (f"holds files that an export does not write ({listed}){kind}" if foreign
            else f"is not an earlier export of sample.py (it has no {EXPORT_MARK}, nor has an export that an older "
                 f"sample.py wrote: remove such a folder first)")
    raise SampleError(f"--export_hf {folder} {what}, and the export would replace its files; give a new or empty "
                      f"folder, or an earlier export")


def export(model, tokenizer, folder, eot_token_id=None):
    """Save transformers' LlamaForCausalLM of this model and the tokenizer into folder; generate() stops at
    eot_token_id.

    Both are written into a temporary folder inside it, then renamed into place file by file, the earlier
    config.json removed first and the new one renamed last: a crash leaves whole files and no config.json (which
    transformers refuses to load, rather than load old weights with a new config) until the next export. Files of
    the earlier export that this one does not write (another transformers version's) are removed."""
    # Documents are joined by end-of-text, so that token is also what precedes each one: bos as well as eos, and
    # generate() without a prompt starts from it as an empty --prompt does. No pad id: Llama makes pad_token_id
    # its embedding's padding_idx, whose lookups pass no gradient, and this id is a real token of every document;
    # generate() pads with eos when it has no pad id.
    if export_problem(model.config):  # a lever no transformers class computes
        raise SampleError(export_problem(model.config))
    hf = to_hf(model, bos_token_id=eot_token_id, eos_token_id=eot_token_id)
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SampleError(f"--export_hf {folder} cannot be made ({exc.strerror}); give a writable folder") from None
    for killed in folder.glob(EXPORT_STAGING + "*"):  # what an export killed while it saved left
        shutil.rmtree(killed, ignore_errors=True)
    try:
        with tempfile.TemporaryDirectory(dir=folder, prefix=EXPORT_STAGING) as staging:
            hf.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            written = sorted(Path(staging).iterdir(), key=lambda p: p.name == "config.json")  # config.json last
            results.atomic_write_text(folder / EXPORT_MARK, json.dumps({"written_by": "tiny-llm sample.py"}) + "\n")
            for old in [folder / "config.json"] + [p for p in folder.iterdir() if is_export_file(p.name)
                                                   and p.name not in {EXPORT_MARK, *(w.name for w in written)}
                                                   and not p.name.startswith(EXPORT_STAGING)]:
                old.unlink(missing_ok=True)
            for path in written:
                os.chmod(path, results.new_file_mode())  # safetensors writes its file owner-only; the rest get this
                os.replace(path, folder / path.name)
    except (OSError, SafetensorError) as exc:  # a full disk: safetensors' own error, not an OSError
        raise SampleError(f"--export_hf {folder} could not be written ({exc}); free space or give another folder, "
                          f"and export again") from None
    print(f"exported {folder}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}) "
          f"and AutoTokenizer.from_pretrained({str(folder)!r})", file=sys.stderr)


def sample(cfg):
    """The configured samples as texts (each the prompt and its continuation); with export_hf, export instead."""
    settings.check(SampleSettings, cfg)
    device = plan_lib.resolve_device(cfg)
    out_dir = plan_lib.run_dir(cfg)
    model, ckpt = load_checkpoint(out_dir, device)
    data_dir = tokenizer_folder(cfg, ckpt)
    tokenizer = load_tokenizer(data_dir, model.config.vocab_size)
    check_cache(ckpt, checkpoint.in_folder(out_dir), data_dir)
    if cfg.export_hf:
        export(model, tokenizer, cfg.export_hf, eot_token(tokenizer, data_dir))
        return []
    if problem := top_k_problem(cfg.top_k, model.config.vocab_size):
        raise SampleError(problem)
    print(f"{checkpoint.in_folder(out_dir)}: update {ckpt.get('step')}, epoch {ckpt.get('epoch')}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, {device}; tokenizer of {data_dir}",
          file=sys.stderr)
    idx = encode_prompt(tokenizer, cfg.prompt, model, data_dir)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    out = generate(model, idx.to(device).repeat(cfg.num_samples, 1), cfg.max_new_tokens, cfg.temperature,
                   cfg.top_k, generator)
    start = 0 if cfg.prompt else 1  # an empty prompt's start token is not text
    # Decode the prompt and continuation together: a byte-level token may finish a character the prompt began.
    return [tokenizer.decode(row[start:].tolist(), clean_up_tokenization_spaces=False) for row in out.cpu()]


def main(argv):
    try:
        cfg = settings.load(SampleSettings, argv)
        texts = sample(cfg)  # which checks the settings
    except (ConfigError, SampleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    for text in texts:
        print(text)
        print("-" * 40, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
