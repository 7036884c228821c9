"""Shared test fixtures: small token caches in the format data/prepare.py writes."""
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED_CORPUS = REPO.parent / "shared" / "data" / "gutenberg"


def write_cache(folder, train, val, vocab_size):
    """A token cache with meta.json as data/prepare.py writes it, from given token arrays."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    meta = {"format": 1, "tokenizer": "test", "vocab_size": vocab_size, "dtype": np.dtype(dtype).name,
            "eot_token_id": 0}
    for split, tokens in (("train", train), ("val", val)):
        data = np.asarray(tokens, dtype=dtype).tobytes()
        (folder / f"{split}.bin").write_bytes(data)
        meta[f"{split}_tokens"] = len(tokens)
        meta[f"{split}_sha256"] = hashlib.sha256(data).hexdigest()
    meta["cache_identity"] = hashlib.sha256((meta["train_sha256"] + meta["val_sha256"]).encode()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture
def text_cache(tmp_path):
    """A cache of real English text from the shared corpus, tokenized by bytes (vocabulary 256)."""
    import gzip
    if not SHARED_CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {SHARED_CORPUS}")
    books = sorted((SHARED_CORPUS / "train").glob("*.txt.gz"))[:2]
    val_book = sorted((SHARED_CORPUS / "val").glob("*.txt.gz"))[0]
    read = lambda p, n: np.frombuffer(gzip.open(p).read()[:n], dtype=np.uint8)
    train = np.concatenate([read(b, 60_000) for b in books])
    val = read(val_book, 20_000)
    return write_cache(tmp_path / "cache", train, val, 256)


@pytest.fixture
def flash_attn_4_stand_in(monkeypatch):
    """A module in flash-attn-4's place holding the two functions PyTorch's FA4 registry looks for. The kernels
    themselves need a Hopper or Blackwell GPU, so the CPU can test only the routing to them."""
    import types

    import model

    def no_kernel_here(*args, **kwargs):
        pytest.fail("a flash-attn-4 kernel was called on the CPU")

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = interface._flash_attn_bwd = no_kernel_here
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    yield interface
    model.use_flash_attention_4(False)
    forget_flash_attn_4_import()


def forget_flash_attn_4_import():
    """PyTorch caches the module its FA4 registry imported; a stand-in must not outlive its test."""
    import torch
    torch.nn.attention._fa4._fa4_import_module.cache_clear()


def flash_attn_4_installed():
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None
