"""Causal attention for training and evaluation: SDPA's kernels, or "fa4", our op pair of cuDNN's forward and
flash-attn-4's backward (flash-attn-4 is installed apart: requirements-gpu.txt). model_kernels/registry.py declares the
backends; "auto", the default, is fa4 wherever it can run and SDPA's own pick elsewhere (resolve_backend)."""
import contextlib
import functools
import importlib
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from model_kernels import first_calls


def fa4_problem(device):
    """Why fa4 cannot run on `device` (a torch.device), or None when it can: flash-attn-4's backward needs
    the package and a Hopper or Blackwell GPU (compute capability 9.x or 10.x)."""
    if device.type != "cuda":
        return f"fa4 runs on Hopper and Blackwell GPUs only, not on the {device.type}"
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return f"fa4 runs on Hopper and Blackwell GPUs only, not on {torch.cuda.get_device_name(device)}"
    problem = flash_attn_4_problem()
    return problem and f"fa4 {problem}"


@functools.lru_cache(maxsize=None)
def _fa4_runs_on(device):
    return fa4_problem(device) is None


def resolve_backend(name, device):
    """(the backend a setting runs on `device`, why): "auto" is fa4 where it can run, else SDPA's choice."""
    device = torch.device(device)
    if name != "auto":
        return name, "as set"
    problem = fa4_problem(device)
    return ("sdpa", f"the default; {problem}") if problem else ("fa4", "the default where flash-attn-4 can run")


def flash_attn_4_problem():
    """Why flash-attn-4 cannot serve fa4 (the words after its name), or None: the package is installed apart.

    Before the first import, turns on flash-attn-4's on-disk cache of its compiled CuTe kernels (off in the package
    unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1; a setting of 0 is kept): without it every process compiles its
    backward again, about 4 s on the H200 (docs/COLD_START.md), as Inductor's cache spares its own."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except Exception as error:  # noqa: BLE001 - it loads the CUTLASS DSL as it imports: a clash there is any error
        return (f"needs the flash-attn-4 package (pip install flash-attn-4), which did not import "
                f"({type(error).__name__}: {error})")
    missing = [f for f in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(interface, f)]  # what we call
    if missing:
        return (f"needs a flash-attn-4 with _flash_attn_fwd and _flash_attn_bwd, and this one has no "
                f"{' or '.join(missing)}; 4.0.0b36 is the version measured (pip install flash-attn-4==4.0.0b36)")
    return None


def flash_attn_4():
    """flash-attn-4's interface module (the `flash_attn.cute` package: FlashAttention for Hopper and Blackwell,
    written in NVIDIA's CUTLASS DSL); one that cannot serve is a ValueError saying why."""
    problem = flash_attn_4_problem()
    if problem:
        raise ValueError(f"attention backend 'fa4' {problem}")
    return importlib.import_module("flash_attn.cute.interface")


# Our own op pair: training's attention with cuDNN's forward and flash-attn-4's backward, the faster of each on
# the H200 (20m-fa4-profile against 20m-default-profile, docs/PERFORMANCE.md). The backward is the function that PyTorch's FA4 registry calls too
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
    first_calls.wait("attention")  # a child compiling the backward for this run (model_kernels/first_calls.py)
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


# ---------------------------------------------------------------- windows within rows (context_windows)
# A context schedule's windows kept inside the rows (data/loader.py, window_tensors), so that every context is one
# shape: flash-attn-4's variable-length kernels, each window one sequence of the flattened rows, both directions
# flash-attn-4's (cuDNN's forward takes no window starts); elsewhere SDPA with a mask that keeps each window apart.
@torch.library.custom_op("tiny_llm::flash_attention_4_windows", mutates_args=())
def _windows_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, longest: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _windows_outputs(q)
    first_calls.wait("attention")  # a child compiling the pair for this run (model_kernels/first_calls.py)
    flash_attn_4()._flash_attn_fwd(q, k, v, cu_seqlens_q=starts, cu_seqlens_k=starts, max_seqlen_q=longest,
                                   max_seqlen_k=longest, causal=True, return_lse=True, out=out, lse=lse)
    return out, lse


def _windows_outputs(q):
    """The output (N, H, D) and the log-sum-exp (H, N), float32, of N flattened tokens: allocated here so that the
    op and its fake agree on strides."""
    N, H, D = q.shape
    return torch.empty(N, H, D, dtype=q.dtype, device=q.device), torch.empty(H, N, dtype=torch.float32,
                                                                             device=q.device)


@_windows_op.register_fake
def _(q, k, v, starts, longest):
    return _windows_outputs(q)


@torch.library.custom_op("tiny_llm::flash_attention_4_windows_backward", mutates_args=())
def _windows_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         grad_out: torch.Tensor, starts: torch.Tensor, longest: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _flash_attention_4_gradients(q, k, v)
    flash_attn_4()._flash_attn_bwd(q, k, v, out, grad_out, lse, causal=True, cu_seqlens_q=starts,
                                   cu_seqlens_k=starts, max_seqlen_q=longest, max_seqlen_k=longest,
                                   dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


@_windows_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, starts, longest):
    return _flash_attention_4_gradients(q, k, v)


def _windows_setup(ctx, inputs, output):
    q, k, v, starts, longest = inputs
    ctx.save_for_backward(q, k, v, starts, *output)
    ctx.longest = longest


def _windows_backward(ctx, grad_out, _grad_lse):
    q, k, v, starts, out, lse = ctx.saved_tensors
    return (*_windows_backward_op(q, k, v, out, lse, grad_out, starts, ctx.longest), None, None)


_windows_op.register_autograd(_windows_backward, setup_context=_windows_setup)


def window_mask(positions):
    """(T, T) bool, True where query i may see key j: j <= i in the same window (positions restart at each)."""
    starts = torch.arange(len(positions), device=positions.device) - positions
    return (starts[:, None] == starts[None, :]) & torch.ones(len(positions), len(positions), dtype=torch.bool,
                                                             device=positions.device).tril()


def windowed_attention(q, k, v, backends, windows):
    """Causal attention within each window of the rows: windows = (positions, starts), data/loader.py's."""
    positions, starts = windows
    B, T, H, D = q.shape
    if backends == "fa4" and torch.is_grad_enabled() and q.requires_grad:
        return _windows_op(*(t.reshape(B * T, H, D) for t in (q, k, v)), starts, T)[0].view(B, T, H, D)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(backends) if backends not in (None, "fa4") else contextlib.nullcontext():  # a pinned kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(positions)).transpose(1, 2)


def causal_attention(q, k, v, backends, windows=None):
    """q, k, v: (B, T, H, D); backends: an attention choice's (model_kernels/registry.py); windows: None, or the
    context_windows tensors (windowed_attention). Returns (B, T, H, D)."""
    if backends == "auto":  # a model used without the Trainer, which resolves it once (resolve_backend)
        backends = "fa4" if not torch.compiler.is_compiling() and _fa4_runs_on(q.device) else None
    if windows is not None:
        return windowed_attention(q, k, v, backends, windows)
    if backends == "fa4":
        if torch.is_grad_enabled() and q.requires_grad:
            return flash_attention_4(q, k, v)
        # Forward only (evaluation, sampling): SDPA's choice, which on the H200 is the same cuDNN forward
        # without the log-sum-exp that only a backward needs, and runs on any GPU and the CPU.
        backends = None
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D), as SDPA wants them
    with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
