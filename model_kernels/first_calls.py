"""The kernels that compile at their first call, outside torch.compile, compiled in child processes while the run
builds and compiles its model: flash-attn-4's CuTe backward (attention "fa4") and the fused loss's Triton rows.

Cold, they compile in series with Inductor's code generation, 5 and 2 s of the first update on the H200
(docs/COLD_START.md). Both keep what they compile on disk (flash-attn-4's CuTe cache, which
model_kernels/attention.py turns on, and Triton's cache), and the children inherit the run's cache folders. So a child
per kernel (in parallel: neither waits for the other's compile) calls it once at the run's shapes and prints its
name, its seconds since the run started it and when it had imported torch and the kernel's code. The run's own
first call of a kernel waits for that line (wait) and then loads the kernel from disk instead of compiling it
again. A child that fails or exits early costs the run nothing but that wait: the first call compiles the kernel
itself, as it would have without a child. timings() says when each was ready and how long the run waited for it
(bench.py records them).

    python -m model_kernels.first_calls KERNEL '{"device": "cuda:0", "attention": [[B, T, H, D], ...],
                                                 "vocab_size": V, "started": UNIX_SECONDS}'
"""
import atexit
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNELS = ("loss", "attention")
NUMBER = r"\d+(?:\.\d+)?"
_children = {}  # kernel -> {"process", "log"} while its child runs
_timings = {}  # kernel -> {"ready_seconds": the child's, since start(); "waited_seconds": the run's first call's;
#                            "torch_seconds", "code_seconds": when the child had imported torch, the kernel's code}


def spec(cfg, mcfg, device, attention, contexts, cold):
    """What the children compile for a run (cfg its settings, mcfg its ModelConfig, attention its resolved backend,
    contexts its sequence lengths: seq_len and those of its seq_len_schedule, cold whether Inductor's cache is empty);
    None when nothing would compile at a first call: eager runs (nothing to compile beside), the CPU, SDPA's attention
    with the plain torch loss; and warm caches, where the kernels load from disk in less time than a child needs
    to start (its imports: bench-20m-warm-first-calls waited 9 s for it)."""
    attention_compiles = attention == "fa4"
    loss_compiles = cfg.loss_impl == "fused" and not cfg.lm_head_fp8
    if not cold or not cfg.compile or not cfg.warm_kernels or device.type != "cuda":
        return None
    if not (attention_compiles or loss_compiles):
        return None
    # a window of C tokens makes rows of C: micro_batch_size * seq_len / C of them (data/loader.py)
    shapes = [[cfg.micro_batch_size * cfg.seq_len // c, c, mcfg.n_heads, mcfg.head_dim] for c in sorted(contexts)]
    return {"device": str(device), "attention": shapes if attention_compiles else [],
            "vocab_size": mcfg.vocab_size if loss_compiles else 0}


def kernels_of(job):
    """The kernels a job compiles, each a child of its own."""
    return [k for k in KERNELS if (job["vocab_size"] if k == "loss" else job["attention"])]


def start(job, command=None):
    """Start a child per kernel of `job` (spec's dict; None starts none). command(kernel, job) replaces a child's
    command line (the tests' stand-in)."""
    stop()
    _timings.clear()
    if job is None:
        return
    job = dict(job, started=time.time())
    for kernel in kernels_of(job):
        line = (command or _command)(kernel, job)
        log = tempfile.TemporaryFile()  # its errors, for the line a failure prints; a pipe could fill and block it
        _children[kernel] = {"process": subprocess.Popen(line, cwd=Path(__file__).resolve().parent.parent,
                                                         stdout=subprocess.PIPE, stderr=log, text=True), "log": log}


def _command(kernel, job):
    return [sys.executable, "-m", "model_kernels.first_calls", kernel, json.dumps(job)]


def wait(kernel):
    """Return once kernel's child (kernel one of KERNELS) has compiled it or has exited; at once without one."""
    child = _children.pop(kernel, None)
    if child is None:
        return
    begin, process = time.perf_counter(), child["process"]
    for line in process.stdout:  # its line, after anything a library printed
        ready = ready_line(kernel, line)
        if ready is not None:
            _timings[kernel] = dict(ready, waited_seconds=time.perf_counter() - begin)
            break
    else:
        process.wait()
        child["log"].seek(0)
        lines = child["log"].read().decode(errors="replace").strip().splitlines() or ["no output"]
        print(f"first calls: the child compiling the {kernel} kernel exited with {process.returncode} ({lines[-1]}); "
              f"compiling it in this process", file=sys.stderr, flush=True)
    _end(child)


def ready_line(kernel, line):
    """{"ready_seconds", and each phase's "NAME_seconds"} when line is the child's line for kernel
    ("KERNEL SECONDS NAME=SECONDS ..."), else None (a library's output, which may begin with the same word)."""
    match = re.fullmatch(rf"{kernel} ({NUMBER})((?: \w+={NUMBER})*)", line.strip())
    if match is None:
        return None
    phases = dict(word.split("=") for word in match.group(2).split())
    return {"ready_seconds": float(match.group(1)), **{f"{k}_seconds": float(v) for k, v in phases.items()}}


def timings():
    """{kernel: {"ready_seconds", "waited_seconds", "torch_seconds", "code_seconds"}} of the children that compiled
    a kernel since start()."""
    return {k: dict(v) for k, v in _timings.items()}


@atexit.register
def stop():
    """End the children still running (a run that stops before its first update needs them no more)."""
    while _children:
        _end(_children.popitem()[1])


def _end(child):
    """Reap a child (one that printed its line exits by itself) and close its pipes."""
    process = child["process"]
    if process.poll() is None:
        process.kill()
    process.wait()
    process.stdout.close()
    child["log"].close()


def compile_kernel(kernel, job):
    """The child: kernel's first call at the job's shapes, then its line: its name and the seconds since the run
    started it, and when it had imported torch and the kernel's code (name=seconds)."""
    since = lambda: round(time.time() - job["started"], 3)
    import torch
    phases = {"torch": since()}
    device = torch.device(job["device"])
    if kernel == "loss":
        from model_kernels.cross_entropy import _cross_entropy_rows
        phases["code"] = since()
        logits = torch.randn(4, job["vocab_size"], device=device, dtype=torch.bfloat16)
        targets = torch.zeros(4, dtype=torch.long, device=device)
        for write_grad in (True, False):  # training's loss writes the gradient; evaluation's only the losses
            _cross_entropy_rows(device)(logits.clone(), targets, write_grad=write_grad)
    else:
        # the backward alone, as the run calls it: what it compiles depends on the shapes and dtypes only, so the
        # saved output and log-sum-exp can be any numbers (and no cuDNN forward need load here)
        from model_kernels.attention import _flash_attention_4_backward_op, flash_attn_4
        flash_attn_4()
        phases["code"] = since()
        for B, T, H, D in job["attention"]:
            q, k, v, out, grad_out = (torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16) for _ in range(5))
            lse = torch.randn(B, H, T, device=device, dtype=torch.float32)
            _flash_attention_4_backward_op(q, k, v, out, lse, grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(kernel, since(), *(f"{name}={seconds}" for name, seconds in phases.items()), flush=True)


if __name__ == "__main__":
    compile_kernel(sys.argv[1], json.loads(sys.argv[2]))
