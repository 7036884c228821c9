"""Evaluate weights on the full validation split of a token cache, or on a text file: loss, perplexity and bits per
byte, recorded under evaluation.NAME in the results file. nanoGPT's eval_only, as a script of its own.

    python evaluate.py --init_from=out/tiny-cpu                 # a checkpoint: the cache it trained on, val split
    python evaluate.py --init_from=out/hf/tiny-cpu --data_dir=data/cache/gutenberg-4k    # an export (sample.py)
    python evaluate.py --init_from=out/tiny-cpu --text=notes.txt                         # any UTF-8 text file

init_from is a train.py checkpoint (ckpt.pt or its run folder) or a transformers Llama folder, as train.py takes
it. The cache's tokenizer must be the weights' (as sample.py and train.py refuse another one); a checkpoint's cache
is the one it trained on unless --data_dir names another, an export records none (--data_dir names it).

What is scored. The validation split: every token of the cache's validation split after the first, in windows of
seq_len tokens that do not overlap, as train.py's full validation scores them (the same loss). A text file: one
document, tokenized as data/prepare.py tokenizes one (the cache's tokenizer; a literal <|endoftext|> in it is text)
and followed by the end-of-text token as in a cache; it is preceded by an end-of-text token too, as every document
of a cache but the first is, so that each of its tokens is scored (lm-evaluation-harness's rolling log-likelihood
starts from the same token), and the end-of-text after it is scored as well. End-of-text tokens are scored and are no text.

Bits per byte = the scored tokens' losses summed in nats / ln 2 / the UTF-8 bytes of the text they are: a text
file's bytes as they are on disk; for the validation split, the bytes of its scored tokens as the cache's
tokenizer decodes them (end-of-text and other special tokens count none). On a GPU the pass runs under bf16
autocast (as train.py validates), on the CPU in float32.
"""
import dataclasses
import hashlib
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import checkpoint
import env
import model as model_lib
import plan as plan_lib
import results
import settings
import trainer
from configurator import ConfigError
from data.loader import TokenCache, eval_batch_count, eval_batches
from data.parts import encode_text
from model_kernels.attention import resolve_backend
from settings import MODEL, RUN, WEIGHTS, Execution, ModelShape, Paths, setting

SECTION = "evaluation"  # results[SECTION][name]
DEFAULT_DATA_DIR = settings.field_of(Paths, "data_dir").default
DECODE_PIECE = 1 << 20  # tokens decoded at a time to count the validation split's bytes


@dataclasses.dataclass
class Evaluation:
    """what is evaluated"""
    text: str = setting("", "a UTF-8 text file to evaluate on, as one document (\"\": the cache's full "
                            "validation split)", RUN)


EvaluateSettings = settings.compose(
    "EvaluateSettings", Evaluation, settings.pick(Paths, "init_from", "data_dir", "name", "results_file"),
    settings.pick(ModelShape, "seq_len"), settings.pick(Execution, "device", "eval_batch_size"),
    init_from=setting("", "the weights: a train.py checkpoint (ckpt.pt or its run folder) or a transformers Llama "
                          "folder (sample.py --export_hf's)", WEIGHTS),
    data_dir=setting("", f"the token cache: its validation split, and its tokenizer (\"\": a checkpoint's own cache; "
                         f"for a transformers folder, which records none, {DEFAULT_DATA_DIR})", RUN),
    name=setting("", "the entry's name under evaluation. in the results file (\"\": init_from, and :TEXT with a "
                     "text file)", RUN),
    seq_len=setting(0, "tokens per scored window (0: the context the weights were trained with)", MODEL,
                    bounds=">= 0"),
    device=setting("auto", "auto (a GPU if there is one, else the CPU; the first line says which), cuda or cpu",
                   choices=settings.DEVICES))


def _needs_weights(cfg):
    if not cfg.init_from:
        raise ConfigError("init_from is not set: give the weights to evaluate, --init_from=out/NAME (a train.py "
                          "run) or --init_from=FOLDER (a transformers Llama folder, as sample.py --export_hf writes)")


EvaluateSettings.rules = staticmethod(_needs_weights)


# ---------------------------------------------------------------- the weights, the cache and its tokenizer

