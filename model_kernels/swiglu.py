"""SwiGLU and the down projection after it, as one op: Triton kernels in compiled code on CUDA, torch elsewhere."""
import os

import torch
import torch.nn.functional as F

from model_kernels import uses_triton

# ---------------------------------------------------------------- SwiGLU and the down projection
# Inductor compiles silu(gate) * up into one kernel forward, but backward writes the two gradients as one
# concatenated tensor with a kernel that loads gate, up and the upstream gradient again for each half (its time:
# docs/PERFORMANCE.md, "Where a 20m update's time goes"). Here one program per piece of a row reads each input
# once and writes both halves. Math as compiled: float32 inside, one rounding to the input's dtype.
#
# The op also takes in the down projection (w2), so that backward recomputes the product silu(gate) * up
# instead of keeping it: w2's weight gradient needs it, and as an input of a plain matmul it was saved
# beside gate and up, hidden_dim bf16 values per token and layer, a share of the peak memory (docs/PERFORMANCE.md,
# the same section). The backward kernel writes it again from the gate and up it already reads, bitwise as forward did.

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


# Inductor launches the kernels it writes from the binaries its cache keeps beside their code, so a warm run (or a
# loaded compile_cache) compiles none of them. This kernel, a user-defined one, it compiles again through Triton
# unless static_launch_user_defined_triton_kernels is set (torch._inductor.runtime.triton_heuristics,
# check_can_launch); its compile workers take that setting from their environment when they start.
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def launch_from_saved_binary():
    """Have Inductor launch this kernel from the binary its cache saved (static_launch_user_kernels): the same
    binary, another launcher. Process-wide, as torch.compile's settings are; before Inductor's workers start."""
    import torch._inductor.config as inductor_config
    os.environ[STATIC_LAUNCH_ENV] = "1"
    inductor_config.static_launch_user_defined_triton_kernels = True


# triton_op, not custom_op: torch.compile traces into it and launches the kernels from its own generated code.
# An opaque custom op is called through Python on every use, 16 times per 20m update, and that made the
# compiled update host-bound though its kernels took less time (lever-swiglu-custom-op, docs/PERFORMANCE.md).
@torch.library.triton_op("tiny_llm::swiglu_down", mutates_args=())
def _swiglu_down_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) for x = [gate, up]; autograd keeps x and weight only."""
    if uses_triton(x.device):
        (product,) = _swiglu_launch(x.contiguous())
    else:
        product = _swiglu_torch(x)
    return F.linear(product, weight)


@torch.library.triton_op("tiny_llm::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not uses_triton(x.device):
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


def swiglu_mlp(x, w13, w2):
    """FeedForward's math (mlp_impl "torch"): the w13 matmul, then SwiGLU and the down projection (swiglu_down)."""
    return swiglu_down(F.linear(x, w13), w2)


def swiglu_down(x, weight):
    """F.linear(silu(gate) * up, weight) of x = [gate, up] (the last dimension, as FeedForward.w13 makes it):
    the fused op in compiled code on CUDA, plain torch elsewhere. Eager keeps torch's kernels: it is
    launch-bound, and the op's Python dispatch costs more than the kernel it saves (docs/PERFORMANCE.md, "Where a
    20m update's time goes")."""
    if uses_triton(x.device) and torch.compiler.is_compiling():
        # The op is outside autocast's reach, so it gets the weight as autocast would give it to F.linear.
        return _swiglu_down_op(x, weight.to(x.dtype))
    gate, up = x.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight)
