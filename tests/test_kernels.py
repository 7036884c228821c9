"""kernels/linear_cross_entropy.py: the "fused_epilogue" loss, its Triton kernels in Triton's interpreter and its
torch path, against float64 torch and against the "fused" op it would replace."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model
from kernels import cross_entropy
from kernels import linear_cross_entropy as lce

ROOT = Path(model.__file__).parent


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tiny_model(loss_impl, seed=0, **overrides):
    fields = dict(vocab_size=300, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_seq_len=64)
    fields.update(overrides)
    torch.manual_seed(seed)
    return model.Transformer(model.get_preset("20m", **fields), loss_impl=loss_impl, loss_chunk_tokens=37)


def batch(vocab, batch_size=2, length=50, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch_size, length), generator=g)
    y = torch.randint(0, vocab, (batch_size, length), generator=g)
    y[torch.rand(y.shape, generator=g) < 0.1] = -100
    y[0, 0] = -100
    return x, y


def float64_reference(h, w, targets):
    """The loss sum and both gradients in float64, from the inputs as given."""
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.t(), targets, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("width, pieces", [(16, (16, 0, 0)), (96, (64, 32, 0)), (320, (256, 64, 0)),
                                           (512, (256, 256, 0)), (768, (256, 256, 256)), (240, (128, 64, 64)),
                                           (1008, (512, 256, 256)), (1024, (512, 512, 0))])
def test_width_is_held_by_three_power_of_two_accumulators(width, pieces):
    assert lce.width_pieces(width) == pieces


def test_the_autotuner_keeps_configs_that_fit_at_each_model_width():
    """For the models' widths a few configs survive the pruning, none with more float32 accumulators a thread
    than the registers hold (8 warps: 128 of 255; 16 warps: 96 of 128) or stages beyond shared memory."""
    triton = pytest.importorskip("triton")
    configs = [triton.Config(dict(BLOCK_V=v, BLOCK_T=t), num_warps=w, num_stages=s)
               for v, t, w, s in lce.WEIGHT_GRAD_CONFIGS]
    for width, at_least in ((320, 6), (512, 3), (768, 1)):
        kept = lce._fitting(configs, {"h_ptr": torch.empty(1, dtype=torch.bfloat16)}, width=width)
        assert len(kept) >= at_least, width
        for c in kept:
            accumulators = c.kwargs["BLOCK_V"] * sum(lce.width_pieces(width)) // (32 * c.num_warps)
            assert accumulators <= (128 if c.num_warps == 8 else 96)
            assert c.num_stages * c.kwargs["BLOCK_T"] * (width + c.kwargs["BLOCK_V"]) * 2 <= lce.SHARED_MEMORY_BYTES


@pytest.mark.parametrize("width", [8, 100, 1040])
def test_widths_the_kernels_cannot_hold_are_one_clear_error(width):
    h, w = torch.randn(4, width), torch.randn(10, width)
    with pytest.raises(ValueError, match=f"multiples of 16 up to 1024, got {width}$"):
        lce.linear_cross_entropy_epilogue(h, w, torch.zeros(4, dtype=torch.long), 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_is_as_exact_as_the_fused_op(dtype):
    """Without Triton (the CPU), the op's loss and gradients against float64, as close as "fused"'s."""
    torch.manual_seed(0)
    h, w = torch.randn(70, 96).to(dtype), (torch.randn(300, 96) * 0.3).to(dtype)
    targets = torch.randint(0, 300, (70,))
    targets[::9] = -100
    expected = float64_reference(h, w, targets)
    got = lce._linear_cross_entropy_epilogue_impl(h, w, targets, 32, True)
    today = cross_entropy._linear_cross_entropy_impl(h, w, targets, 32)
    assert all(g.dtype == torch.float32 for g in got)
    for new, old, ref in zip(got, today, expected):
        if dtype == torch.float32:
            assert relative_error(new, ref) < 1e-5
        else:
            assert relative_error(new, ref) <= 1.5 * relative_error(old, ref) + 1e-7


def test_model_trains_to_the_full_losses_gradients():
    x, y = batch(300)
    results = {}
    for impl in ("full", "fused_epilogue"):
        m = tiny_model(impl)
        for reduction in ("sum", "mean"):
            m.zero_grad()
            loss = m(x, y, reduction=reduction)
            (loss * 0.37).backward()  # an upstream gradient other than 1
            results[impl, reduction] = loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}
    for reduction in ("sum", "mean"):
        (full, full_grads), (new, new_grads) = results["full", reduction], results["fused_epilogue", reduction]
        assert torch.allclose(new, full, rtol=1e-5, atol=0)
        for n in full_grads:
            assert relative_error(new_grads[n], full_grads[n]) < 1e-5, n


def test_model_evaluation_gives_each_tokens_loss():
    x, y = batch(300)
    full, new = tiny_model("full"), tiny_model("fused_epilogue")
    with torch.no_grad():
        for reduction in ("none", "sum", "mean"):
            assert torch.allclose(new(x, y, reduction=reduction), full(x, y, reduction=reduction), rtol=1e-5, atol=1e-6)


def test_op_traces_under_torch_compile():
    """The fake (shape) function and autograd registration, as torch.compile uses them."""
    x, y = batch(300, length=24)
    eager, compiled = tiny_model("fused_epilogue"), tiny_model("fused_epilogue")
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for run in (eager, step):
        run(x, y, reduction="mean").backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert relative_error(q.grad, p.grad) < 1e-6, name


def test_op_passes_torch_library_opcheck():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 64, generator=g).t().contiguous().t()  # a non-contiguous h too
    weight = torch.randn(300, 64, generator=g) * 0.1
    targets = torch.randint(0, 300, (50,), generator=g)
    targets[3] = -100
    for args in ((h.requires_grad_(), weight.requires_grad_(), targets, 16, True),
                 (h.detach(), weight.detach(), targets, 64, False)):
        torch.library.opcheck(lce._linear_cross_entropy_epilogue_op, args)


def test_op_holds_one_slice_of_logits_at_a_time():
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    chunk, vocab = 16, 300

    class LiveLogits(TorchDispatchMode):
        live, most = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and out.shape == (chunk, vocab):  # a slice's logits
                self.live = [r for r in self.live if r() is not None] + [weakref.ref(out)]
                self.most = max(self.most, len(self.live))
            return out

    targets = torch.randint(0, vocab, (100,))
    with LiveLogits() as live:
        lce._linear_cross_entropy_epilogue_impl(torch.randn(100, 64), torch.randn(vocab, 64), targets, chunk, True)
    assert live.most == 1


# The kernels in Triton's interpreter, which has two bf16 gaps that the GPU does not: its dot reads bf16 values
# as their integer bits, and its float32-to-bf16 cast truncates where the GPU rounds to nearest even. Both are
# patched here to the GPU's behaviour (bf16 products are exact in float32, so the dot in float32 is the
# tensor cores' arithmetic), so that bf16 results can be held to the same error as the "fused" op's.
TRITON_EPILOGUE_CHECK = """
import time
import numpy as np, torch, torch.nn.functional as F
import triton.language as tl
from triton.runtime import interpreter
from kernels import cross_entropy, linear_cross_entropy as lce
from tests.conftest import assert_loss_and_gradients_match_cross_entropy
from tests.test_kernels import float64_reference, relative_error

