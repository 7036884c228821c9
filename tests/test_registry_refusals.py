"""model_kernels/registry.py's refusals that the CPU can reach only with the GPU's facts stood in for, and a name that
is no choice."""
import torch

import settings
import train
from model_kernels import registry


def cfg(**change):
    return settings.Config(train.DEFAULTS, **change)


def test_the_fp8_head_on_a_gpu_without_fp8_tensor_cores_is_refused_with_what_to_change(fake_gpu):
    """The declared FP8 head (a recipe key) passes the settings' own numbers, then meets the GPU: an A100's 8.0 is
    refused in one line that says to turn it off; an H100's 9.0, and the CPU, run it."""
    fake_gpu((8, 0), "NVIDIA A100")
    fp8_head, gpu = cfg(loss_impl="fused", lm_head_fp8=True), torch.device("cuda")
    assert registry.problem(fp8_head) is None
    assert registry.problem(fp8_head, gpu) == (
        "lm_head_fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); NVIDIA A100 "
        "has 8.0; set lm_head_fp8=False")
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    assert registry.problem(fp8_head, gpu) is None
    assert registry.problem(fp8_head, torch.device("cpu")) is None


def test_a_name_that_is_no_choice_is_a_line_listing_the_choices():
    line = registry.problem({**cfg(), "loss_impl": "nope"})
    assert line == "loss_impl 'nope' is not one of full, fused, quack_chunked"
