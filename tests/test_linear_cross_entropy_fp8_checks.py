"""model_kernels/linear_cross_entropy_fp8.py: probabilities far below e5m2's range in the gradient, the vocabulary and
GPU generations it takes, and the op's own refusal of token counts."""
from types import SimpleNamespace

import pytest
import torch

from model_kernels import linear_cross_entropy_fp8 as fp8


def test_probabilities_far_below_e5m2s_smallest_value_keep_their_gradient():
    n = fp8.MULTIPLE
    h = torch.eye(n)
    w = torch.full((n, n), -19.0).fill_diagonal_(0.0)  # logits w.T, exact in e4m3 and bf16: p near 2**-27 off target
    targets = torch.arange(n)
    _, _, grad_w = fp8._linear_cross_entropy_fp8_impl(h, w, targets, n)
    p = torch.softmax(w.t().double(), dim=1)
    expected = (p - torch.eye(n, dtype=torch.float64)).t()
    off = ~torch.eye(n, dtype=torch.bool)
    assert expected[off].max() < 2 ** -26
    assert torch.allclose(grad_w[off].double(), expected[off], rtol=0.125, atol=0)


def test_a_vocabulary_the_fp8_matmuls_cannot_take_is_refused():
    cfg = dict(micro_batch_size=2, seq_len=64, loss_chunk_tokens=64)
    assert fp8.shape_problem(SimpleNamespace(dim=64, vocab_size=50257), cfg) == (
        "needs the model's vocabulary size to be a multiple of 16 (FP8 matmuls), got 50257")
    assert fp8.shape_problem(SimpleNamespace(dim=64, vocab_size=50304), cfg) is None


@pytest.mark.parametrize("capability, runs", [((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)])
def test_gpus_from_ada_on_run_the_fp8_head(fake_gpu, capability, runs):
    fake_gpu(capability)
    problem = fp8.device_problem(torch.device("cuda"))
    assert problem is None if runs else problem.endswith(f"NVIDIA GPU has {capability[0]}.{capability[1]}")


@pytest.mark.parametrize("tokens, chunk", [(24, 16), (32, 24)])
def test_the_op_refuses_token_counts_its_matmuls_cannot_take(tokens, chunk):
    h, w = torch.randn(tokens, 16), torch.randn(32, 16)
    with pytest.raises(ValueError, match=f"multiples of 16 \\(FP8 matmuls\\), got {tokens} and {min(tokens, chunk)}"):
        fp8.linear_cross_entropy_fp8(h, w, torch.zeros(tokens, dtype=torch.long), chunk)
