"""The helpers a cold first update would otherwise wait for, started before the run resolves its settings, data and
model: a child process per kernel that compiles at its first call, outside torch.compile (flash-attn-4's CuTe
backward, attention "fa4", or its variable-length pair with context_windows; the fused loss's Triton rows), and
Inductor's pool of compile workers.

Cold, those kernels compile in series with Inductor's code generation, 5 and 2 s of the first update on the H200
(docs/COLD_START.md). Both keep what they compile on disk (flash-attn-4's CuTe cache, which
model_kernels/attention.py turns on, and Triton's cache), and the children inherit the run's cache folders. So a child
per kernel (in parallel: neither waits for the other's compile) imports torch and the kernel's code, about 14 s for
flash-attn-4, then reads its job (the run's shapes) on its input, calls the kernel once at them and prints its name
and its seconds since it was started, with when it had imported torch and the kernel's code and had its job.
start_early() starts them at the process's start, before it imports torch and the project (5 to 10 s on a fresh
machine), on a machine with an NVIDIA GPU whose Inductor cache is empty, so that their imports overlap the process's
own; prestart(), once the run knows its settings and its caches' warmth, keeps those it needs (under the same cache
folders) and starts any missing, so that their imports overlap at least the run's checks, data and model; start()
then gives each child its job (starting any that prestart did not) and ends the ones the run turned out not to
need. The run's own first call of a kernel waits for the child's line (wait) and then loads the kernel from disk
instead of compiling it again. A child that fails or exits early, or gives no line within WAIT_LIMIT_S (then it is
ended), costs the run nothing but that wait: the first call compiles the kernel itself, as without a child.
timings() says when each was ready and how long the run waited for it (bench.py records them).

Inductor starts its compile workers at the first compile, and compiles a kernel in this process, one after another,
while they are not yet ready (torch._inductor.async_compile); each imports torch first. Cold, prestart starts
them too. Warm or cold, it then imports the compiler and hashes the sources its caches' keys need
(import_compiler), which every first compile did in the first update.

    python -m model_kernels.first_calls KERNEL STARTED_UNIX_SECONDS    # then, on its input:
    {"device": "cuda:0", "attention": [[B, T, H, D], ...], "windows": [[ROWS, T, H, D, SMALLEST]], "vocab_size": V}
"""
import atexit
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import env

KERNELS = ("loss", "attention")
NUMBER = r"\d+(?:\.\d+)?"
WAIT_LIMIT_S = 300  # a first call's wait for a child, which takes 2 to 25 s (docs/COLD_START.md)
_children = {}  # kernel -> {"process", "log", "folders"} while its child runs
_timings = {}  # kernel -> {"ready_seconds", "torch_seconds", "code_seconds", "job_seconds": the child's, since it was
#                            started; "waited_seconds": the run's first call's}


def kernels_for(cfg, device, attention, cold):
    """The kernels that would compile at their first call in a run of cfg (its settings) on device (a torch.device),
    with attention its resolved backend, or None before it is resolved (then fa4 wherever the setting allows it);
    cold whether Inductor's cache is empty. None compile beside an eager run (nothing to overlap), on the CPU, with
    SDPA's attention and the plain torch loss; nor with warm caches, where the kernels load from disk in less time
    than a child needs to start (its imports: bench-20m-warm-first-calls waited 9 s for it)."""
    if not cold or not cfg.compile or not cfg.warm_kernels or device.type != "cuda":
        return []
    fa4 = attention == "fa4" if attention is not None else cfg.attention_backend in ("auto", "fa4")
    loss = cfg.loss_impl == "fused" and not cfg.lm_head_fp8
    return [k for k, on in (("loss", loss), ("attention", fa4)) if on]