dot, cast = interpreter.InterpreterBuilder.create_dot, interpreter.InterpreterBuilder.cast_impl
def as_float(x):
    if x.dtype != tl.bfloat16:
        return x
    return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
def cast_rounding(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
        return interpreter.TensorHandle(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)
    return cast(self, src, dst_type)
interpreter.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, as_float(a), as_float(b), d, *rest)
interpreter.InterpreterBuilder.cast_impl = cast_rounding
cross_entropy._cross_entropy_rows = lambda device: cross_entropy._cross_entropy_rows_triton  # "fused" as on the GPU
lce.uses_triton = lambda device: True

torch.manual_seed(0)
N, V = 70, 300  # neither a multiple of any block: 32 and 16 tokens, 64 and 32 classes
for width in (64, 240, 320):  # one piece; three, the last masked (128 + 64 + 64); 256 + 64 as at 20m
    for dtype in (torch.float32, torch.bfloat16):
        case = (width, dtype)
        h, w = torch.randn(N, width).to(dtype), (torch.randn(V, width) / width ** 0.5 * 3).to(dtype)
        targets = torch.randint(0, V, (N,))
        targets[::7] = -100
        # K1 and the read-only lse kernel: the exact logits rounded once to the dtype, and their exact lse
        lse, lse_rows = torch.empty(N), torch.empty(N)
        logits = lce._logits_triton(h, w, lse)
        exact = h.double() @ w.double().t()
        rounding = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16: half of its 2 ** -7 step, relative
        assert ((logits.double() - exact).abs() <= rounding * exact.abs() + 1e-5).all(), case
        true_lse = torch.logsumexp(logits.double(), dim=1)
        assert torch.allclose(lse.double(), true_lse, rtol=1e-6, atol=1e-6), case
        assert torch.equal(lce._logits_cublas_row_lse(h, w, lse_rows, block=128), h @ w.t())  # three pieces a row
        assert torch.allclose(lse_rows.double(), torch.logsumexp((h @ w.t()).double(), dim=1), rtol=1e-6), case
        # K3: P over the logits, as d(loss)/d(logits) of the stored logits, and grad_w += P.T @ h
        reference = logits.double().requires_grad_()
        F.cross_entropy(reference, targets, ignore_index=-100, reduction="sum").backward()
        grad_w = torch.full((V, width), 0.5)
        lce._weight_grad_triton(logits, lse, targets, h, grad_w)
        p_tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16: one rounding of the gradient
        assert (logits.double() - reference.grad).abs().max() < p_tolerance, case
        assert logits[targets == -100].abs().max() == 0, case
        assert torch.allclose(grad_w.double(), 0.5 + logits.double().t() @ h.double(), rtol=1e-5, atol=1e-5), case
        # the op, both forwards, in 8,192-token slices' stead 32 + 32 + 6: against float64 and "fused"
        expected = float64_reference(h, w, targets)
        errors = lambda got: [relative_error(a, b) for a, b in zip(got, expected)]
        old = errors(cross_entropy._linear_cross_entropy_impl(h, w, targets, 32))
        lce.uses_triton = lambda device: False
        torch_path = lce._linear_cross_entropy_epilogue_impl(h, w, targets, 32, True)
        lce.uses_triton = lambda device: True
        for triton_forward in (True, False):
            got = lce._linear_cross_entropy_epilogue_impl(h, w, targets, 32, triton_forward)
            agreement = 1e-5 if dtype == torch.float32 else 1e-3  # bf16: the odd gradient rounded the other way
            assert all(relative_error(a, b) < agreement for a, b in zip(got, torch_path)), case
            new = errors(got)
            if dtype == torch.float32:
                assert max(new) < 1e-5, (case, new)
            else:
                assert all(n <= 1.5 * o + 1e-6 for n, o in zip(new, old)), (case, triton_forward, new, old)

