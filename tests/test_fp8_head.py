"""model_kernels/linear_cross_entropy_fp8.py, the declared lm_head_fp8: the op is exactly the arithmetic of its FP8
operands, close to the bf16 loss, scaled in backward as "fused"; its Triton kernels in the interpreter; and the
settings it cannot run with refused before any work."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model
import train
from configurator import ConfigError
from model_kernels import linear_cross_entropy_fp8 as fp8
import settings
import plan
from tests.conftest import check_execution, setup

ROOT = Path(__file__).resolve().parent.parent


def case(n=96, width=64, vocab=320, seed=0):
    torch.manual_seed(seed)
    h, w = torch.randn(n, width), torch.randn(vocab, width) / width ** 0.5 * 3
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    return h, w, targets


def float64_of_fp8_operands(h, w, targets):
    """The op's math in float64 from its quantized operands: logits from h8 and w8 rounded to bf16, the loss
    from those, P rounded to e5m2 at the op's scale, and both gradients from P8, w8 and h8."""
    h8, h_inv = fp8.quantize(h)
    w8, w_inv = fp8.quantize(w)
    hq, wq = h8.double() * h_inv.double(), w8.double() * w_inv.double()
    logits = (hq @ wq.t()).to(torch.bfloat16).double()
    counted = targets != -100
    lse = torch.logsumexp(logits, dim=1)
    safe = targets.clamp(min=0)
    loss = torch.where(counted, lse - logits.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    p = torch.exp(logits - lse[:, None])
    p[torch.arange(len(targets)), safe] -= 1.0
    p8 = ((p * counted[:, None]).float() * fp8.GRAD_SCALE).to(fp8.E5M2).double() / fp8.GRAD_SCALE
    return loss, p8 @ wq, p8.t() @ hq


def test_the_op_is_the_arithmetic_of_its_fp8_operands():
    """Layouts and scales: every output equals the float64 math of the same quantized operands (what is left
    is float32 summation), slice by slice as one call."""
    h, w, targets = case()
    got = fp8._linear_cross_entropy_fp8_impl(h, w, targets, 32)
    for a, b in zip(got, float64_of_fp8_operands(h, w, targets)):
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-5)


def test_the_op_is_close_to_the_exact_loss_and_scaled_in_backward():
    """Against F.cross_entropy in float32: the loss within FP8's 0.5%, the gradients within e5m2's rounding
    (about 3.5% of their norm), and the upstream gradient (the trainer's 1/tokens) reaching the stored ones."""
    h, w, targets = case(n=128, width=96, vocab=400)
    h, w = h.requires_grad_(), w.requires_grad_()
    results = []
    for loss_of in (lambda: fp8.linear_cross_entropy_fp8(h, w, targets, 64),
                    lambda: F.cross_entropy(h @ w.t(), targets, reduction="sum")):
        h.grad = w.grad = None
        loss = loss_of()
        (loss * 0.25).backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    (loss, grad_h, grad_w), (exact, exact_h, exact_w) = results
    assert abs(loss - exact) < 5e-3 * exact
    for a, b in ((grad_h, exact_h), (grad_w, exact_w)):
        assert (a - b).norm() < 0.05 * b.norm()
    assert grad_h[targets == -100].abs().max() == 0  # ignored tokens get no gradient


