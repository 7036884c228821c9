"""Shared test fixtures: small token caches in the format data/prepare.py writes, and a stand-in wandb."""
import hashlib
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED_CORPUS = REPO.parent / "shared" / "data" / "gutenberg"


def assert_loss_and_gradients_match_cross_entropy(loss_of, h, w, targets):
    """loss_of(h, w, targets) (a sum over tokens), and h's and w's gradients through autograd with the loss
    scaled as the trainer scales it, against F.cross_entropy on the full logits. The fused ops store their
    gradients in forward, so the scale must reach them in backward."""
    def run(loss_fn):
        h.grad = w.grad = None
        loss = loss_fn()
        (loss * 0.25).backward()
        return loss.detach(), h.grad.clone(), w.grad.clone()
    got = run(lambda: loss_of(h, w, targets))
    expected = run(lambda: torch.nn.functional.cross_entropy(h @ w.t(), targets, reduction="sum"))
    for name, a, b in zip(("loss", "grad_h", "grad_w"), got, expected):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


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


def causal_scores(q, k):
    """(B, H, T, T) float32 scores of q, k (B, T, H, D), masked above the diagonal."""
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / math.sqrt(q.shape[-1])
    T = q.shape[1]
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def attention_forward_by_hand(q, k, v):
    """model_kernels.attention.cudnn_attention_forward in plain torch: the output (B, T, H, D) and the log-sum-exp
    (B, H, T)."""
    scores = causal_scores(q, k)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhts,bshd->bthd", torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype).contiguous(), lse


def cudnn_attention_by_hand(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                            return_debug_mask=False, scale=None):
    """aten._scaled_dot_product_cudnn_attention in plain torch (cuDNN has no CPU kernel), for q, k, v (B, H, T, D):
    its output (B, H, T, D) and log-sum-exp (B, H, T, 1), then the seven values our op does not read."""
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0 and is_causal and not return_debug_mask
    out, lse = attention_forward_by_hand(*(t.transpose(1, 2) for t in (q, k, v)))
    return (out.transpose(1, 2).contiguous(), lse.unsqueeze(-1)) + (None,) * 7


def attention_backward_by_hand(q, k, v, out, dout, lse, causal, dq, dk, dv, **unused):
    """flash-attn-4's _flash_attn_bwd in plain torch, from the saved output and log-sum-exp as it works."""
    assert causal and not unused
    probs = torch.exp(causal_scores(q, k) - lse[..., None])
    dout = dout.float()
    dv.copy_(torch.einsum("bhts,bthd->bshd", probs, dout))
    dprobs = torch.einsum("bthd,bshd->bhts", dout, v.float())
    delta = (dout * out.float()).sum(-1).transpose(1, 2)  # (B, H, T)
    dscores = probs * (dprobs - delta[..., None]) / math.sqrt(q.shape[-1])
    dq.copy_(torch.einsum("bhts,bshd->bthd", dscores, k.float()))
    dk.copy_(torch.einsum("bhts,bthd->bshd", dscores, q.float()))
    return dq, dk, dv


def unset_varlen_forward(*args, **kwargs):
    raise AssertionError("the stand-in's variable-length forward is not set: the test must set it")


@pytest.fixture
def flash_attn_4_stand_in(monkeypatch):
    """The fa4 backend's two kernels written out in plain torch: cuDNN's forward with its log-sum-exp (the aten
    op), and flash-attn-4's backward (its interface module, with _flash_attn_bwd). Both need a GPU
    (flash-attn-4's a Hopper or Blackwell one), so the CPU tests what our op passes them and does with what
    they return. That the two kernels agree on the log-sum-exp is a GPU fact: scripts/attention_microbench.py
    checks the gradients against float32 math there."""
    import types
    from model_kernels import attention
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = attention_backward_by_hand
    interface._flash_attn_fwd = unset_varlen_forward  # tests of the windows set theirs (tests/test_schedules.py)
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    monkeypatch.setattr(attention, "_cudnn_sdpa", cudnn_attention_by_hand)
    return interface


def flash_attn_4_installed():
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None


def check_execution(cfg, world_size=1):
    """train.py's settings checks, then the sequences of an update (as plan.resolve checks them)."""
    import settings
    settings.check(settings.TrainSettings, cfg)
    return settings.sequences_per_update(cfg, world_size)


def setup(cfg):
    """(cache, model config, recipe) of a one-process run of cfg, as plan.resolve makes them."""
    import plan
    p = plan.resolve(cfg, world=(0, 0, 1))
    return p.cache, p.model, p.recipe


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in wandb module (none is installed, and a real one would log): the calls its init, a run's log and
    finish were given, in order."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or types.SimpleNamespace(
        log=lambda scalars, step: calls.append(("log", step, scalars)), finish=lambda: calls.append(("finish",)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


@pytest.fixture
def fake_gpu(monkeypatch):
    """Makes torch see a CUDA GPU of the capability given to the returned function (named "NVIDIA GPU" unless
    another name is given), for the checks that read it; no kernel runs on it."""
    import torch

    def of(capability, name="NVIDIA GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return of
