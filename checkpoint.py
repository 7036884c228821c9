"""train.py's checkpoints: what one holds, writing it atomically, reading it back for resuming, sampling and
export, and the RNG states that make a resumed run continue exactly as an uninterrupted one."""
import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch

import env
from model import ModelConfig, RemovedLever, Transformer
from optim import averaged_weights
from results import atomic_write

FILE_NAME = "ckpt.pt"  # a run's checkpoint, in its run folder (out/NAME)


def in_folder(folder):
    """The checkpoint file of the run folder `folder`."""
    return Path(folder) / FILE_NAME


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written (a full disk, a folder made read-only); the previous one is kept."""


def save(path, model, optimizer, step, state):
    """Write model, optimizer, update count, RNG states and `state` (the run's counters, recipe and config);
    a CheckpointError, in one sentence, when the folder cannot take it (atomic_write leaves the last one whole)."""
    device = next(model.parameters()).device  # the run's: its CUDA generator is the one a resume continues
    payload = dict(state, model=model.state_dict(), optimizer=optimizer.state_dict(), step=step,
                   rng=rng_state(device))
    try:
        atomic_write(path, lambda f: torch.save(payload, f))
    except OSError as exc:
        path = Path(path)
        kept = ("the previous checkpoint there is intact (--resume=True continues from it)" if path.exists()
                else "no checkpoint was written")
        raise CheckpointError(f"checkpoint {path} could not be written in out_dir {path.parent} "
                              f"({exc.strerror or exc}); {kept}: free space there, or give another --out_dir") from None


def peek(path, key):
    """One field of the checkpoint at path, the file mapped rather than read whole (the weights and the optimizer
    state are not loaded); None when there is no such file, it does not read, or it holds no such field."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # missing, truncated or foreign: nothing to peek at
        return None
    return ckpt.get(key) if isinstance(ckpt, dict) else None


def read(path, device="cpu"):
    """The checkpoint dict at path; ValueError, in one sentence, when the file cannot be read as one."""
    try:
        # weights_only=False: the checkpoint also holds numpy RNG state; it is our own file.
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which, not a traceback
        raise ValueError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); "
                         f"is it a train.py checkpoint?") from None


def to_resume(path, device, recipe, fields):
    """The checkpoint at path, if train.py wrote it (it holds `fields` of the run's state) for this recipe; else a
    ValueError saying what to do."""
    try:
        ckpt = read(path, device)
    except ValueError as exc:
        raise ValueError(f"{exc} Move it away to start afresh, or resume from another --out_dir") from None
    missing = [k for k in ("recipe", "model", "optimizer", "step", "rng", *fields)
               if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} is not one train.py wrote (it lacks {', '.join(missing[:4])}); move it "
                         f"away to start afresh, or resume from another --out_dir")
    from settings import recipe_differences
    differ = recipe_differences(ckpt["recipe"], recipe)
    if differ:
        values = [f"{k} {ckpt['recipe'].get(k)!r} (the checkpoint's) against {recipe.get(k)!r}" for k in differ]
        raise ValueError(f"checkpoint {path} was trained with another recipe; fields that differ: "
                         f"{'; '.join(values)}. Resume with the same recipe, or start a new --name")
    return ckpt


