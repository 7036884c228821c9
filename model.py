"""The tiny-llm model: a Llama-style decoder, its presets, its FLOP count and transformers interop.

Layout follows transformers' LlamaForCausalLM exactly (RMSNorm before attention and MLP, rotary positions
with the rotate-half convention, SwiGLU, tied embeddings, no biases), so weights map one to one. Two
projections are stored fused for speed at small widths, with the same math: q, k, v as one matrix
(`wqkv`) and the SwiGLU gate and up projections as one (`w13`). `to_hf` splits them again.
"""
import contextlib
import importlib.util
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 320
    n_layers: int = 8
    n_heads: int = 5
    hidden_dim: int = 896  # SwiGLU inner width
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model width {self.dim} is not divisible by the head count {self.n_heads}; "
                             f"choose a width that is a multiple of n_heads (heads of 64: width = 64 x n_heads)")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} (width / heads) must be even for rotary positions")

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def to_dict(self):
        return asdict(self)


PRESETS = {
    # 20,403,520 parameters: the exact shape of the system tiny-llm replaces.
    "20m": ModelConfig(),
    # 50.5M and 88.3M: the same family with heads of 64 and SwiGLU at 3x and 8/3 x width.
    "50m": ModelConfig(dim=512, n_layers=10, n_heads=8, hidden_dim=1536),
    "90m": ModelConfig(dim=768, n_layers=9, n_heads=12, hidden_dim=2048),
}

# Pinning one SDPA kernel makes a benchmark measure the kernel it names; "auto" lets PyTorch choose. "fa4" is
# not an SDPA kernel: when gradients are wanted, our own op with cuDNN's forward and flash-attn-4's backward
# (see causal_attention).
ATTENTION_BACKENDS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
    "fa4": "fa4",
}

# How the training loss is computed from the last hidden state, all with the same math:
# - "full" materializes all logits (float32 inside cross-entropy);
# - "chunked" runs the LM head and cross-entropy over slices of tokens, recomputing each slice's logits in
#   backward, so the full logits never exist at once;
# - "fused" (see linear_cross_entropy) computes the loss and its gradients in one pass over slices of
#   tokens during forward, with the logits in the autocast dtype and never in float32.
LOSS_IMPLEMENTATIONS = ("full", "chunked", "fused")


def get_preset(name, **overrides):
    """The preset called `name`, with any field replaced by `overrides` (e.g. vocab_size from the data)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def flops_per_token(config, seq_len):
    """Training FLOPs per token: 6 x matmul parameters (forward 2, backward 4) plus attention scores.

    Matmul parameters are the attention and MLP projections plus the LM head (the embedding lookup does
    no multiplication, but the tied matrix is used again as the head). The attention term counts QK^T and
    attention x V over the full T x T square, 12 x layers x width x T per token, as PaLM, nanoGPT and
    torchtitan do. Causal masking lets a flash kernel skip about half of that square; we do NOT halve it,
    so our MFU is comparable with theirs and slightly flatters attention-heavy shapes.
    """
    c = config
    per_layer = 4 * c.dim * c.dim + 3 * c.dim * c.hidden_dim
    matmul_params = c.n_layers * per_layer + c.vocab_size * c.dim
    attention = 12 * c.n_layers * c.dim * seq_len
    return 6 * matmul_params + attention


def rotary_tables(config, device=None):
    """cos and sin of shape (max_seq_len, head_dim), transformers' rotate-half layout, in float32."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** half)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def signed_sin(sin):
    """sin with its first half negated, so that rotate_half(x) * sin == cat(x2, x1) * signed_sin(sin)."""
    first, second = sin.chunk(2, dim=-1)
    return torch.cat((-first, second), dim=-1)


def apply_rotary(x, cos, sin_signed):
    """x: (B, T, ..., D); cos, sin_signed (see signed_sin): (T, D) in x's dtype.

    transformers' rotate-half, x * cos + cat(-x2, x1) * sin, with the sign moved into the table and the
    multiply-add fused: eager launches 3 kernels forward instead of 5 (it is launch-bound at small widths).
    """
    shape = (x.shape[1],) + (1,) * (x.dim() - 3) + (x.shape[-1],)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos.view(shape), torch.cat((x2, x1), dim=-1), sin_signed.view(shape))


