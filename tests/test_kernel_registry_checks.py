"""model_kernels/registry.py's refusal of fa4 on a device it cannot run on: one line, its reason named once."""
import torch

import settings
import train
from model_kernels import attention, registry


def test_fa4_on_the_cpu_with_its_package_installed_is_refused_without_a_doubled_name(monkeypatch):
    """fa4_problem's words begin with "fa4 "; the refusal already names the choice, so they lose that prefix."""
    monkeypatch.setattr(attention, "flash_attn_4_problem", lambda: None)  # as if flash-attn-4 imported
    cfg = settings.Config(train.DEFAULTS, attention_backend="fa4")
    assert registry.problem(cfg, torch.device("cpu")) == (
        "attention_backend 'fa4' runs on Hopper and Blackwell GPUs only, not on the cpu; choose auto, sdpa or math "
        "instead")
