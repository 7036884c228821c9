"""model_kernels/quack_ops.py: the GPUs and installs its choices run on, the shapes they refuse, and the MLP's tuning
choice reaching quack; quack stood in as in tests/test_quack_ops.py."""
import sys
from types import SimpleNamespace

import pytest
import torch

import settings
import train
from model_kernels import quack_ops, registry
from tests.test_quack_ops import quack_stand_in  # noqa: F401 (fixture)

CUDA = torch.device("cuda")


@pytest.mark.parametrize("capability", [(8, 9), (10, 0), (12, 0)])
def test_quack_choices_are_refused_on_gpus_other_than_sm90(quack_stand_in, fake_gpu, capability):  # noqa: F811
    fake_gpu(capability)
    assert quack_ops.quack_problem(CUDA) == f"NVIDIA GPU has compute capability {capability[0]}.{capability[1]}"


def test_a_hopper_gpu_with_quack_installed_takes_both_quack_choices(quack_stand_in, fake_gpu):  # noqa: F811
    fake_gpu((9, 0))
    assert quack_ops.quack_problem(CUDA) is None and quack_ops.device_problem(CUDA) is None
    cfg = settings.Config(train.DEFAULTS, loss_impl="quack_chunked", mlp_impl="quack")
    assert registry.problem(cfg, CUDA) is None


@pytest.mark.parametrize("missing", ["quack.mlp", "quack.linear_cross_entropy"])
def test_a_quack_without_either_module_is_refused_before_the_model_and_by_load(quack_stand_in, fake_gpu, monkeypatch,
                                                                                missing):  # noqa: F811
    fake_gpu((9, 0))
    monkeypatch.setitem(sys.modules, missing, None)
    assert quack_ops.quack_problem(CUDA).startswith("quack did not import (ModuleNotFoundError")
    with pytest.raises(ValueError, match="quack-kernels did not import"):
        quack_ops.load()


@pytest.mark.parametrize("problem, cfg, model_config, words", [
    (quack_ops.loss_shape_problem, dict(loss_chunk_tokens=1004, micro_batch_size=1, seq_len=8), None,
     "loss_chunk_tokens to be a multiple of 8 (rows its matmuls load whole), got 1004"),
    (quack_ops.mlp_shape_problem, {}, SimpleNamespace(dim=100, hidden_dim=256),
     "the model's width and hidden width to be multiples of 8 (rows of 16 bytes for quack's loads), got 100 and 256"),
])
def test_shapes_off_quacks_16_byte_rows_are_refused(problem, cfg, model_config, words):
    assert problem(model_config, cfg) == f"needs {words}"


def test_the_mlps_tuning_choice_reaches_quack(quack_stand_in):  # noqa: F811
    x, w13, w2 = torch.randn(2, 3, 8), torch.randn(12, 8), torch.randn(8, 6)
    for tuned, expected in ((False, False), (True, True), (None, quack_ops.TUNED)):
        quack_ops.swiglu_mlp(x, w13, w2, tuned=tuned)
        assert quack_stand_in[-1]["tuned"] is expected