def flash_attn_4():
    """flash-attn-4's interface module (the `flash_attn.cute` package: FlashAttention for Hopper and Blackwell,
    written in NVIDIA's CUTLASS DSL), installed apart; a missing package is a ValueError naming it."""
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except ImportError as error:
        raise ValueError(f"attention backend 'fa4' needs the flash-attn-4 package (pip install flash-attn-4), "
                         f"which did not import: {error}") from None
    if not hasattr(interface, "_flash_attn_bwd"):
        raise ValueError("attention backend 'fa4': this flash-attn-4 has no _flash_attn_bwd; "
                         "4.0.0b36 is the version measured (pip install flash-attn-4==4.0.0b36)")
    return interface


# Our own op pair: training's attention with cuDNN's forward and flash-attn-4's backward, the faster of each on
# the H200 (cuDNN's forward 0.60 against flash-attn-4's 0.75 ms per 20m update; flash-attn-4's backward 1.18
# against cuDNN's 1.56). The backward is the function that PyTorch's FA4 registry calls too
# (torch.nn.attention.activate_flash_attention_impl); that registry would put FA4 behind SDPA's flash kernel, but
# in PyTorch 2.11 it expects flash-attn-4's forward to return two tensors, and 4.0.0b20 and later return more.
# torch.compile sees each op as one opaque call, and CUDA graphs capture its kernels.
@torch.library.custom_op("tiny_llm::flash_attention_4", mutates_args=())
def _flash_attention_4_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cudnn_attention_forward(q, k, v)


# SDPA's cuDNN kernel as an op of its own, which returns the log-sum-exp that F.scaled_dot_product_attention
# keeps to itself. Named here so that the CPU tests can stand in for it: cuDNN has no CPU kernel.
_cudnn_sdpa = torch.ops.aten._scaled_dot_product_cudnn_attention


def cudnn_attention_forward(q, k, v):
    """cuDNN's causal forward with the log-sum-exp that flash-attn-4's backward takes, in its layouts: the
    output (B, T, H, D) and the log-sum-exp (B, H, T) in float32, both contiguous, as the fake says."""
    B, T, H, D = q.shape
    out, lse = _cudnn_sdpa(*(t.transpose(1, 2) for t in (q, k, v)), None, True, 0.0, True, False)[:2]
    return out.transpose(1, 2).contiguous(), lse.reshape(B, H, T).contiguous()


@_flash_attention_4_op.register_fake
def _(q, k, v):
    B, T, H, D = q.shape
    return q.new_empty(B, T, H, D), q.new_empty(B, H, T, dtype=torch.float32)


