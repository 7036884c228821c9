"""The kernels that compile at their first call, outside torch.compile, compiled in a child process while the run
builds and compiles its model: flash-attn-4's CuTe backward (attention "fa4") and the fused loss's Triton rows.

Cold, they compile in series with Inductor's code generation, 5 and 2 s of the first update on the H200
(docs/PERFORMANCE.md, "Cold start"). Both keep what they compile on disk (flash-attn-4's CuTe cache, which
kernels/attention.py turns on, and Triton's cache), and the child inherits the run's cache folders. So the child
calls each kernel once at the run's shapes, printing its name when done; the run's own first call of a kernel waits
for that line (wait) and then loads it from disk instead of compiling it again. A child that fails or exits early
costs the run nothing but that wait: the first call compiles the kernel itself, as it would have without a child.

    python -m kernels.first_calls '{"device": "cuda:0", "attention": [[B, T, H, D], ...], "backends": "fa4",
                                    "vocab_size": V}'
"""
import atexit
import json
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = ("loss", "attention")  # in the order the run first calls them: the loss in its forward
_child = {"process": None, "done": set(), "log": None}


def spec(cfg, mcfg, device, attention, contexts, cold):
    """What the child compiles for a run (cfg its settings, mcfg its ModelConfig, attention its resolved backend,
    contexts its sequence lengths: seq_len and those of its seq_len_schedule, cold whether Inductor's cache is empty);
    None when nothing would compile at a first call: eager runs (nothing to compile beside), the CPU, SDPA's attention
    with the plain torch loss; and warm caches, where the kernels load from disk in less time than the child needs
    to start (its imports: bench-20m-warm-first-calls waited 9 s for it)."""
    attention_compiles = attention == "fa4"
    loss_compiles = cfg.loss_impl == "fused" and not cfg.lm_head_fp8
    if not cold or not cfg.compile or not cfg.warm_kernels or device.type != "cuda":
        return None
    if not (attention_compiles or loss_compiles):
        return None
    # a window of C tokens makes rows of C: micro_batch_size * seq_len / C of them (data/loader.py)
    shapes = [[cfg.micro_batch_size * cfg.seq_len // c, c, mcfg.n_heads, mcfg.head_dim] for c in sorted(contexts)]
    return {"device": str(device), "attention": shapes if attention_compiles else [], "backends": attention,
            "vocab_size": mcfg.vocab_size if loss_compiles else 0}


def start(job, command=None):
    """Start the child for `job` (spec's dict; None starts nothing). command replaces the child's (the tests' stand-in)."""
    stop()
    if job is None:
        return
    command = command or [sys.executable, "-m", "kernels.first_calls", json.dumps(job)]
    log = tempfile.TemporaryFile()  # its errors, for the line a failure prints; a pipe could fill and block it
    _child.update(process=subprocess.Popen(command, cwd=Path(__file__).resolve().parent.parent,
                                           stdout=subprocess.PIPE, stderr=log, text=True),
                  done=set(), log=log)


def wait(kernel):
    """Return once the child has compiled `kernel` (one of KERNELS) or has exited (reaped once all are done); at
    once without a child."""
    process = _child["process"]
    if process is None or kernel in _child["done"]:
        return
    for line in process.stdout:
        _child["done"].add(line.strip())
        if line.strip() == kernel and not _child["done"].issuperset(KERNELS):
            return
        if line.strip() == kernel:
            break
    if process.wait() != 0:
        _child["log"].seek(0)
        lines = _child["log"].read().decode(errors="replace").strip().splitlines() or ["no output"]
        print(f"first calls: the child compiling the kernels exited with {process.returncode} ({lines[-1]}); "
              f"compiling them in this process", file=sys.stderr, flush=True)
    _forget()


@atexit.register
def stop():
    """End a child that is still running (a run that stops before its first update needs it no more)."""
    process = _child["process"]
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
    _forget()


def _forget():
    if _child["process"] is not None:
        _child["process"].stdout.close()
        _child["log"].close()
    _child["process"] = None


def compile_all(job):
    """The child: each kernel's first call at the job's shapes, its name printed when done."""
    import torch
    from kernels.attention import causal_attention
    from kernels.cross_entropy import _cross_entropy_rows
    device = torch.device(job["device"])
    if job["vocab_size"]:
        logits = torch.randn(4, job["vocab_size"], device=device, dtype=torch.bfloat16)
        targets = torch.zeros(4, dtype=torch.long, device=device)
        for write_grad in (True, False):  # training's loss writes the gradient; evaluation's only the losses
            _cross_entropy_rows(device)(logits.clone(), targets, write_grad=write_grad)
    print("loss", flush=True)
    for shape in job["attention"]:
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        causal_attention(q, k, v, job["backends"]).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print("attention", flush=True)


if __name__ == "__main__":
    compile_all(json.loads(sys.argv[1]))
