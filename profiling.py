"""GPU kernel time by category, from torch.profiler: what bench.py's profile and the microbenchmarks in scripts/
report (a category says where an update's time goes; the kernels' names say which one to work on).

quiet_profile runs torch.profiler without its own lines, which landed in bench.py's output (every bench run
profiles one update for its attention kernels) and so in what tune.py reads of each candidate: libkineto, its C++
side, writes lines to the process's stderr as a profile starts and stops (torch 2.13's CPU build
"USDT:... profiler_start"; "STAGE:... Completed Stage: Warm Up" and CUPTI's notices in other builds and log
levels), and torch.profiler warns in Python (torch 2.11 on an H200: "Profiler clears events at the end of each
cycle")."""
import contextlib
import os
import re
import sys
import tempfile
import warnings

import torch

# Kernel-name patterns by category, first match wins (order matters: attention before softmax, etc.).
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    # CuTe-DSL kernels are all named kernel_cutlass_kernel_<module><class>: quack's loss is no matmul
    ("cross_entropy", ("cutlass_kernel_quackcross_entropy", "cutlass_kernel_quacklinear_cross_entropy")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                "aten::_scaled_mm", "aten::matmul", "aten::linear", "splitkreduce", "sm90_", "sm80_",
                "triton_tem_")),  # Inductor's Triton matmul templates (max-autotune), whose names hold "add" or "copy"
    ("cross_entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm", "clip_grad", "_amp_")),
    ("norm", ("rms_norm", "rmsnorm", "rsqrt", "layer_norm")),
    # cos and sin as words: cub's "SingleTile" kernels (a sort in the embedding's backward) are no rotary
    ("rotary", ("rotary", "rope", "cat_neg", "neg_cat", re.compile(r"(?<![a-z])(cos|sin)(?![a-z])"))),
    ("elementwise", ("triton_poi", "triton_per", "triton_red", "elementwise", "vectorized", "copy", "fill",
                     "transpose", "add", "mul", "silu", "swiglu", "sigmoid", "catarray", "aten::cat", "index",
                     "embedding", "reduce")),
]
PROFILE_CATEGORIES = list(dict.fromkeys(c for c, _ in CATEGORIES)) + ["other"]


def categorize(kernel_name):
    low = kernel_name.lower()
    if "nccl" in low:
        return "other"  # communication (DDP's all-reduce), whose names would match "reduce" below
    for category, patterns in CATEGORIES:
        if any(p.search(low) if isinstance(p, re.Pattern) else p in low for p in patterns):
            return category
    return "other"


def kernel_breakdown(kernels, top=25):
    """kernels: [(name, count, milliseconds)] -> counts and milliseconds by category, with totals, and the
    `top` kernels by time (a category says where the time goes; the names say which kernel to work on)."""
    by_ms = {c: 0.0 for c in PROFILE_CATEGORIES}
    by_count = {c: 0 for c in PROFILE_CATEGORIES}
    for name, count, ms in kernels:
        category = categorize(name)
        by_ms[category] += ms
        by_count[category] += count
    slowest = sorted(kernels, key=lambda k: k[2], reverse=True)[:top]
    return {"kernel_count": sum(by_count.values()), "kernel_ms": sum(by_ms.values()),
            "kernel_ms_by_category": by_ms, "kernel_count_by_category": by_count,
            "top_kernels": [{"name": name[:160], "category": categorize(name), "count": count, "ms": ms}
                            for name, count, ms in slowest]}


def gpu_kernel_ms(evt):
    """GPU milliseconds of a profiler event that is a kernel, else 0. A record_function range (the optimizer's
    step) also shows on the GPU's timeline, spanning the kernels it launched: counting it would count those
    kernels twice, and torch's own table total leaves it out too."""
    device_us = getattr(evt, "self_device_time_total", None)
    if device_us is None:
        device_us = getattr(evt, "self_cuda_time_total", 0)
    if getattr(evt, "is_user_annotation", False) or not str(evt.device_type).endswith("CUDA"):
        return 0
    return device_us / 1e3


# A line of libkineto's log ("STAGE:2026-12-02 13:32:10 22990:22990 SyncActivityProfilerHandler.cpp:51] ...", the
# level before the colon) or one naming CUPTI or Kineto ("[W kineto_shim.cpp:...]", "libkineto: ...")
PROFILER_LINE = re.compile(r"^[A-Z]+:\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ \w+\.cpp:\d+\]|CUPTI|[Kk]ineto")


def is_profiler_line(line):
    """Whether a line of output is torch.profiler's own (libkineto's log, CUPTI's notices), not the program's."""
    return bool(PROFILER_LINE.search(line))


@contextlib.contextmanager
def quiet_profile(activities):
    """torch.profiler.profile(activities=...), yielding the profile, with its lines held back: what is written to
    the process's stderr (file descriptor 2, where libkineto writes) while it runs is passed on afterwards without
    the profiler's lines, and torch.profiler's own Python warnings are left out."""
    from torch.profiler import profile
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", module=r"torch\.(autograd\.)?profiler")
                    with profile(activities=activities) as prof:
                        yield prof
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                        if not is_profiler_line(line)]
                if kept:  # the profiled work's own warnings, which are not the profiler's
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()
    finally:
        os.close(saved)


def profiled_kernels(trainer, batches, n_updates):
    """Run n_updates under torch.profiler (quietly); the device kernels (or, on the CPU, the ops) that ran."""
    from torch.profiler import ProfilerActivity
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with quiet_profile(activities) as prof:
        for _ in range(n_updates):
            trainer.update(*next(batches))
        if cuda:
            torch.cuda.synchronize()
    kernels, op_names = [], set()
    for evt in prof.key_averages():
        op_names.add(evt.key)
        if cuda:
            ms = gpu_kernel_ms(evt)
            if ms:
                kernels.append((evt.key, evt.count, ms))
        elif evt.self_cpu_time_total > 0:
            kernels.append((evt.key, evt.count, evt.self_cpu_time_total / 1e3))
    attention = sorted(n for n in op_names if categorize(n) == "attention")  # every kernel's key is an op name
    return kernels, attention