def spec(cfg, mcfg, device, attention, contexts, cold):
    """What the children compile for a run (cfg its settings, mcfg its ModelConfig, attention its resolved backend,
    contexts its sequence lengths: seq_len and those of its seq_len_schedule, cold whether Inductor's cache is empty);
    None when no kernel would compile at a first call (kernels_for)."""
    kernels = kernels_for(cfg, device, attention, cold)
    if not kernels:
        return None
    # a window of C tokens makes rows of C: micro_batch_size * seq_len / C of them (data/loader.py)
    shapes = [[cfg.micro_batch_size * cfg.seq_len // c, c, mcfg.n_heads, mcfg.head_dim] for c in sorted(contexts)]
    from data.loader import windowed  # here, not at the top: the child imports this module before it times torch's
    in_rows = windowed(cfg.get("context_windows", False), contexts)
    attends = "attention" in kernels
    # context_windows: whole rows of seq_len, and the variable-length pair instead (data/loader.window_tensors)
    rows = [[cfg.micro_batch_size, cfg.seq_len, mcfg.n_heads, mcfg.head_dim, min(contexts)]]
    return {"device": str(device), "attention": shapes if attends and not in_rows else [],
            "windows": rows if attends and in_rows else [],
            "vocab_size": mcfg.vocab_size if "loss" in kernels else 0}


def kernels_of(job):
    """The kernels a job compiles, each a child of its own."""
    return [k for k in KERNELS if (job["vocab_size"] if k == "loss" else job["attention"] or job.get("windows"))]


def start_early(argv, fresh=False, command=None, gpu=None):
    """At a train.py or bench.py process's start, before it imports torch (argv: its arguments): when the machine has
    an NVIDIA GPU (gpu, by default its device node) and Inductor's cache is empty, a child per kernel, each importing
    until prestart keeps or ends it. fresh (bench.py's cold=True among argv's overrides): new, empty cache folders
    first, which the children inherit and the run then takes as its own (env.fresh_compiler_caches). command as
    start()'s."""
    if "-h" in argv or "--help" in argv or not (_has_nvidia_gpu() if gpu is None else gpu):
        return
    if fresh:
        env.fresh_compiler_caches(early=True)
    if env.inductor_cache_empty():
        for kernel in KERNELS:
            _spawn(kernel, command)


def _has_nvidia_gpu():
    return Path("/dev/nvidiactl").exists() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def prestart(cfg, device, cold, command=None):
    """Before the run's checks, data and model, when cold (Inductor's cache is empty): Inductor's compile workers when
    cfg compiles on a GPU, and a child per kernel that the run may compile at a first call (kernels_for before the
    backend is resolved), each importing what it needs until start() gives it its job or ends it; start_early's
    children are kept where they are such a kernel's, under the run's cache folders. device: the torch.device the
    run will use; command as start()'s. Warm, no child nor worker: Inductor loads its kernels from its cache, in this
    process while its workers are not yet up. Then, warm or cold, import_compiler."""
    wanted, folders = kernels_for(cfg, device, None, cold), env.compiler_cache()
    for kernel, child in list(_children.items()):
        if kernel not in wanted or child["folders"] != folders or child["process"].stdin.closed:
            _end(_children.pop(kernel))
    if cold and cfg.compile and device.type == "cuda":
        if cfg.static_launch_user_kernels:  # before the workers start: they read it from their environment
            from model_kernels.swiglu import launch_from_saved_binary
            launch_from_saved_binary()
        from torch._inductor.async_compile import maybe_warm_pool
        maybe_warm_pool()  # what torch.compile's Inductor backend calls at the first compile, called sooner
    for kernel in wanted:
        if kernel not in _children:
            _spawn(kernel, command)
    import_compiler(cfg)


def import_compiler(cfg):
    """What a compiled run's first compile does once a process, whatever the recipe, done as the run starts (prestart),
    with its other imports, where its first update would otherwise pay it (warm_compiler, on): Inductor's modules and
    its device backends' code generators (torch imports them at the first compile: about 1 s on this project's CPU
    runs), and the hashes of torch's and Triton's sources that key Inductor's, AOTAutograd's and Triton's caches
    (torch_key, triton_key: 0.15 and 0.46 s on an H100's host). On the main thread: Triton's hash imports its
    packages, and two threads importing at once can meet a half-made module."""
    if not (cfg.compile and cfg.get("warm_compiler", True)):
        return
    from torch._inductor import codecache, compile_fx  # noqa: F401
    from torch._inductor.codegen.common import init_backend_registration
    from torch._inductor.runtime.triton_compat import HAS_TRITON, triton_key
    init_backend_registration()
    codecache.torch_key()
    if HAS_TRITON:
        triton_key()


def start(job, command=None):
    """Give each kernel of `job` (spec's dict; None has none) its child, prestart's or a new one, and end the other
    children (kernels the job does not compile, or an earlier run's). command(kernel, started) replaces a child's
    command line (the tests' stand-in)."""
    _timings.clear()
    wanted = kernels_of(job) if job is not None else []
    for kernel, child in list(_children.items()):
        if kernel not in wanted or child["process"].stdin.closed:  # not needed, or given an earlier run's job
            _end(_children.pop(kernel))
    for kernel in wanted:
        stdin = (_children.get(kernel) or _spawn(kernel, command))["process"].stdin
        try:
            stdin.write(json.dumps(job) + "\n")
            stdin.close()
        except OSError:  # it has exited (a failed import, say): wait() reports it, _end() closes its input
            pass


def _spawn(kernel, command):
    started = time.time()
    line = (command or _command)(kernel, started)
    log = tempfile.TemporaryFile()  # its errors, for the line a failure prints; a pipe could fill and block it
    _children[kernel] = {"process": subprocess.Popen(line, cwd=Path(__file__).resolve().parent.parent,
                                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                                     text=True), "log": log,
                         "folders": env.compiler_cache()}  # the cache folders it inherited
    return _children[kernel]


def _command(kernel, started):
    return [sys.executable, "-m", "model_kernels.first_calls", kernel, repr(started)]


def wait(kernel):
    """Return once kernel's child (kernel one of KERNELS) has compiled it, has exited or has run past WAIT_LIMIT_S
    (then it is ended, so that a hung child costs the run that wait, not the run); at once without one."""
    child = _children.pop(kernel, None)
    if child is None:
        return
    begin, process = time.perf_counter(), child["process"]
    late = threading.Event()
    limit = threading.Timer(WAIT_LIMIT_S, lambda: (late.set(), process.kill()))  # its output ends, so the loop does
    limit.start()
    try:
        for line in process.stdout:  # its line, after anything a library printed
            ready = ready_line(kernel, line)
            if ready is not None:
                _timings[kernel] = dict(ready, waited_seconds=time.perf_counter() - begin)
                break
        else:
            process.wait()
            child["log"].seek(0)
            lines = child["log"].read().decode(errors="replace").strip().splitlines() or ["no output"]
            why = (f"gave no line within {WAIT_LIMIT_S} s" if late.is_set()
                   else f"exited with {process.returncode} ({lines[-1]})")
            print(f"first calls: the child compiling the {kernel} kernel {why}; compiling it in this process",
                  file=sys.stderr, flush=True)
    finally:
        limit.cancel()
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
    """{kernel: {"ready_seconds", "torch_seconds", "code_seconds", "job_seconds" (the child's, since it was started),
    "waited_seconds"}} of the children that compiled a kernel since start()."""
    return {k: dict(v) for k, v in _timings.items()}


@atexit.register
def stop():
    """End the children still running (a run that stops before its first update needs them no more)."""
    while _children:
        _end(_children.popitem()[1])


def _end(child):
    """Reap a child (one that printed its line exits by itself; one still waiting for its job ends at the end of its
    input) and close its pipes."""
    process = child["process"]
    try:
        process.stdin.close()
    except OSError:  # a job it never read
        pass
    if process.poll() is None:
        process.kill()
    process.wait()
    process.stdout.close()
    child["log"].close()


def compile_kernel(kernel, started, job_text):
    """The child: imports torch and kernel's code, reads its job (job_text(): a line of JSON, "" at the end of its
    input: no job, it exits), calls the kernel once at the job's shapes, then prints its line: its name and its
    seconds since it was started, and when it had imported torch and the kernel's code and had its job
    (name=seconds)."""
    since = lambda: round(time.time() - started, 3)
    import torch
    phases = {"torch": since()}
    if kernel == "loss":
        from model_kernels.cross_entropy import _cross_entropy_rows
    else:
        from model_kernels.attention import _flash_attention_4_backward_op, _windows_backward_op, _windows_op, \
            cudnn_attention_forward, flash_attn_4
        from data.loader import window_tensors
        flash_attn_4()
    phases["code"] = since()
    line = job_text()
    if not line.strip():
        return
    job = json.loads(line)
    phases["job"] = since()
    device = torch.device(job["device"])
    if kernel == "loss":
        logits = torch.randn(4, job["vocab_size"], device=device, dtype=torch.bfloat16)
        targets = torch.zeros(4, dtype=torch.long, device=device)
        for write_grad in (True, False):  # training's loss writes the gradient; evaluation's only the losses
            _cross_entropy_rows(device)(logits.clone(), targets, write_grad=write_grad)
    else:
        # cuDNN's forward first (the run calls it first), which cuDNN generates at run time as PTX for the driver to
        # compile into its own cache (~/.nv/ComputeCache, shared by the run): 0.5 s of a fresh machine's first
        # update (docs/COLD_START.md); then the backward, as the run calls it: what it compiles depends on the shapes
        # and dtypes only, so the saved output and log-sum-exp can be any numbers
        for B, T, H, D in job["attention"]:
            q, k, v, out, grad_out = (torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16) for _ in range(5))
            lse = torch.randn(B, H, T, device=device, dtype=torch.float32)
            if device.type != "cpu":  # a GPU's (the tests run the child on the CPU, or on meta with stand-ins)
                cudnn_attention_forward(q, k, v)
            _flash_attention_4_backward_op(q, k, v, out, lse, grad_out)
        for rows, T, H, D, smallest in job.get("windows", []):  # context_windows: the variable-length pair
            q, k, v, grad_out = (torch.randn(rows * T, H, D, device=device, dtype=torch.bfloat16) for _ in range(4))
            starts = window_tensors(rows, T, smallest, smallest)[1].to(device)
            out, lse = _windows_op(q, k, v, starts, T)
            _windows_backward_op(q, k, v, out, lse, grad_out, starts, T)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(kernel, since(), *(f"{name}={seconds}" for name, seconds in phases.items()), flush=True)


if __name__ == "__main__":
    compile_kernel(sys.argv[1], float(sys.argv[2]), sys.stdin.readline)