def _flash_attention_4_gradients(q, k, v):
    """dq, dk, dv, contiguous: allocated here so that the real op and its fake agree on strides whatever
    layout flash-attn-4 would choose."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


@torch.library.custom_op("tiny_llm::flash_attention_4_backward", mutates_args=())
def _flash_attention_4_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                   lse: torch.Tensor, grad_out: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _flash_attention_4_gradients(q, k, v)
    flash_attn_4()._flash_attn_bwd(q, k, v, out, grad_out, lse, causal=True, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


@_flash_attention_4_backward_op.register_fake
def _(q, k, v, out, lse, grad_out):
    return _flash_attention_4_gradients(q, k, v)


def _flash_attention_4_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _flash_attention_4_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return _flash_attention_4_backward_op(q, k, v, out, lse, grad_out)


_flash_attention_4_op.register_autograd(_flash_attention_4_backward, setup_context=_flash_attention_4_setup)


def flash_attention_4(q, k, v):
    """Causal softmax attention, forward by cuDNN and backward by flash-attn-4: q, k, v (B, T, H, D) in bf16 or
    fp16 (views with any strides but the last), the output the same shape, contiguous."""
    return _flash_attention_4_op(q, k, v)[0]


def causal_attention(q, k, v, backends):
    """q, k, v: (B, T, H, D); backends: a value of ATTENTION_BACKENDS. Returns (B, T, H, D)."""
    if backends == "fa4":
        if torch.is_grad_enabled() and q.requires_grad:
            return flash_attention_4(q, k, v)
        # Forward only (evaluation, sampling): SDPA's choice, which on the H200 is the same cuDNN forward
        # without the log-sum-exp that only a backward needs, and runs on any GPU and the CPU.
        backends = None
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D), as SDPA wants them
    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x, cos, sin, backends):
        B, T, C = x.shape
        qkv = self.wqkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        # split (not slicing and indexing, whose backward pads each gradient with zeros and adds them),
        # and q and k rotated in one pass
        qk, v = qkv.split([2, 1], dim=2)
        q, k = apply_rotary(qk, cos, sin).unbind(2)
        return self.wo(causal_attention(q, k, v.squeeze(2), backends).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)  # [gate; up]
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x):
        return swiglu_down(self.w13(x), self.w2.weight)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, backends):
        x = x + self.attention(self.attention_norm(x), cos, sin, backends)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config, attention_backend="auto", loss_impl="full", loss_chunk_tokens=8192):
        super().__init__()
        if isinstance(config, str):
            config = get_preset(config)
        self.config = config
        self.set_attention_backend(attention_backend)
        if loss_impl not in LOSS_IMPLEMENTATIONS:
            raise ValueError(f"unknown loss_impl {loss_impl!r}; valid: {', '.join(LOSS_IMPLEMENTATIONS)}")
        self.loss_impl, self.loss_chunk_tokens = loss_impl, loss_chunk_tokens
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        # Computed once here and moved with the module; recomputing them per forward cost the system we
        # replace a quarter of its GPU kernel time.
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)
        self.reset_parameters()

    def set_attention_backend(self, name):
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
        if name == "fa4":
            flash_attn_4()  # a missing package fails here, not in the first forward
        self.attention_backend = name
        self._sdpa_backends = ATTENTION_BACKENDS[name]

    def reset_parameters(self):
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def check_input(self, idx, targets=None):
        """Shape and token-id checks, run before any kernel so that a bad input is one clear error.

        The id range is checked only for CPU tensors: on the GPU it would cost a host sync per forward.
        Batches reach the GPU from the data loader, which checks ids on the CPU side first.
        """
        if idx.dim() != 2:
            raise ValueError(f"model input must be (batch, sequence) token ids, got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} is longer than the model's context "
                             f"{self.config.max_seq_len}; use at most max_seq_len tokens")
        if idx.device.type == "cpu" and idx.numel():
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}) (the vocabulary), "
                                 f"got ids from {low} to {high}")
        if targets is None:
            return
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the input's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if targets.device.type == "cpu" and targets.numel():
            counted = targets[targets != -100]
            if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= self.config.vocab_size):
                raise ValueError(f"targets must lie in [0, {self.config.vocab_size}) or be -100 (ignored), got "
                                 f"{int(counted.min())} to {int(counted.max())}")

    def hidden_states(self, idx):
        T = idx.shape[1]
        # q and k come out of the projection in the autocast dtype: cast the tables to it once per forward.
        device_type = idx.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.rope_cos.dtype
        cos, sin = self.rope_cos[:T].to(dtype), self.rope_sin_signed[:T].to(dtype)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, self._sdpa_backends)
        return self.norm(x)

    def forward(self, idx, targets=None, reduction="mean"):
        """Logits (B, T, V) without targets; else the token cross-entropy, ignoring targets of -100.

        reduction "mean" averages over the counted targets; "sum" adds them (the training step divides
        by the update's token count itself, so that a partial update weighs each token the same); "none"
        gives each position's loss, 0 where ignored (evaluation uses it for the loss's spread).
        """
        if not torch.compiler.is_compiling():
            self.check_input(idx, targets)
        h = self.hidden_states(idx)
        if targets is None:
            return self.output(h)
        return self.loss(h, targets, reduction)

    def loss(self, h, targets, reduction="mean"):
        """The LM head and cross-entropy on the last hidden state (a method of its own so that it can be
        compiled apart from the blocks)."""
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"unknown loss reduction {reduction!r}; valid: mean, sum, none")
        flat_h, flat_targets = h.flatten(0, 1), targets.flatten()
        if self.loss_impl == "fused" and not torch.is_grad_enabled():  # evaluation: no gradient to compute
            losses = linear_cross_entropy_losses(flat_h, self.output.weight, flat_targets, self.loss_chunk_tokens)
            if reduction == "none":
                return losses
            total = losses.sum()
        elif reduction == "none":
            return F.cross_entropy(self.output(flat_h).float(), flat_targets, ignore_index=-100, reduction="none")
        elif self.loss_impl == "fused":
            total = linear_cross_entropy(flat_h, self.output.weight, flat_targets, self.loss_chunk_tokens)
        elif self.loss_impl == "chunked":
            total = chunked_cross_entropy(flat_h, self.output.weight, flat_targets, self.loss_chunk_tokens)
        else:
            total = F.cross_entropy(self.output(flat_h).float(), flat_targets, ignore_index=-100, reduction="sum")
        if reduction == "sum":
            return total
        return total / (targets != -100).sum().clamp(min=1)


def _chunk_loss(h, weight, targets):
    logits = F.linear(h, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def chunked_cross_entropy(h, weight, targets, chunk_tokens):
    """Sum of cross-entropy over token slices; each slice's logits are recomputed in backward."""
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss, h[start:end], weight, targets[start:end], use_reentrant=False)
    return total