def load_model(path):
    """(Transformer with the weights of a train.py checkpoint, the checkpoint dict), on the CPU.

    The weights are the run's result: with ema, the weights' average its validations and final evaluation scored
    (what sampling, export, evaluation and init_from then take), else the trained weights themselves; the trained
    ones stay ckpt["model"], which a resume continues. ValueError, in one sentence, when the file is missing or is
    not such a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}; train.py saves one at out/NAME/ckpt.pt")
    ckpt = read(path)
    try:
        model = Transformer(ModelConfig.from_dict(ckpt["model_config"]))
        loaded = model.load_state_dict(ckpt["model"], strict=False)  # checked here, for a one-line message
        if loaded.missing_keys or loaded.unexpected_keys:
            raise KeyError(f"its weights lack {loaded.missing_keys[0]}" if loaded.missing_keys else
                           f"its weights hold {loaded.unexpected_keys[0]}, which the model lacks")
        if ckpt.get("ema"):  # its names are the model's parameters (the tied head is the embedding's)
            unknown = model.load_state_dict(averaged_weights(ckpt["ema"], ckpt["step"]), strict=False).unexpected_keys
            if unknown:
                raise KeyError(f"its weights' average holds {unknown[0]}, which the model lacks")
        ckpt["config"]["data_dir"]  # what sampling and parity read the run's tokens and tokenizer from
    except RemovedLever as exc:  # a train.py checkpoint, of code since removed: the sentence says where it is
        raise ValueError(f"checkpoint {path}: {exc}") from None
    except Exception as exc:
        raise ValueError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); "
                         f"is it a train.py checkpoint?") from None
    return model, ckpt


def run_data_dir(ckpt):
    """The run's token cache folder: as recorded, or, when that relative path is not found from here, under
    the repository (train.py runs from the repository; sampling and parity may not)."""
    recorded = Path(ckpt["config"]["data_dir"])
    if recorded.is_absolute() or recorded.exists() or not (env.REPO / recorded).exists():
        return recorded
    return env.REPO / recorded


def rng_state(device="cpu"):
    """The generators' states: the CPU's, numpy's, Python's and, for a run on a GPU, that GPU's own (not every
    visible one's: a resume where fewer are visible has no generator for the others). torch's are kept as numpy
    arrays: a resume reads the checkpoint with map_location on the run's device, which moves tensors there, and
    torch.set_rng_state takes only a CPU tensor."""
    state = {"torch": torch.get_rng_state().numpy(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device).numpy()
    return state


def set_rng_state(state, device="cpu"):
    """rng_state()'s states back, the CUDA one onto the run's own GPU `device`; also from a checkpoint that kept
    torch's as tensors (then on the run's device) or, as older ones did, a list of every visible GPU's CUDA
    states (then the entry of this device's index, if there is one)."""
    cpu = lambda s: torch.as_tensor(s, device="cpu")
    torch.set_rng_state(cpu(state["torch"]))
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    saved, device = state.get("cuda"), torch.device(device)
    if saved is None or device.type != "cuda" or not torch.cuda.is_available():
        return
    index = torch.cuda.current_device() if device.index is None else device.index
    if isinstance(saved, (list, tuple)):
        saved = saved[index] if index < len(saved) else None
    if saved is not None:
        torch.cuda.set_rng_state(cpu(saved), index)


@dataclasses.dataclass
class InitialWeights:
    """Weights to start a run from (init_from): the model shape they fix, our state dict, and its hash."""
    config: ModelConfig
    state: dict
    sha256: str
    source: str                   # "checkpoint" or "transformers"
    path: Path = None             # the checkpoint file, or the transformers folder
    cache_identity: str = None    # a checkpoint's: the token cache it was trained on, as recorded (None if not)
    data_dir: Path = None         # and that cache's folder


def initial_weights(path):
    """The weights at `path`: a transformers Llama folder (config.json beside the weights), a train.py
    checkpoint file, or a run folder holding ckpt.pt. ValueError, in one sentence, for anything else or for a
    Llama outside the tiny-llm family (hf.config_from_hf says what is outside it)."""
    path = Path(path)
    if path.is_dir() and in_folder(path).is_file():
        path = in_folder(path)
    recorded = {}
    if path.is_file():
        model, ckpt = load_model(path)
        source = "checkpoint"
        recorded = dict(cache_identity=(ckpt.get("recipe") or {}).get("cache_identity"), data_dir=run_data_dir(ckpt))
    elif path.is_dir() and (path / "config.json").is_file():
        model, source = _from_transformers(path), "transformers"
    else:
        raise ValueError(f"init_from {str(path)!r} is neither a transformers Llama folder (with config.json) nor a "
                         f"train.py checkpoint (out/NAME/ckpt.pt or its folder)")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return InitialWeights(model.config, state, weights_sha256(state), source, path, **recorded)


def _from_transformers(folder):
    import hf
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"init_from {str(folder)!r}: its config.json could not be read ({exc})") from None
    if getattr(config, "model_type", None) not in hf.MODEL_TYPES:
        raise ValueError(f"init_from {str(folder)!r} holds a {config.model_type!r} model; the tiny-llm family is "
                         f"transformers' Llama (model_type 'llama'), or Qwen3 for its qk_norm")
    try:  # outside the family: refused before the weights are read
        hf.config_from_hf(config)
    except ValueError as exc:
        raise ValueError(f"init_from {str(folder)!r}: {exc}") from None
    shapes = hf.stored_shapes(folder)
    problem = hf.weights_mismatch(config, shapes) if shapes is not None else None
    if problem:  # transformers would drop the weights config.json has no place for, or fail on a width
        raise ValueError(f"init_from {str(folder)!r}: {problem}")
    # A copy of the embedding saved as lm_head.weight is loaded untied, so that it can be compared: tying would
    # silently drop it, and a head that differs is a model outside the family.
    untied = dict(tie_word_embeddings=False) if shapes and "lm_head.weight" in shapes else {}
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not its table of missing keys: the one line below names them
    try:
        weights, info = hf.causal_lm_class(config).from_pretrained(
            folder, local_files_only=True, dtype=torch.float32, output_loading_info=True, **untied)
    except Exception as exc:  # missing or truncated weight files beside a good config.json
        raise ValueError(f"init_from {str(folder)!r}: its weights could not be loaded "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loaded_keys(folder, info)
    if untied:
        if not torch.equal(weights.lm_head.weight, weights.model.embed_tokens.weight):
            raise ValueError(f"init_from {str(folder)!r}: its lm_head.weight differs from model.embed_tokens.weight "
                             f"although config.json ties them; the tiny-llm family ties its embeddings")
        weights.config.tie_word_embeddings = True
    return hf.from_hf(weights)


def _check_loaded_keys(folder, info):
    """Refuse what from_pretrained loaded with weights missing (it initializes them at random and only prints
    so) or left over (what our export never writes)."""
    for kind, what in (("missing_keys", "lack"), ("unexpected_keys", "hold tensors the model has no place for")):
        keys = sorted(info.get(kind) or ())
        if keys:
            listed = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            raise ValueError(f"init_from {str(folder)!r}: the weights transformers loads from it {what}: {listed}; "
                             f"export the folder again")


def weights_sha256(state):
    """Hash of a state dict's names, shapes, dtypes and bytes: the initial weights' part of a recipe identity."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# ------------------------------------------------- do these weights know the token cache's tokenizer?

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Text to tokenize with both tokenizers: words, digits, punctuation, spacing and non-ASCII characters.
PROBE_TEXT = "It was the best of times, it was the worst of times.\n  1984: naïve café, 東京 - “quotes” <b>\t!"


def _meta(folder):
    """A token cache folder's meta.json as a dict ({} when it has none or it cannot be read)."""
    try:
        meta = json.loads((Path(folder) / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def has_tokenizer(folder):
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def same_tokenizer(a, b):
    """Whether the tokenizers saved in folders a and b give every text the same token ids (the same vocabulary,
    and the same ids for a probe text); None when either folder holds no tokenizer that loads."""
    hashes = [_meta(f).get("tokenizer_files_sha256") for f in (a, b)]
    if hashes[0] and hashes[0] == hashes[1]:
        return True  # data/prepare.py saved the very same files into both
    if not (has_tokenizer(a) and has_tokenizer(b)):
        return None
    from transformers import AutoTokenizer
    try:
        first, second = (AutoTokenizer.from_pretrained(str(f), local_files_only=True) for f in (a, b))
    except Exception:  # a damaged tokenizer: whoever loads it to use it says why
        return None
    return first.get_vocab() == second.get_vocab() and \
        first.encode(PROBE_TEXT, add_special_tokens=False) == second.encode(PROBE_TEXT, add_special_tokens=False)


def _same_folder(a, b):
    return Path(a).resolve() == Path(b).resolve()


def tokenizer_mismatch(what, recorded_identity, recorded_dir, folder, fix):
    """None when the token cache at `folder` tokenizes text as the cache `what` was trained on did (recorded:
    its cache_identity and folder); else one line saying why not and what to do, `fix` being the caller's own
    way out (another cache).

    The same identity is the same cache. Another cache is fine when the one trained on is still there as it was
    and both hold the same tokenizer (another corpus, say), or either holds none (nothing to compare, as for a
    transformers folder without one). The identity alone does not say which tokenizer it was, so a cache
    prepared again since, or gone, leaves nothing to compare with and is refused."""
    if not recorded_identity:
        return None  # a checkpoint that recorded none: nothing to check against
    identity = _meta(folder).get("cache_identity")
    if identity == recorded_identity:
        return None
    trained_on_is_there = _meta(recorded_dir).get("cache_identity") == recorded_identity
    if trained_on_is_there:  # so another folder: this one's identity differs
        if same_tokenizer(recorded_dir, folder) is not False:  # the same, or no tokenizer to compare (None)
            return None
        return (f"{what} was trained on the token cache {recorded_dir}, whose tokenizer differs from the one in "
                f"{folder}: the weights' token ids would mean other text; use {recorded_dir}, or {fix}")
    again = "again as it was (the same source, tokenizer and vocab_size)"
    if _same_folder(recorded_dir, folder):
        now = f"its cache_identity is now {identity[:12]}" if identity else "its meta.json is gone or unreadable"
        return (f"{what} was trained on the token cache {folder} (cache_identity {recorded_identity[:12]}), which "
                f"was prepared again since ({now}): its tokenizer may not be the one the weights know; prepare it "
                f"{again}, or {fix}")
    now = f"cache_identity {identity[:12]}" if identity else "no readable meta.json"
    return (f"{what} was trained on the token cache {recorded_dir} (cache_identity {recorded_identity[:12]}), not "
            f"{folder} ({now}), and {recorded_dir} no longer holds that cache to compare their tokenizers with; "
            f"prepare {recorded_dir} {again}, or {fix}")


def cache_mismatch(initial, cache, use="train on"):
    """For train.py's setup with init_from: None when the initial weights (InitialWeights) know the token ids of
    `cache` (a data.loader.TokenCache), else one line to refuse the run with.

    A train.py checkpoint must have been trained on this cache (the same cache_identity), or on one still there
    as it was with the same tokenizer (tokenizer_mismatch says which cases pass). A transformers folder's
    tokenizer, when it holds one, must be the cache's; without one, or a cache without one, there is nothing to
    compare (None). use: what the way out does with another cache ("train on"; evaluate.py's "evaluate on")."""
    if initial is None:
        return None
    if initial.source == "transformers":
        if same_tokenizer(initial.path, cache.path) is False:
            return (f"init_from {initial.path} holds a tokenizer that differs from the one of the token cache "
                    f"{cache.path}: its weights' token ids would mean other text; prepare a cache with its tokenizer "
                    f"(data/prepare.py --tokenizer {initial.path} ...) and {use} that")
        return None
    return tokenizer_mismatch(f"init_from {initial.path}", initial.cache_identity, initial.data_dir, cache.path,
                              f"{use} a cache prepared with its tokenizer (data/prepare.py --tokenizer FOLDER ...)")