def test_quantize_maps_the_largest_value_to_e4m3s_largest():
    x = torch.tensor([[0.5, -3.0], [1e-4, 2.0]])
    x8, inverse = fp8.quantize(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.float().abs().max() == fp8.E4M3_MAX
    assert torch.allclose(x8.float() * inverse, x, rtol=2 ** -4)  # e4m3: 3 mantissa bits
    zeros8, _ = fp8.quantize(torch.zeros(2, 2))
    assert zeros8.float().abs().max() == 0  # no division by a zero amax


def test_the_model_trains_with_it_only_in_the_fused_loss():
    config = model.get_preset("20m", vocab_size=256, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_seq_len=32)
    x = torch.randint(0, 256, (2, 32))
    losses = {}
    for fp8_head in (False, True):
        torch.manual_seed(0)
        m = model.Transformer(config, loss_impl="fused", lm_head_fp8=fp8_head)
        losses[fp8_head] = m(x, x).item()
        with torch.no_grad():  # evaluation's logits stay bf16's path, the same for both
            losses[fp8_head, "eval"] = m(x, x).item()
    assert losses[True] != losses[False]  # the FP8 head ran (its e4m3 logits move the loss) ...
    assert abs(losses[True] - losses[False]) < 5e-3 * losses[False]  # ... by FP8's rounding only
    assert losses[True, "eval"] == losses[False, "eval"]


def test_train_py_trains_with_it_and_records_it_in_the_recipe(text_cache, tmp_path):
    """The config key reaches the model through the Trainer: the fp8 run's first losses differ from the plain
    run's by FP8's rounding, and its recipe (what compare.py judges) names the change."""
    from tests.test_train import small_config
    entries = {}
    for fp8_head in (False, True):
        cfg = small_config(text_cache, tmp_path / str(fp8_head), loss_impl="fused", lm_head_fp8=fp8_head, epochs=1)
        entries[fp8_head] = train.train(cfg)
    plain, fp8_run = entries[False], entries[True]
    assert fp8_run["status"] == "complete" and fp8_run["recipe"]["lm_head_fp8"] is True
    assert "lm_head_fp8" not in plain["recipe"]  # off by default, the recipe identity of every earlier run
    first = [e["training_curve"][0]["loss"] for e in (plain, fp8_run)]
    assert first[0] != first[1] and abs(first[0] - first[1]) < 5e-3 * first[0]


def test_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line(fake_gpu):
    fake_gpu((8, 0), "NVIDIA A100")
    import settings
    cfg = settings.Config(train.DEFAULTS, lm_head_fp8=True, loss_impl="fused", attention_backend="sdpa")
    with pytest.raises(ConfigError, match="needs FP8 tensor cores .* NVIDIA A100 has 8.0; set lm_head_fp8=False"):
        plan.check_device(cfg, torch.device("cuda"))
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    plan.check_device(cfg, torch.device("cuda"))  # Hopper: accepted


def test_a_width_its_matmuls_cannot_take_is_one_line_before_training(text_cache, tmp_path):
    from tests.test_train import small_config
    cfg = small_config(text_cache, tmp_path, loss_impl="fused", lm_head_fp8=True, dim=72, n_heads=2)
    with pytest.raises(ConfigError, match="width to be a multiple of 16 .*got 72"):
        setup(cfg)


@pytest.mark.parametrize("change, message", [
    (dict(loss_impl="full"), "lm_head_fp8 runs inside the fused loss; set loss_impl=fused"),
    (dict(seq_len=24, tokens_per_update=48, micro_batch_size=1), "micro_batch_size x seq_len to be a multiple of 16"),
    (dict(loss_chunk_tokens=1000), "loss_chunk_tokens to be a multiple of 16 tokens"),
])
def test_settings_it_cannot_run_with_are_one_line_before_any_work(change, message):
    cfg = settings.Config({**train.DEFAULTS, "lm_head_fp8": True, "loss_impl": "fused", **change})
    with pytest.raises(ConfigError, match=message):
        check_execution(cfg)


# Triton's interpreter rounds float32 to e5m2 without carrying a rounded-up mantissa into the exponent (1.9 becomes
# 1.0, not 2.0); its cast is patched to torch's, which rounds to nearest even as the GPU's cvt.rn does.
TRITON_FP8_CHECK = """
import numpy as np, torch
import triton.language as tl
from triton.runtime import interpreter
from model_kernels import cross_entropy, linear_cross_entropy_fp8 as fp8

fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
def fp_to_fp_rounding(self, src, dst_type, rounding_mode):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e5:
        e5m2 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e5m2)
        return interpreter.TensorHandle(e5m2.view(torch.uint8).numpy(), tl.float8e5)
    return fp_to_fp(self, src, dst_type, rounding_mode)
interpreter.InterpreterBuilder.create_fp_to_fp = fp_to_fp_rounding
fp8.uses_triton = lambda device: True
torch.manual_seed(0)
for n_rows, n_cols in ((200, 300), (128, 256), (5, 1000)):  # ragged tiles, whole tiles, a row in three blocks
    x = (torch.randn(n_rows, n_cols) * 100).to(torch.float8_e5m2)
    assert torch.equal(fp8.transposed(x).view(torch.uint8), x.t().contiguous().view(torch.uint8)), (n_rows, n_cols)
    logits = torch.randn(n_rows, n_cols) * 3
    targets = torch.randint(0, n_cols, (n_rows,))
    targets[::3] = -100
    expected_grad = torch.empty(n_rows, n_cols, dtype=torch.float8_e5m2)
    expected = cross_entropy._cross_entropy_rows_torch(logits, targets, grad=expected_grad, grad_scale=fp8.GRAD_SCALE)
    grad, kept = torch.empty_like(expected_grad), logits.clone()
    losses = cross_entropy._cross_entropy_rows_triton(kept, targets, block=256, grad=grad, grad_scale=fp8.GRAD_SCALE)
    assert torch.allclose(losses, expected, rtol=1e-6, atol=1e-6) and torch.equal(kept, logits)
    # P rounded once to e5m2: the kernel and torch agree but where float32's exp differs in its last bit
    differ = (grad.float() != expected_grad.float()).float().mean()
    assert differ < 1e-3, differ
print("ok")
"""


def test_fp8_kernels_in_the_interpreter():
    """The transpose kernel byte for byte, and the row kernel's FP8 gradient (logits kept) against torch's."""
    pytest.importorskip("triton")
    result = subprocess.run([sys.executable, "-c", TRITON_FP8_CHECK], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)), timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