# the GPU's launch path: the autotuner (timed by the CPU's clock here) over the GPU configs as pruned, the
# logits' tiles of the config it chose, and the weight gradient tuned on a copy that the real call never sees
def cpu_time(kernel_call, quantiles):
    start = time.perf_counter()
    kernel_call()
    return [time.perf_counter() - start] * 3
lce._built.clear()
lce.interpreting, lce._time_launch, lce.TUNE_TOKENS = (lambda: False), cpu_time, 40
for dtype in (torch.float32, torch.bfloat16):
    h, w = torch.randn(70, 64).to(dtype), (torch.randn(300, 64) * 0.3).to(dtype)
    targets = torch.randint(0, 300, (70,))
    targets[::7] = -100
    got = [lce._linear_cross_entropy_epilogue_impl(h, w, targets, 32, forward) for forward in (True, False)]
    lce.uses_triton = lambda device: False
    torch_path = lce._linear_cross_entropy_epilogue_impl(h, w, targets, 32, True)
    lce.uses_triton = lambda device: True
    for one in got:
        assert all(relative_error(a, b) < 1e-3 for a, b in zip(one, torch_path)), dtype
assert all(len(lce._built[name].cache) == 2 for name in ("logits", "weight_grad"))  # tuned once per dtype

# through autograd, as the model calls it: backward scales the stored gradients
h = torch.randn(40, 320, requires_grad=True)
w = (torch.randn(200, 320) * 0.1).requires_grad_()
targets = torch.randint(0, 200, (40,))
targets[5] = -100
assert_loss_and_gradients_match_cross_entropy(lambda h, w, t: lce.linear_cross_entropy_epilogue(h, w, t, 16),
                                              h, w, targets)
print("ok")
"""


def test_triton_kernels_in_the_interpreter():
    """The GPU kernels themselves on the CPU, in Triton's interpreter (TRITON_INTERPRET is read when a kernel
    is defined, hence a fresh process)."""
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", TRITON_EPILOGUE_CHECK], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)), timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