# ---------------------------------------------------------------- fused LM head + cross-entropy
#
# Why a kernel of our own rather than Liger-Kernel's fused linear cross-entropy (the library made for this):
# on the H200, for one 32,768-token update of the 20m model, Liger took 24.8 ms and this 5.4 ms
# (scripts/loss_microbench.py, docs/PERFORMANCE.md). Liger reads the count of counted targets back to the
# host (`.item()`) on every call and compares the upstream gradient with 1.0 (`torch.equal`) in backward,
# two host syncs per micro-step; and it sizes its token slices to keep the logits near the size of the
# input (512 tokens at width 320), 64 small matmuls per call. The loss here is a plain sum, so no count is
# needed, the upstream gradient scales the two small gradients instead of the logits, and the slice is ours.

def _cross_entropy_rows_torch(logits, targets, write_grad=True):
    """Per-row loss (float32) and, with write_grad, d(loss)/d(logits) written over `logits`; rows with
    target -100 get 0.

    The reference for the Triton kernel below (which does the same in one read of each row), and the
    path on CPUs and on GPUs without Triton."""
    counted = targets != -100
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    safe_targets = targets.clamp(min=0)
    target_logit = x.gather(1, safe_targets[:, None]).squeeze(1)
    losses = torch.where(counted, lse - target_logit, 0.0)
    if not write_grad:
        return losses
    grad = torch.exp(x - lse[:, None])
    grad[torch.arange(len(targets), device=logits.device), safe_targets] -= 1.0
    logits.copy_(grad * counted[:, None])
    return losses


_triton_rows = None
# How the kernel is launched: the row is held in registers when it fits in `block` columns, else read in
# `block`-column pieces (online log-sum-exp, then a second pass for the gradient). Chosen on the H200 by
# scripts/ce_rows_sweep.py over a 8,192 x 32,000 bf16 slice (docs/PERFORMANCE.md has the table).
ROWS_BLOCK, ROWS_NUM_WARPS = 8192, 8