def load_weights(cfg):
    """plan.load_initial_weights, without transformers' progress bar for an export's weights: a line that would
    stand before an error's one line, for weights that load in a moment."""
    from transformers.utils import logging as hf_logging
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return plan_lib.load_initial_weights(cfg)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def data_folder(cfg, initial):
    """The cache: data_dir when given (even at train.py's default path), else a checkpoint's own (as recorded,
    found from here); an export records none, so then train.py's default, which must hold one."""
    if cfg.data_dir:
        return Path(cfg.data_dir)
    if initial.data_dir is not None:
        return initial.data_dir
    folder = Path(DEFAULT_DATA_DIR)
    if not (folder / "meta.json").is_file():
        raise ConfigError(f"init_from {initial.path} is a transformers folder, which records no token cache, and "
                          f"{folder} (train.py's default cache) holds none; pass --data_dir=FOLDER, a cache prepared "
                          f"with its tokenizer")
    return folder


def open_data(cfg, initial):
    """(the cache, its tokenizer, its end-of-text id) for these weights: the same tokenizer as theirs, or refused."""
    folder = data_folder(cfg, initial)
    # the validation split's tokens are read, so checked against meta.json; a text file needs only the tokenizer
    cache = TokenCache(folder, verify=not cfg.text, vocab_size=initial.config.vocab_size)
    mismatch = checkpoint.cache_mismatch(initial, cache, use="evaluate on")
    if mismatch:
        raise ConfigError(mismatch)
    if cache.vocab_size > initial.config.vocab_size:
        raise ConfigError(f"the token cache {folder} has {cache.vocab_size} tokens but the weights' vocabulary holds "
                          f"{initial.config.vocab_size}; evaluate on a cache prepared with their tokenizer")
    tokenizer = load_tokenizer(folder)
    eot = cache.meta.get("eot_token_id")
    return cache, tokenizer, eot if eot is not None else tokenizer.eos_token_id


def load_tokenizer(folder):
    if not checkpoint.has_tokenizer(folder):
        raise ConfigError(f"the token cache {folder} holds no tokenizer, which counts the bytes of what is scored "
                          f"and encodes a text file; prepare it with data/prepare.py, which saves one there")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # a damaged tokenizer file
        raise ConfigError(f"the tokenizer in {folder} could not be loaded ({type(exc).__name__}: {exc}); prepare "
                          f"the cache again") from None


# ---------------------------------------------------------------- what is scored

