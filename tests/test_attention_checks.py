"""model_kernels/attention.py: which GPUs "auto" sends to fa4, the flash-attn-4 kernel cache setting, "auto" taking
fa4 in a model used without the Trainer, and the longest window the variable-length kernels are given."""
import os

import pytest
import torch
import torch.nn.functional as F

from data.loader import window_tensors
from model_kernels import attention
from tests.conftest import cudnn_attention_by_hand
from tests.test_quack_ops import outputs_and_gradients
from tests.test_schedules import varlen_backward_by_hand, varlen_forward_by_hand, windows_of


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)


@pytest.mark.parametrize("capability, backend", [((9, 0), "fa4"), ((10, 0), "fa4"), ((8, 9), "sdpa"),
                                                 ((12, 0), "sdpa")])
def test_auto_attention_is_fa4_on_hopper_and_blackwell_only(flash_attn_4_stand_in, fake_gpu, capability, backend):
    fake_gpu(capability)
    chosen, why = attention.resolve_backend("auto", "cuda")
    assert chosen == backend
    assert (attention.fa4_problem(torch.device("cuda")) is None) == (backend == "fa4")
    if backend == "sdpa":
        assert why == "the default; fa4 runs on Hopper and Blackwell GPUs only, not on NVIDIA GPU"


def test_flash_attn_4s_kernel_cache_is_turned_on_unless_the_user_turned_it_off(flash_attn_4_stand_in, monkeypatch):
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    assert attention.flash_attn_4_problem() is None
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    assert attention.flash_attn_4_problem() is None
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"


def test_auto_attention_trains_through_fa4_where_it_runs_with_sdpas_numbers(flash_attn_4_stand_in, monkeypatch):
    forwards = []
    monkeypatch.setattr(attention, "_fa4_runs_on", lambda device: True)
    monkeypatch.setattr(attention, "_cudnn_sdpa", lambda *a: forwards.append(1) or cudnn_attention_by_hand(*a))
    torch.manual_seed(0)
    inputs, probe = [torch.randn(2, 8, 2, 4) for _ in range(3)], torch.randn(2, 8, 2, 4)
    got = outputs_and_gradients(lambda q, k, v: attention.causal_attention(q, k, v, "auto"), inputs, probe)
    assert forwards == [1]
    for a, b in zip(got, outputs_and_gradients(sdpa_causal, inputs, probe)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fa4_windows_as_long_as_the_row_reach_both_kernels_within_the_longest_they_are_given(flash_attn_4_stand_in):
    def within_longest(by_hand):
        def call(*args, **kwargs):
            starts = kwargs["cu_seqlens_q"]
            assert max(b - a for a, b in windows_of(starts)) <= kwargs["max_seqlen_q"] == kwargs["max_seqlen_k"]
            return by_hand(*args, **kwargs)
        return call
    flash_attn_4_stand_in._flash_attn_fwd = within_longest(varlen_forward_by_hand)
    flash_attn_4_stand_in._flash_attn_bwd = within_longest(varlen_backward_by_hand)
    torch.manual_seed(0)
    T = 8
    inputs, probe = [torch.randn(2, T, 2, 4) for _ in range(3)], torch.randn(2, T, 2, 4)
    windows = window_tensors(2, T, T, smallest=T // 2)
    got = outputs_and_gradients(lambda q, k, v: attention.causal_attention(q, k, v, "fa4", windows), inputs, probe)
    for a, b in zip(got, outputs_and_gradients(sdpa_causal, inputs, probe)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
