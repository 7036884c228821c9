"""train.py's checkpoints: what one holds, writing it atomically, reading it back for resuming, sampling and
export, and the RNG states that make a resumed run continue exactly as an uninterrupted one."""
import dataclasses
import hashlib
import random
from pathlib import Path

import numpy as np
import torch

import env
from model import ModelConfig, Transformer
from results import atomic_write


def save(path, model, optimizer, step, state):
    """Write model, optimizer, update count, RNG states and `state` (the run's counters, recipe and config)."""
    payload = dict(state, model=model.state_dict(), optimizer=optimizer.state_dict(), step=step, rng=rng_state())
    atomic_write(path, lambda f: torch.save(payload, f))


def read(path, device="cpu"):
    """The checkpoint dict at path; ValueError, in one sentence, when the file cannot be read as one."""
    try:
        # weights_only=False: the checkpoint also holds numpy RNG state; it is our own file.
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which, not a traceback
        raise ValueError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); "
                         f"is it a train.py checkpoint?") from None


def load_model(path):
    """(Transformer with the weights of a train.py checkpoint, the checkpoint dict), on the CPU.

    ValueError, in one sentence, when the file is missing or is not such a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}; train.py saves one at out/NAME/ckpt.pt")
    ckpt = read(path)
    try:
        model = Transformer(ModelConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        ckpt["config"]["data_dir"]  # what sampling and parity read the run's tokens and tokenizer from
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


def rng_state():
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclasses.dataclass
class InitialWeights:
    """Weights to start a run from (init_from): the model shape they fix, our state dict, and its hash."""
    config: ModelConfig
    state: dict
    sha256: str
    source: str


def initial_weights(path):
    """The weights at `path`: a transformers Llama folder (config.json beside the weights), a train.py
    checkpoint file, or a run folder holding ckpt.pt. ValueError, in one sentence, for anything else or for a
    Llama outside the tiny-llm family (hf.config_from_hf says what is outside it)."""
    path = Path(path)
    if path.is_dir() and (path / "ckpt.pt").is_file():
        path = path / "ckpt.pt"
    if path.is_file():
        model, _ = load_model(path)
        source = "checkpoint"
    elif path.is_dir() and (path / "config.json").is_file():
        model, source = _from_transformers(path), "transformers"
    else:
        raise ValueError(f"init_from {str(path)!r} is neither a transformers Llama folder (with config.json) nor a "
                         f"train.py checkpoint (out/NAME/ckpt.pt or its folder)")
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return InitialWeights(model.config, state, weights_sha256(state), source)


def _from_transformers(folder):
    import hf
    from transformers import AutoConfig, LlamaForCausalLM
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"init_from {str(folder)!r}: its config.json could not be read ({exc})") from None
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"init_from {str(folder)!r} holds a {config.model_type!r} model; the tiny-llm family is "
                         f"transformers' Llama (model_type 'llama')")
    try:  # outside the family: refused before the weights are read
        hf.config_from_hf(config)
    except ValueError as exc:
        raise ValueError(f"init_from {str(folder)!r}: {exc}") from None
    try:
        weights = LlamaForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except Exception as exc:  # missing or truncated weight files beside a good config.json
        raise ValueError(f"init_from {str(folder)!r}: its weights could not be loaded "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    return hf.from_hf(weights)


def weights_sha256(state):
    """Hash of a state dict's names, shapes, dtypes and bytes: the initial weights' part of a recipe identity."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\0".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