def read_text(path):
    """A text file's contents, strictly UTF-8; a missing, empty or non-UTF-8 file is one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"text {str(path)!r} is not a file; give a UTF-8 text file to evaluate on")
    try:
        data = path.read_bytes()
    except OSError as exc:  # no permission, say
        raise ConfigError(f"text {path} cannot be read ({exc.strerror}); give a readable UTF-8 text file") from None
    if not data:
        raise ConfigError(f"text {path} is empty: it holds no text to evaluate on")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"text {path} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); convert "
                          f"it, e.g. iconv -f LATIN1 -t UTF-8") from None


def text_tokens(tokenizer, text, eot):
    """The document as data/prepare.py's encode_batch tokenizes one (its end-of-text after it), preceded by the
    end-of-text token that comes before every document of a cache but the first: all its tokens are targets."""
    if eot is None:
        raise ConfigError("the cache's tokenizer has no end-of-text token to start and end the document with")
    return np.array([eot, *encode_text(tokenizer, text), eot], dtype=np.int64)


def decoded_bytes(tokenizer, tokens, eot):
    """UTF-8 bytes of the text that tokens decode to, special tokens none. Decoded in pieces of about DECODE_PIECE
    tokens, each cut after an end-of-text token (no character spans one), else whole."""
    cuts = np.flatnonzero(np.asarray(tokens) == eot) + 1 if eot is not None else np.zeros(0, np.int64)
    total, start = 0, 0
    while start < len(tokens):
        later = np.searchsorted(cuts, start + DECODE_PIECE)
        end = int(cuts[later]) if later < len(cuts) else len(tokens)
        text = tokenizer.decode(np.asarray(tokens[start:end]).tolist(), skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)
        total += len(text.encode("utf-8"))
        start = end
    return total


def scored(cfg, cache, tokenizer, eot):
    """(the tokens whose every token after the first is a target, their text's UTF-8 bytes, what they are)."""
    if cfg.text:
        text = read_text(cfg.text)
        data = {"text": str(cfg.text), "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
        return text_tokens(tokenizer, text, eot), len(text.encode("utf-8")), data
    return cache.val, decoded_bytes(tokenizer, cache.val[1:], eot), {"split": "val"}


# ---------------------------------------------------------------- the pass

def build_model(initial, seq_len, device):
    """The weights as our model with a context of seq_len, in eval mode on device; (model, attention backend)."""
    attention, _ = resolve_backend("auto", torch.device(device))  # train.py's default: its validation's kernels
    model = model_lib.Transformer(dataclasses.replace(initial.config, max_seq_len=seq_len),
                                  attention_backend=attention)
    model.load_state_dict(initial.state)
    return model.to(device).eval(), attention


def score(model, tokens, seq_len, batch_size, device):
    """trainer.mean_token_loss over the tokens' windows, under bf16 autocast on a GPU; with a progress bar."""
    from tqdm import tqdm
    batch_size = min(batch_size, -(-(len(tokens) - 1) // seq_len))  # no batch of padding rows only
    batches = tqdm(eval_batches(tokens, seq_len, batch_size), total=eval_batch_count(len(tokens), seq_len, batch_size),
                   desc="evaluation", unit="batch", leave=False)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
    return trainer.mean_token_loss(model, batches, device, dtype), dtype


def bits_per_byte(loss, tokens, n_bytes):
    return loss * tokens / math.log(2) / n_bytes if n_bytes else None


def evaluate(cfg):
    """Evaluate cfg's weights on its data; records and returns the entry."""
    settings.check(EvaluateSettings, cfg)
    results.check_writable(cfg.results_file, sections=[SECTION])  # where the entry goes, before the pass
    device = plan_lib.resolve_device(cfg)
    initial = load_weights(cfg)
    cache, tokenizer, eot = open_data(cfg, initial)
    tokens, n_bytes, data = scored(cfg, cache, tokenizer, eot)
    seq_len = cfg.seq_len or initial.config.max_seq_len
    if seq_len > initial.config.max_seq_len:
        print(f"warning: seq_len {seq_len} is longer than the {initial.config.max_seq_len} tokens of context the "
              f"weights were trained with: positions past it are new to them", file=sys.stderr)
    model, attention = build_model(initial, seq_len, device)
    parameters = sum(p.numel() for p in model.parameters())
    what = f"text {cfg.text}" if cfg.text else f"the validation split of {cache.path}"
    print(f"{initial.path} ({initial.source}, {initial.sha256[:12]}, {parameters:,} parameters) on {what}: "
          f"{len(tokens) - 1:,} tokens in windows of {seq_len}, {device}, attention {attention}", file=sys.stderr)
    start = time.time()
    result, dtype = score(model, tokens, seq_len, cfg.eval_batch_size, device)
    seconds = time.time() - start
    name = cfg.name or str(Path(cfg.init_from)) + (f":{cfg.text}" if cfg.text else "")
    entry = dict(result, perplexity=math.exp(min(result["loss"], 700.0)),
                 bits_per_byte=bits_per_byte(result["loss"], result["tokens"], n_bytes), bytes=n_bytes,
                 weights={"path": str(initial.path), "source": initial.source, "sha256": initial.sha256,
                          "parameters": parameters},
                 data=dict(data, cache=str(cache.path), cache_identity=cache.identity), seq_len=seq_len,
                 device=device, autocast=str(dtype).removeprefix("torch.") if dtype else None, attention=attention,
                 seconds=seconds, tokens_per_second=result["tokens"] / max(seconds, 1e-9), timestamp=time.time(),
                 fingerprint=env.fingerprint(cache.identity))
    results.record(cfg.results_file, [SECTION, name], entry)
    bpb = f"{entry['bits_per_byte']:.4f}" if n_bytes else "no"
    print(f"{name}: loss {entry['loss']:.4f} (std {entry['loss_std']:.4f}), perplexity {entry['perplexity']:.2f}, "
          f"{bpb} bits per byte over {entry['tokens']:,} tokens and {n_bytes:,} bytes "
          f"({seconds:.1f} s); recorded in {cfg.results_file} as {SECTION}.{name}")
    return entry


def main(argv):
    try:
        cfg = settings.load(EvaluateSettings, argv)  # evaluate() checks it
        evaluate(cfg)
    except plan_lib.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
