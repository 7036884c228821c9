"""model_kernels/cross_entropy.py: the vocabulary's first and last classes as targets, and what the fused ops take
and give back under autocast."""
import pytest
import torch
import torch.nn.functional as F

from model_kernels import cross_entropy
from tests.conftest import assert_loss_and_gradients_match_cross_entropy


def test_the_fused_loss_scores_the_first_and_last_class_as_cross_entropy_does():
    torch.manual_seed(0)
    vocab = 12
    h, w = torch.randn(10, 8, requires_grad=True), (torch.randn(vocab, 8) * 0.5).requires_grad_()
    targets = torch.tensor([vocab - 1, 0, -100, vocab - 1, 3, 0, vocab - 1, -100, 5, vocab - 1])
    assert_loss_and_gradients_match_cross_entropy(lambda h, w, t: cross_entropy.linear_cross_entropy(h, w, t, 4),
                                                  h, w, targets)
    losses = cross_entropy.linear_cross_entropy_losses(h.detach(), w.detach(), targets, 4)
    torch.testing.assert_close(losses, F.cross_entropy(h.detach() @ w.detach().t(), targets, reduction="none"))


@pytest.mark.parametrize("op, fn", [("_linear_cross_entropy_op", "linear_cross_entropy"),
                                           ("_linear_cross_entropy_losses_op", "linear_cross_entropy_losses")])
def test_under_autocast_the_fused_ops_take_h_in_the_autocast_dtype_as_f_linear_would(monkeypatch, op, fn):
    seen = []
    real = getattr(cross_entropy, op)
    monkeypatch.setattr(cross_entropy, op, lambda h, *rest: seen.append(h.dtype) or real(h, *rest))
    h, w, targets = torch.randn(6, 8), torch.randn(10, 8), torch.randint(0, 10, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        getattr(cross_entropy, fn)(h, w, targets, 4)
    getattr(cross_entropy, fn)(h, w, targets, 4)
    assert seen == [torch.bfloat16, torch.float32]


def test_under_autocast_the_weight_gets_a_float32_gradient_not_one_rounded_to_bf16():
    torch.manual_seed(0)
    h, w = torch.randn(16, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cross_entropy.linear_cross_entropy(h, w, torch.randint(0, 10, (16,)), 4).backward()
    assert w.grad.dtype == h.grad.dtype == torch.float32
    assert not torch.equal(w.grad, w.grad.to(torch.bfloat16).float())
