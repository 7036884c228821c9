"""model_kernels/first_calls.py: a child's ready line is its own kernel's only, CUDA_VISIBLE_DEVICES="" means no
GPU, and the loss child compiles both of its variants."""
import json
import types

import pytest

from model_kernels import first_calls


def test_a_line_of_another_word_and_a_number_is_not_the_kernels_ready_line():
    """A library's "step 2" or another kernel's line must not end the run's wait for this kernel's compile."""
    assert first_calls.ready_line("loss", "loss 1.5 torch=0.5\n") == {"ready_seconds": 1.5, "torch_seconds": 0.5}
    assert first_calls.ready_line("loss", "attention 1.5 torch=0.5") is None
    assert first_calls.ready_line("attention", "step 2") is None


@pytest.mark.parametrize("visible, gpu", [(None, True), ("0", True), ("", False)])
def test_cuda_visible_devices_set_empty_hides_the_gpu_from_the_early_start(monkeypatch, visible, gpu):
    monkeypatch.setattr(first_calls, "Path", lambda path: types.SimpleNamespace(exists=lambda: True))  # a GPU's node
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert first_calls._has_nvidia_gpu() is gpu


def test_the_loss_child_compiles_the_training_and_the_evaluation_variants(monkeypatch, capsys):
    """Training's loss writes the gradient, evaluation's only the losses: two kernels, both compiled by the child so
    that neither the first update nor the first validation compiles one."""
    from model_kernels import cross_entropy
    calls = []
    monkeypatch.setattr(cross_entropy, "_cross_entropy_rows",
                        lambda device: lambda logits, targets, write_grad: calls.append((logits.shape[1], write_grad)))
    job = {"device": "meta", "attention": [], "windows": [], "vocab_size": 64}
    first_calls.compile_kernel("loss", 0.0, lambda: json.dumps(job))
    assert calls == [(64, True), (64, False)]
    assert capsys.readouterr().out.startswith("loss ")