def _cross_entropy_rows_triton(logits, targets, write_grad=True, block=None, num_warps=None):
    """The Triton kernel: one program per row, logits read once, the gradient stored in their place.

    Built on first use so that importing model.py never needs Triton (the CPU build has none)."""
    import triton
    global _triton_rows
    if _triton_rows is None:
        import triton.language as tl

        @triton.jit
        def cross_entropy_rows_kernel(logits_ptr, row_stride, targets_ptr, losses_ptr, n_cols,
                                      BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = logits_ptr + row * row_stride
            target = tl.load(targets_ptr + row)
            counted = target != -100
            # Read before any gradient is stored over it: the block-wide max below waits for every warp,
            # so no warp can overwrite the target's column before all have read it.
            target_logit = tl.load(base + tl.maximum(target, 0)).to(tl.float32)
            if ONE_BLOCK:  # the row stays in registers: read once, written once, one exp per element
                cols = tl.arange(0, BLOCK)
                mask = cols < n_cols
                x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
                row_max = tl.max(x, axis=0)
                e = tl.exp(x - row_max)
                total = tl.sum(e, axis=0)
                lse = row_max + tl.log(total)
                if WRITE_GRAD:
                    grad = e * (1.0 / total) - tl.where(cols == target, 1.0, 0.0)
                    tl.store(base + cols, tl.where(counted, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=mask)
            else:  # online log-sum-exp over blocks of the row, then a second pass for the gradient
                running_max = float("-inf")
                running_sum = 0.0
                for start in range(0, n_cols, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
                    new_max = tl.maximum(running_max, tl.max(x, axis=0))
                    running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
                    running_max = new_max
                lse = running_max + tl.log(running_sum)
                for start in range(0, n_cols if WRITE_GRAD else 0, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < n_cols
                    x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                    grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
                    tl.store(base + cols, tl.where(counted, grad, 0.0).to(logits_ptr.dtype.element_ty), mask=mask)
            tl.store(losses_ptr + row, tl.where(counted, lse - target_logit, 0.0))

        _triton_rows = cross_entropy_rows_kernel
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(n_cols), block or ROWS_BLOCK)
    num_warps = num_warps or min(ROWS_NUM_WARPS, max(4, block // 1024))  # a small vocabulary needs fewer threads
    _triton_rows[(n_rows,)](logits, logits.stride(0), targets, losses, n_cols, BLOCK=block,
                            ONE_BLOCK=n_cols <= block, WRITE_GRAD=write_grad, num_warps=num_warps)
    return losses


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # without importing it (the CPU build has none)


def _uses_triton(device):
    """Whether our Triton kernels run on this device: CUDA, with Triton installed."""
    return device.type == "cuda" and TRITON_INSTALLED


def _cross_entropy_rows(device):
    """The Triton kernel on CUDA devices where Triton is installed, else the torch reference."""
    return _cross_entropy_rows_triton if _uses_triton(device) else _cross_entropy_rows_torch


def _in_autocast_dtype(h):
    """h as F.linear would see it: in the autocast dtype when autocast is on."""
    device_type = h.device.type
    return h.to(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else h


def _linear_cross_entropy_impl(h, weight, targets, chunk_tokens):
    """(sum of token losses, d sum / d h, d sum / d weight), computed slice by slice of tokens.

    The logits are in h's dtype (the autocast dtype on the GPU) and exist one slice at a time. Both
    gradients leave the matmuls in float32 (bf16 products, float32 sums), so that backward scales them
    before the one rounding to h's dtype that F.linear's backward would also do."""
    w = weight.to(h.dtype)
    rows = _cross_entropy_rows(h.device)
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    float32_out = h.device.type == "cuda" and h.dtype != torch.float32  # a CUDA-only overload
    for start in range(0, h.shape[0], chunk_tokens):
        h_slice, grad_h_slice = h[start:start + chunk_tokens], grad_h[start:start + chunk_tokens]
        logits = h_slice @ w.t()
        total += rows(logits, targets[start:start + chunk_tokens]).sum()
        if float32_out:
            torch.mm(logits, w, out_dtype=torch.float32, out=grad_h_slice)
            torch.addmm(grad_w, logits.t(), h_slice, out_dtype=torch.float32, out=grad_w)
        else:  # CPU (or float32 on the GPU): float32 products too, so the docstring holds under CPU autocast
            logits, w32, h32 = logits.float(), w.float(), h_slice.float()
            torch.mm(logits, w32, out=grad_h_slice)
            grad_w += logits.t() @ h32
        # else the next slice's logits would be allocated while these are still held: two slices at the
        # peak (0.5 GB more at 8,192 tokens x 32,000 classes in bf16)
        del logits
    return total, grad_h, grad_w


@torch.library.custom_op("tiny_llm::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_cross_entropy_impl(h, weight, targets, chunk_tokens)


@_linear_cross_entropy_op.register_fake
def _(h, weight, targets, chunk_tokens):
    # contiguous, as the real op allocates them (empty_like would copy a non-contiguous h's strides)
    return (h.new_empty((), dtype=torch.float32), h.new_empty(h.shape, dtype=torch.float32),
            weight.new_empty(weight.shape, dtype=torch.float32))


def _linear_cross_entropy_setup(ctx, inputs, output):
    h, weight, _, _ = inputs
    ctx.dtypes = h.dtype, weight.dtype
    ctx.save_for_backward(*output[1:])


def _linear_cross_entropy_backward(ctx, grad_total, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    h_dtype, weight_dtype = ctx.dtypes
    return (grad_h * grad_total).to(h_dtype), (grad_w * grad_total).to(weight_dtype), None, None


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_backward, setup_context=_linear_cross_entropy_setup)


@torch.library.custom_op("tiny_llm::linear_cross_entropy_losses", mutates_args=())
def _linear_cross_entropy_losses_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                    chunk_tokens: int) -> torch.Tensor:
    w = weight.to(h.dtype)
    rows = _cross_entropy_rows(h.device)
    return torch.cat([rows(h[start:start + chunk_tokens] @ w.t(), targets[start:start + chunk_tokens], write_grad=False)
                      for start in range(0, h.shape[0], chunk_tokens)])


@_linear_cross_entropy_losses_op.register_fake
def _(h, weight, targets, chunk_tokens):
    return h.new_empty(h.shape[:1], dtype=torch.float32)


def linear_cross_entropy_losses(h, weight, targets, chunk_tokens):
    """Each token's cross-entropy of (h @ weight.T) (0 where the target is -100), without gradients:
    evaluation's path, with the logits in the autocast dtype one slice at a time, never in float32."""
    return _linear_cross_entropy_losses_op(_in_autocast_dtype(h), weight, targets, int(chunk_tokens))


def linear_cross_entropy(h, weight, targets, chunk_tokens):
    """Sum of cross-entropy of (h @ weight.T) against targets (-100 ignored), its gradients computed in forward.

    h: (N, C), weight: (V, C), targets: (N,). One custom op, opaque to torch.compile: it runs the LM head
    matmul, the Triton loss-and-gradient kernel and the two gradient matmuls one slice of tokens at a time,
    so neither float32 logits nor more than one slice of logits ever exist, and backward only scales the
    stored gradients. Under autocast, h and the logits are in the autocast dtype, as F.linear's would be.
    """
    return _linear_cross_entropy_op(_in_autocast_dtype(h), weight, targets, int(chunk_tokens))[0]


# ---------------------------------------------------------------- SwiGLU and the down projection
# Inductor compiles silu(gate) * up into one kernel forward, but backward writes the two gradients as one
# concatenated tensor with a kernel that loads gate, up and the upstream gradient again for each half:
# 0.96 of the 20m update's 15.9 ms (s9-20m-profile). Here one program per piece of a row reads each input
# once and writes both halves. Math as compiled: float32 inside, one rounding to the input's dtype.
#
# The op also takes in the down projection (w2), so that backward recomputes the product silu(gate) * up
# instead of keeping it: w2's weight gradient needs it, and as an input of a plain matmul it was saved
# beside gate and up, hidden_dim bf16 values per token and layer (0.44 GiB of the 20m update's 4.13 GiB
# peak). The backward kernel writes it again from the gate and up it already reads, bitwise as forward did.

def _swiglu_torch(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _swiglu_backward_torch(grad_out, x):
    """(d/d[gate, up], the product recomputed) given the upstream gradient of silu(gate) * up."""
    gate, up = x.float().chunk(2, dim=-1)
    sig, g = torch.sigmoid(gate), grad_out.float()
    grad_x = torch.cat((g * up * sig * (1 + gate * (1 - sig)), g * gate * sig), dim=-1)
    return grad_x.to(x.dtype), _swiglu_torch(x)


_triton_swiglu = None


def _swiglu_kernel():
    """The Triton kernel, both directions, built on first use (as the loss kernel is)."""
    global _triton_swiglu
    if _triton_swiglu is None:
        import triton
        import triton.language as tl

        @triton.jit
        def swiglu_kernel(x_ptr, grad_out_ptr, grad_x_ptr, out_ptr, hidden, BLOCK: tl.constexpr,
                          BACKWARD: tl.constexpr):
            """out = silu(gate) * up; backward also grad_x = d/d[gate, up], given the upstream grad_out."""
            row = tl.program_id(0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            gate_at = x_ptr + row * 2 * hidden + cols
            gate = tl.load(gate_at, mask=mask).to(tl.float32)
            up = tl.load(gate_at + hidden, mask=mask).to(tl.float32)
            sig = tl.sigmoid(gate)
            silu = gate * sig
            tl.store(out_ptr + row * hidden + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)
            if BACKWARD:
                g = tl.load(grad_out_ptr + row * hidden + cols, mask=mask).to(tl.float32)
                grad_at = grad_x_ptr + row * 2 * hidden + cols
                tl.store(grad_at, (g * up * sig * (1 + gate * (1 - sig))).to(grad_x_ptr.dtype.element_ty), mask=mask)
                tl.store(grad_at + hidden, (g * silu).to(grad_x_ptr.dtype.element_ty), mask=mask)

        _triton_swiglu = swiglu_kernel
    return _triton_swiglu


def _swiglu_launch(x, grad_out=None):
    """Launches the kernel on x of shape (..., 2 * hidden): (product,) forward, (grad_x, product) backward.
    A program per row and piece of up to 1,024 columns."""
    import triton
    hidden = x.shape[-1] // 2
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (x.numel() // x.shape[-1], triton.cdiv(hidden, block))
    out = x.new_empty(x.shape[:-1] + (hidden,))
    backward = grad_out is not None
    grad_x = torch.empty_like(x) if backward else out  # out stands in for the unused pointers forward
    torch.library.wrap_triton(_swiglu_kernel())[grid](x, grad_out if backward else out, grad_x, out, hidden,
                                                      BLOCK=block, BACKWARD=backward, num_warps=4)
    return (grad_x, out) if backward else (out,)


# triton_op, not custom_op: torch.compile traces into it and launches the kernels from its own generated code.
# An opaque custom op is called through Python on every use, 16 times per 20m update, and that made the
# compiled update host-bound: -14% in h200_s12.sh, though its kernels took 1 ms less.
@torch.library.triton_op("tiny_llm::swiglu_down", mutates_args=())
def _swiglu_down_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) for x = [gate, up]; autograd keeps x and weight only."""
    if _uses_triton(x.device):
        (product,) = _swiglu_launch(x.contiguous())
    else:
        product = _swiglu_torch(x)
    return F.linear(product, weight)


@torch.library.triton_op("tiny_llm::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not _uses_triton(x.device):
        return _swiglu_backward_torch(grad_out, x)
    return _swiglu_launch(x.contiguous(), grad_out.contiguous())


def _swiglu_down_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_down_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x, product = _swiglu_backward_op(grad_out @ weight, x)
    grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ product.reshape(-1, product.shape[-1])
    return grad_x, grad_weight


_swiglu_down_op.register_autograd(_swiglu_down_backward, setup_context=_swiglu_down_setup)


def swiglu_down(x, weight):
    """F.linear(silu(gate) * up, weight) of x = [gate, up] (the last dimension, as FeedForward.w13 makes it):
    the fused op in compiled code on CUDA, plain torch elsewhere. Eager keeps torch's kernels: it is
    launch-bound, and the op's Python dispatch costs more than the kernel it saves (-12% at micro-batch 8)."""
    if _uses_triton(x.device) and torch.compiler.is_compiling():
        # The op is outside autocast's reach, so it gets the weight as autocast would give it to F.linear.
        return _swiglu_down_op(x, weight.to(x.dtype))
    gate, up = x.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)


def load_checkpoint(path):
    """(Transformer with the weights of a train.py checkpoint, the checkpoint dict), on the CPU.

    ValueError, in one sentence, when the file is missing or is not such a checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}; train.py saves one at out/NAME/ckpt.pt")
    try:
        # weights_only=False: train.py's checkpoint also holds numpy RNG state; it is our own file.
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        model = Transformer(ModelConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        ckpt["config"]["data_dir"]  # what sampling and parity read the run's tokens and tokenizer from
    except Exception as exc:  # a truncated or foreign file: say which, not a traceback
        raise ValueError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); "
                         f"is it a train.py checkpoint?") from None
    return model, ckpt


def run_data_dir(ckpt):
    """The run's token cache folder: as recorded, or, when that relative path is not found from here, under
    the repository (train.py runs from the repository; sampling and parity may not)."""
    import env
    recorded = Path(ckpt["config"]["data_dir"])
    if recorded.is_absolute() or recorded.exists() or not (env.REPO / recorded).exists():
        return recorded
    return env.REPO / recorded


# ---------------------------------------------------------------- transformers interop

def hf_config(config):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hf_named_tensors(model, of=lambda p: p):
    """Our weights (or, with of=lambda p: p.grad, their gradients) under transformers' Llama names.

    Fused matrices are split into views, so copying into a returned tensor writes into our weights.
    """
    out = {"model.embed_tokens.weight": of(model.tok_embeddings.weight),
           "model.norm.weight": of(model.norm.weight)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = of(layer.attention.wqkv.weight).chunk(3, dim=0)
        gate, up = of(layer.feed_forward.w13.weight).chunk(2, dim=0)
        out.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": of(layer.attention.wo.weight),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": of(layer.feed_forward.w2.weight),
            p + "input_layernorm.weight": of(layer.attention_norm.weight),
            p + "post_attention_layernorm.weight": of(layer.ffn_norm.weight),
        })
    return out


def to_hf(model):
    """A transformers LlamaForCausalLM with this model's weights (float32, on the CPU)."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM(hf_config(model.config))
    state = {k: v.detach().float().cpu().clone() for k, v in hf_named_tensors(model).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


def config_from_hf(hf_cfg):
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    problems = []
    if hf_cfg.num_key_value_heads != hf_cfg.num_attention_heads:
        problems.append("grouped-query attention (num_key_value_heads != num_attention_heads)")
    if head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size:
        problems.append("head_dim x heads != hidden_size")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        problems.append("biases")
    if not getattr(hf_cfg, "tie_word_embeddings", False):
        problems.append("untied input and output embeddings")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    if getattr(hf_cfg, "hidden_act", "silu") not in ("silu", "swish"):  # SwiGLU's gate; the same function
        problems.append(f"activation {hf_cfg.hidden_act!r} (SwiGLU needs silu)")
    if problems:
        raise ValueError("this Llama checkpoint is outside the tiny-llm family: " + ", ".join(problems))
    return ModelConfig(vocab_size=hf_cfg.vocab_size, dim=hf_cfg.hidden_size, n_layers=hf_cfg.num_hidden_layers,
                       n_heads=hf_cfg.num_attention_heads, hidden_dim=hf_cfg.intermediate_size,
                       max_seq_len=hf_cfg.max_position_embeddings, norm_eps=hf_cfg.rms_norm_eps,
                       rope_theta=float(theta))


def from_hf(hf_model):
    """A Transformer with the weights of a transformers LlamaForCausalLM of the tiny-llm family."""
    model = Transformer(config_from_hf(hf_model.config))
    src = hf_model.state_dict()
    with torch.no_grad():
        for name, target in hf_named_tensors(model).items():
            target.copy_(src[name])
    return model


# ---------------------------------------------------------------- parity figures and the preset table

def parity(model, idx, targets, device="cpu", autocast=True):
    """Our loss and gradients against transformers' LlamaForCausalLM on the same weights and tokens.

    Returns the reference file's trained-parity fields; relative_gradient_error is the norm of the
    difference of all gradients over the norm of the reference's. With autocast (bf16 on CUDA), both
    models round differently, so expect about 1e-2, not float32's 1e-6.
    """
    hf = to_hf(model).to(device)
    model = model.to(device)
    idx, targets = idx.to(device), targets.to(device)
    context = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if autocast
               else contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(idx, targets)
    loss.backward()
    with context:
        logits = hf(input_ids=idx).logits
    reference = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    reference.backward()
    ours = hf_named_tensors(model, of=lambda p: p.grad)
    theirs = dict(hf.named_parameters())
    diff = sum(float((ours[n].float() - theirs[n].grad.float()).pow(2).sum()) for n in ours)
    norm = sum(float(theirs[n].grad.float().pow(2).sum()) for n in ours)
    return {"tokens": int((targets != -100).sum()), "loss": loss.item(), "reference_loss": reference.item(),
            "relative_gradient_error": math.sqrt(diff / norm), "autocast": "bfloat16" if autocast else None,
            "device": str(device)}


def _main(argv):
    import argparse
    import sys
    parser = argparse.ArgumentParser(description="The preset table, or parity figures against transformers.")
    parser.add_argument("--parity", metavar="PRESET", help="compare a preset (or --checkpoint) with LlamaForCausalLM")
    parser.add_argument("--checkpoint", help="a train.py checkpoint (out/NAME/ckpt.pt): the trained weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--results_file", default="results.json")
    args = parser.parse_args(argv)
    if args.checkpoint and not args.parity:
        print("error: --checkpoint is read by --parity; add --parity=PRESET (the preset it was trained from)",
              file=sys.stderr)
        return 2
    if not args.parity:
        print(f"{'preset':<8}{'parameters':>14}{'width':>7}{'layers':>7}{'heads':>6}{'hidden':>8}"
              f"{'FLOPs/token (T=1024)':>22}")
        for name, cfg in PRESETS.items():
            params = sum(p.numel() for p in Transformer(cfg).parameters())
            print(f"{name:<8}{params:>14,}{cfg.dim:>7}{cfg.n_layers:>7}{cfg.n_heads:>6}{cfg.hidden_dim:>8}"
                  f"{flops_per_token(cfg, 1024) / 1e6:>20.1f}M")
        return 0
    import env
    from data.loader import CacheError, TokenCache
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device=cuda but PyTorch sees no GPU; use --device=cpu")
        if args.tokens < args.seq_len:
            raise ValueError(f"--tokens {args.tokens} is less than one sequence of --seq_len {args.seq_len}")
        env.read_results(args.results_file)  # a broken results file fails now, not after the work
        trained = args.checkpoint is not None
        if trained:
            model, ckpt = load_checkpoint(args.checkpoint)
            tokens = torch.from_numpy(TokenCache(run_data_dir(ckpt), verify=False).val[:args.tokens + 1]
                                      .astype("int64"))
        else:
            model = Transformer(get_preset(args.parity))
            tokens = torch.randint(0, model.config.vocab_size, (args.tokens + 1,),
                                   generator=torch.Generator().manual_seed(0))
    except (ValueError, CacheError, env.ResultsFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = args.tokens // args.seq_len
    idx = tokens[:rows * args.seq_len].view(rows, args.seq_len)
    targets = tokens[1:rows * args.seq_len + 1].view(rows, args.seq_len)
    figures = dict(preset=args.parity, trained=trained, **parity(model, idx, targets, args.device))
    print(figures)
    env.append(args.results_file, ["trained-parity"], figures)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
