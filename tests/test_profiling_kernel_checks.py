"""profiling.py: the profiled updates and attention names, a quiet profile's own lines, kernel names as they come."""
from types import SimpleNamespace as Event

import torch

import profiling


class AttentionStandIn:
    """A stand-in trainer whose update is one causal attention and one matmul, counting its updates."""
    device = torch.device("cpu")

    def __init__(self):
        self.updates = 0
        self.q = torch.randn(1, 2, 8, 4)
        self.w = torch.randn(4, 4)

    def update(self):
        self.updates += 1
        out = torch.nn.functional.scaled_dot_product_attention(self.q, self.q, self.q, is_causal=True)
        return (out @ self.w).sum(), None


def test_profiled_kernels_runs_the_updates_asked_and_names_only_attention_kernels():
    trainer = AttentionStandIn()
    kernels, attention = profiling.profiled_kernels(trainer, iter(tuple, None), 3)
    assert trainer.updates == 3
    assert attention and all(profiling.categorize(name) == "attention" for name in attention)
    assert attention == sorted(attention) and "aten::matmul" not in attention
    names = [name for name, _, _ in kernels]
    assert "aten::matmul" in names or "aten::mm" in names
    assert all(count > 0 and ms > 0 for _, count, ms in kernels)  # the CPU's ops that took time


def test_gpu_kernel_ms_reads_older_torchs_cuda_time_field():
    """torch before self_device_time_total named a kernel's time self_cuda_time_total."""
    older = Event(key="nvjet_tst_128x64", device_type="DeviceType.CUDA", self_cuda_time_total=200.0,
                  is_user_annotation=False)
    assert profiling.gpu_kernel_ms(older) == 0.2


def test_the_slowest_kernels_names_are_cut_to_160_characters():
    """A templated kernel's name runs to thousands of characters: the results file keeps its first 160."""
    name = "void cutlass::Kernel<" + "x" * 400 + ">"
    top = profiling.kernel_breakdown([(name, 2, 1.0)])["top_kernels"]
    assert top == [{"name": name[:160], "category": "matmul", "count": 2, "ms": 1.0}]


def test_a_quiet_profile_passes_on_what_the_work_writes_to_the_stderr_descriptor(capfd):
    """libkineto and the profiled work's C++ side write to file descriptor 2, not through sys.stderr: the work's own
    lines come out afterwards, the profiler's do not."""
    import os
    from torch.profiler import ProfilerActivity
    with profiling.quiet_profile([ProfilerActivity.CPU]):
        os.write(2, b"the work's own C++ warning\n")
        os.write(2, b"STAGE:2026-12-02 13:32:10 22990:22990 SyncActivityProfilerHandler.cpp:51] Completed Stage\n")
    err = capfd.readouterr().err
    assert "the work's own C++ warning" in err and "SyncActivityProfilerHandler" not in err, err


def test_kernel_names_are_matched_whatever_their_case():
    """CUDA's own kernels are CamelCase (the concatenation in the embedding's backward, say)."""
    assert profiling.categorize("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 3>") == \
        "elementwise"
