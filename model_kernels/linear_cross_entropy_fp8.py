"""The LM head and its cross-entropy with the head's three matmuls in FP8: the declared lm_head_fp8.

A change of math, off by default (train.py's lm_head_fp8; compare.py --allow_recipe_change judges its loss).
Why: at width 320 the head's three matmuls are most of the LM head and loss's time in bf16 (loss-microbench-320,
"matmuls-alone"), and Hopper's FP8 tensor cores run twice bf16's rate. The op keeps the
"fused" op's contract and slices (model_kernels/cross_entropy.py); per slice of tokens:

  logits  = h8 @ w8.T       scaled matmul, out in bf16 (h8, w8: e4m3 with one scale each per call)
  P8      = P * 2**15       the row kernel: the loss from the bf16 logits in float32, as "fused", and the softmax
                            gradient P = softmax - onehot written in e5m2 (one byte) instead of over the logits
  grad_h  = P8 @ w8         scaled matmul, out in float32
  grad_w += P8.T @ h8       scaled matmul, out in float32; P8.T is a transposed copy, because Hopper's FP8
                            matmuls take both operands with the summed dimension contiguous

Scaling as torchao's float8 training's default ("tensorwise"): each of h and w is divided by one scale, its
largest magnitude over e4m3's largest value (448). P needs none computed: |P| <= 1, so the fixed 2**15 keeps it
under e5m2's largest value (57344) and keeps probabilities down to 2**-31 representable; e5m2's range rather than
e4m3's precision, as FP8 training uses for gradients, since at 32,000 classes most probabilities are tiny.
Evaluation computes its logits in bf16 ("fused"'s path): the validation loss measures the weights trained.

What it gains (docs/PERFORMANCE.md: the "fused-fp8" rows of loss-microbench-320/512/768, 20m-fp8-head) is least
at width 320, where the logits' matmul is bound by writing the logits, not by its FLOPs, and the FP8 gradient's
transposed copies cost a pass of their own (20m-fast-track-profile).
"""
import torch

from model_kernels import uses_triton
from model_kernels.cross_entropy import (_cross_entropy_rows, _linear_cross_entropy_backward,
                                         _linear_cross_entropy_fake, _linear_cross_entropy_setup, in_autocast_dtype)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448
GRAD_SCALE = 2.0 ** 15
MULTIPLE = 16  # cuBLAS's FP8 matmuls need every dimension a multiple of 16
TRANSPOSE_BLOCK = 128  # the transpose kernel's square tile of bytes (16 KiB through shared memory)


def shape_problem(model_config, cfg):
    """Why the FP8 matmuls cannot take the settings' token counts (a micro-step's, a loss slice's) or, given a
    ModelConfig, the model's width and vocabulary: the words after "lm_head_fp8", or None."""
    sizes = [("micro_batch_size x seq_len", cfg["micro_batch_size"] * cfg["seq_len"], " tokens"),
             ("loss_chunk_tokens", cfg["loss_chunk_tokens"], " tokens")]
    if model_config is not None:
        sizes += [("the model's width", model_config.dim, ""),
                  ("the model's vocabulary size", model_config.vocab_size, "")]
    for what, size, unit in sizes:
        if size % MULTIPLE:
            return f"needs {what} to be a multiple of {MULTIPLE}{unit} (FP8 matmuls), got {size}"
    return None


def device_problem(device):
    """Why the FP8 matmuls cannot run on `device` (words after "lm_head_fp8"), or None: a CUDA GPU needs FP8 tensor
    cores; elsewhere torch runs them."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return None
    return (f"needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")


def quantize(x):
    """x in e4m3 with one scale: (x8, inverse scale) such that x8 * inverse is x to e4m3's precision."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    x8 = (x.float() * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, amax / E4M3_MAX


def _mm(a, a_inverse, b, b_inverse, out_dtype):
    """a @ b from FP8 operands and their inverse scales, summed in float32 (a row-major, b column-major)."""
    return torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)


_triton_transpose = None


def transposed(x):
    """x.T made contiguous. On the GPU a Triton kernel of our own: torch's copy of a transposed view reads or
    writes a byte at a time across rows, where this one moves square tiles through shared memory."""
    if not uses_triton(x.device):
        return x.t().contiguous()
    import triton
    global _triton_transpose
    if _triton_transpose is None:
        import triton.language as tl

        @triton.jit
        def transpose_kernel(x_ptr, y_ptr, n_rows, n_cols, x_stride, y_stride, BLOCK: tl.constexpr):
            rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
            cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
            mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
            tile = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask)
            tl.store(y_ptr + cols[:, None] * y_stride + rows[None, :], tl.trans(tile), mask=tl.trans(mask))

        _triton_transpose = transpose_kernel
    n_rows, n_cols = x.shape
    y = x.new_empty((n_cols, n_rows))
    grid = (triton.cdiv(n_rows, TRANSPOSE_BLOCK), triton.cdiv(n_cols, TRANSPOSE_BLOCK))
    _triton_transpose[grid](x, y, n_rows, n_cols, x.stride(0), y.stride(0), BLOCK=TRANSPOSE_BLOCK, num_warps=8)
    return y


def _linear_cross_entropy_fp8_impl(h, weight, targets, chunk_tokens):
    """(sum of token losses, d sum / d h, d sum / d weight) in float32, one slice of tokens at a time."""
    n, width = h.shape
    if n % MULTIPLE or min(chunk_tokens, n) % MULTIPLE:
        raise ValueError(f"lm_head_fp8 needs the tokens of a micro-step and of a loss slice to be multiples of "
                         f"{MULTIPLE} (FP8 matmuls), got {n} and {min(chunk_tokens, n)}")
    h8, h_inverse = quantize(h)
    w8, w_inverse = quantize(weight)
    h8_t, w8_t = transposed(h8), transposed(w8)  # (width, tokens), (width, classes): column-major operands
    p_inverse = torch.full((), 1.0 / GRAD_SCALE, device=h.device)  # a fill kernel: no host copy in a CUDA graph
    rows = _cross_entropy_rows(h.device)
    grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, n, chunk_tokens):
        part = slice(start, start + chunk_tokens)
        logits = _mm(h8[part], h_inverse, w8.t(), w_inverse, torch.bfloat16)
        p8 = torch.empty(logits.shape, dtype=E5M2, device=h.device)
        total += rows(logits, targets[part], grad=p8, grad_scale=GRAD_SCALE).sum()
        del logits  # the transposed copy below takes its memory
        grad_h[part] = _mm(p8, p_inverse, w8_t.t(), w_inverse, torch.float32)
        grad_w += _mm(transposed(p8), p_inverse, h8_t[:, part].t(), h_inverse, torch.float32)
    return total, grad_h, grad_w


@torch.library.custom_op("tiny_llm::linear_cross_entropy_fp8", mutates_args=())
def _linear_cross_entropy_fp8_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_cross_entropy_fp8_impl(h, weight, targets, chunk_tokens)


_linear_cross_entropy_fp8_op.register_fake(_linear_cross_entropy_fake)
# the same stored gradients as "fused", scaled by the upstream gradient in backward
_linear_cross_entropy_fp8_op.register_autograd(_linear_cross_entropy_backward,
                                               setup_context=_linear_cross_entropy_setup)


def linear_cross_entropy_fp8(h, weight, targets, chunk_tokens):
    """"fused"'s contract (model_kernels/cross_entropy.linear_cross_entropy) with the head's matmuls in FP8."""
    return _linear_cross_entropy_fp8_op(in_autocast_dtype(h), weight, targets, int(chunk_tokens))[0]
