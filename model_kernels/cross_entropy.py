"""The LM head and its cross-entropy: the plain torch loss and our fused op (model_kernels/registry.py declares the
choices)."""
import torch
import torch.nn.functional as F

from model_kernels import first_calls, uses_triton


def in_autocast_dtype(x):
    """x as F.linear would see it: in the autocast dtype when autocast is on."""
    device_type = x.device.type
    return x.to(torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else x


def full_cross_entropy(h, weight, targets, chunk_tokens=None):
    """Sum of cross-entropy of (h @ weight.T) against targets (-100 ignored) from all logits at once, float32 inside:
    the plain torch reference (loss_impl "full"). chunk_tokens, the other losses' slice, is not used."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------- fused LM head + cross-entropy
#
# Why a kernel of our own rather than Liger-Kernel's fused linear cross-entropy (the library made for this):
# on the H200 Liger is several times slower on one 20m update's tokens (loss-microbench-libraries-320,
# docs/PERFORMANCE.md's levers). Liger reads the count of counted targets back to the host (`.item()`) on every call and compares the upstream gradient with 1.0 (`torch.equal`) in backward,
# two host syncs per micro-step; and it sizes its token slices to keep the logits near the size of the
# input (512 tokens at width 320), 64 small matmuls per call. The loss here is a plain sum, so no count is
# needed, the upstream gradient scales the two small gradients instead of the logits, and the slice is ours.

def _cross_entropy_rows_torch(logits, targets, write_grad=True, grad=None, grad_scale=1.0):
    """Per-row loss (float32) and, with write_grad, d(loss)/d(logits) written over `logits`; rows with
    target -100 get 0. With `grad` (a tensor of the logits' shape), the gradient times grad_scale is written
    there instead, in its dtype (the FP8 head's, model_kernels/linear_cross_entropy_fp8.py), and the logits are kept.

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
    p = torch.exp(x - lse[:, None])
    p[torch.arange(len(targets), device=logits.device), safe_targets] -= 1.0
    (logits if grad is None else grad).copy_(p * counted[:, None] * grad_scale)
    return losses


_triton_rows = None
# How the kernel is launched: the row is held in registers when it fits in `block` columns, else read in
# `block`-column pieces (online log-sum-exp, then a second pass for the gradient). Chosen on the H200 by
# scripts/ce_rows_sweep.py over one 8,192 x 32,000 bf16 slice.
ROWS_BLOCK, ROWS_NUM_WARPS = 8192, 8


def _rows_kernel():
    """The Triton kernel, built on first use so that importing this file never needs Triton (the CPU build has
    none): one program per row, logits read once, the gradient stored in their place (or into another tensor)."""
    global _triton_rows
    if _triton_rows is None:
        import triton
        import triton.language as tl

        @triton.jit
        def cross_entropy_rows_kernel(logits_ptr, row_stride, targets_ptr, losses_ptr, grad_ptr, grad_stride,
                                      n_cols, GRAD_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                                      ONE_BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = logits_ptr + row * row_stride
            grad_base = grad_ptr + row * grad_stride
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
                    grad = (e * (1.0 / total) - tl.where(cols == target, 1.0, 0.0)) * GRAD_SCALE
                    tl.store(grad_base + cols, tl.where(counted, grad, 0.0).to(grad_ptr.dtype.element_ty), mask=mask)
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
                    grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * GRAD_SCALE
                    tl.store(grad_base + cols, tl.where(counted, grad, 0.0).to(grad_ptr.dtype.element_ty), mask=mask)
            tl.store(losses_ptr + row, tl.where(counted, lse - target_logit, 0.0))

        _triton_rows = cross_entropy_rows_kernel
    return _triton_rows


def _cross_entropy_rows_triton(logits, targets, write_grad=True, block=None, num_warps=None, grad=None,
                               grad_scale=1.0):
    """The Triton kernel launched: the per-row losses, the gradient stored in the logits' place (or, times
    grad_scale, into `grad` in its dtype, as _cross_entropy_rows_torch)."""
    import triton
    first_calls.wait("loss")  # a child compiling this kernel for the run (model_kernels/first_calls.py)
    kernel = _rows_kernel()
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = min(triton.next_power_of_2(n_cols), block or ROWS_BLOCK)
    num_warps = num_warps or min(ROWS_NUM_WARPS, max(4, block // 1024))  # a small vocabulary needs fewer threads
    grad = logits if grad is None else grad
    targets = targets.contiguous()  # the kernel reads a target a row; a (B, 1) slice's flatten is a strided view
    kernel[(n_rows,)](logits, logits.stride(0), targets, losses, grad, grad.stride(0), n_cols,
                      GRAD_SCALE=float(grad_scale), BLOCK=block, ONE_BLOCK=n_cols <= block,
                      WRITE_GRAD=write_grad, num_warps=num_warps)
    return losses


def _cross_entropy_rows(device):
    """The Triton kernel on CUDA devices where Triton is installed, else the torch reference."""
    return _cross_entropy_rows_triton if uses_triton(device) else _cross_entropy_rows_torch


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
        # else the next slice's logits would be allocated while these are still held: two slices at the peak
        del logits
    return total, grad_h, grad_w


@torch.library.custom_op("tiny_llm::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_cross_entropy_impl(h, weight, targets, chunk_tokens)


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(h, weight, targets, chunk_tokens):
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
                      for start in range(0, h.shape[0], chunk_tokens)] or [h.new_zeros(0, dtype=torch.float32)])


@_linear_cross_entropy_losses_op.register_fake
def _(h, weight, targets, chunk_tokens):
    return h.new_empty(h.shape[:1], dtype=torch.float32)


def linear_cross_entropy_losses(h, weight, targets, chunk_tokens):
    """Each token's cross-entropy of (h @ weight.T) (0 where the target is -100), without gradients:
    evaluation's path, with the logits in the autocast dtype one slice at a time, never in float32."""
    return _linear_cross_entropy_losses_op(in_autocast_dtype(h), weight, targets, int(chunk_tokens))


def linear_cross_entropy(h, weight, targets, chunk_tokens):
    """Sum of cross-entropy of (h @ weight.T) against targets (-100 ignored), its gradients computed in forward.

    h: (N, C), weight: (V, C), targets: (N,). One custom op, opaque to torch.compile: it runs the LM head
    matmul, the Triton loss-and-gradient kernel and the two gradient matmuls one slice of tokens at a time,
    so neither float32 logits nor more than one slice of logits ever exist, and backward only scales the
    stored gradients. Under autocast, h and the logits are in the autocast dtype, as F.linear's would be.
    """
    return _linear_cross_entropy_op(in_autocast_dtype(h), weight, targets, int(chunk_tokens))[0]
