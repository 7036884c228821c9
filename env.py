"""The environment a result comes from: the fingerprint of machine and software, the identities that name a
config and the code, the GPU's peak for MFU, and SLURM's accounting. One place for each: scripts import these.
"""
import datetime
import getpass
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent
GENERATED_CONFIG = b"# a config file written by tiny-llm"  # the first line of those the scripts write (no code)


# ---------------------------------------------------------------- identities

def hash_json(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def config_identity(config):
    """Hash of every config key: two runs with the same identity ran the same settings."""
    return hash_json(config)


def source_hash(root=REPO):
    """Hash of the repository's Python files (path and bytes), so an entry names the code that produced it. Tests,
    scripts and configs are left out (an entry records its config; a changed hash makes tune.py measure again and
    compare.py train again), and so are generated folders (out/, caches) and the config files the scripts write
    wherever their out_dir is (GENERATED_CONFIG first)."""
    digest, files = hashlib.sha256(), []
    skip = {"venv", "__pycache__", "out", "runs", "cache", "tests", "scripts", "config"}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.startswith(".")]  # never .venv
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    for path, data in ((path, path.read_bytes()) for path in sorted(files)):
        if not data.startswith(GENERATED_CONFIG):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + data + b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------- fingerprint

def _run(cmd, cwd=None):
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def package_versions(names=("torch", "triton", "numpy", "datasets", "transformers", "tokenizers")):
    """{distribution name: its installed version, or None}."""
    from importlib import metadata
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


COMPILER_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
_before_early_fresh = {}  # the variables as they were when fresh_compiler_caches(early=True) replaced them


def compiler_cache():
    """The Inductor, Triton and flash-attn-4 cache folders in effect: each library's environment variable, else its
    default by the library's rule (flash-attn-4's None), without importing them."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)  # torch._inductor.runtime.cache_dir_utils's default folder
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    triton_home = os.environ.get("TRITON_HOME") or str(Path.home())  # triton.knobs.cache.dir's default
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(inductor),
            "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or os.path.join(triton_home, ".triton", "cache"),
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")}


def fresh_compiler_caches(early=False):
    """Point the compiler caches at new, empty folders (a cold compile), before anything imports flash-attn-4 (which
    reads its folder at import). early: at the process's start, before its settings are read (model_kernels/
    first_calls.start_early), so that the helpers started then inherit them; compiler_cache_state() then takes them as
    the run's, or puts the variables back when the run turns out not to be cold."""
    if early:
        _before_early_fresh.update({variable: os.environ.get(variable) for variable in CACHE_VARIABLES})
    root = tempfile.mkdtemp(prefix="tiny-llm-cold-")
    for variable, folder in zip(CACHE_VARIABLES, ("inductor", "triton", "flash_attention_cute_dsl")):
        os.environ[variable] = os.path.join(root, folder)


def compiler_cache_state(fresh=False):
    """(the compiler caches' folders, whether Inductor's is empty); fresh points them at new, empty folders first
    (a cold compile), or keeps those made at the process's start for it."""
    if _before_early_fresh and not fresh:
        for variable, value in _before_early_fresh.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
    elif fresh and not _before_early_fresh:
        fresh_compiler_caches()
    _before_early_fresh.clear()
    return compiler_cache(), inductor_cache_empty()


def inductor_cache_empty():
    """Whether Inductor's cache folder in effect holds nothing (a cold compile)."""
    inductor = Path(compiler_cache()["TORCHINDUCTOR_CACHE_DIR"])
    return not (inductor.is_dir() and any(inductor.iterdir()))


def inductor_graph_counts():
    """{"compiled", "from_cache", "kernels_from_binaries"}: the graphs Inductor has made in this process so far, those
    of them its FX graph cache held (a warm start compiles none; a cold one takes none from the cache), and the
    kernels those cached graphs launch from their saved binaries, without Triton (static_launch_user_kernels adds
    the SwiGLU kernel's)."""
    from torch._dynamo.utils import counters
    inductor = counters["inductor"]
    return {"compiled": inductor["fxgraph_cache_miss"], "from_cache": inductor["fxgraph_cache_hit"],
            "kernels_from_binaries": inductor["triton_bundler_load_static_autotuner"]}


def compile_totals():
    """What torch.compile has done in this process so far (Inductor's graph counts, Dynamo's timers): a mark for
    compiled_since, since neither is reset between the runs of one process (bench.py's presets)."""
    from torch._dynamo.utils import calculate_time_spent
    return inductor_graph_counts(), calculate_time_spent()


def compiled_since(mark=None):
    """(graphs, seconds) that torch.compile made and spent since mark (compile_totals(); None: since the process
    began). graphs as inductor_graph_counts'; seconds by phase from Dynamo's timers: Dynamo's tracing, AOTAutograd
    (and, warm, the caches' loads), Inductor's code generation, the wait for Triton's compiles (or loads), and their
    total. Around a run's first update, what of it went to compiling, cold or warm; the rest is the kernels' first
    calls, the graphs' capture and the update itself."""
    graphs_before, spent_before = mark or ({}, {})
    graphs, spent = compile_totals()
    took = lambda name: spent.get(name, 0.0) - spent_before.get(name, 0.0)
    frame, backend, backward = took("entire_frame_compile"), took("backend_compile"), took("entire_backward_compile")
    inductor, wait = took("inductor_compile"), took("async_compile.wait")
    # Inductor's timer covers the forward's and (compiled at the first backward) the backward's graphs, and the wait
    # within them; on a cache hit it does not run, and the wait (for the loaded kernels) is AOTAutograd's
    inductor_or_wait = max(inductor, wait)
    seconds = {"dynamo_tracing": frame - backend, "aot_autograd": backend + backward - inductor_or_wait,
               "inductor_codegen": inductor_or_wait - wait, "triton_compile_wait": wait,
               "compile_total": frame + backward}
    return {k: n - graphs_before.get(k, 0) for k, n in graphs.items()}, seconds


def gpu_model():
    """The first visible GPU's name, as the fingerprint records it; None without CUDA."""
    import torch  # here, as in fingerprint: importing env imports no torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def cpu_model():
    """The processor's name from /proc/cpuinfo (Linux), else platform.processor(); None when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def fingerprint(cache_identity=None):
    """The machine and software a result came from; a field that does not exist here is null."""
    import torch
    cuda = torch.cuda.is_available()
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")} or None
    # The compiler reads these (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1, ...), and they change the kernels it makes.
    compiler_settings = {k: v for k, v in os.environ.items() if k.startswith(COMPILER_ENV_PREFIXES)
                         and k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")} or None
    smi = "nvidia-smi"
    return {
        "python": sys.version, "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": package_versions(),
        "cuda": torch.version.cuda if cuda else None,
        "git_revision": _run(["git", "rev-parse", "HEAD"], cwd=REPO),
        "git_status": _run(["git", "status", "--porcelain"], cwd=REPO),
        "gpu": gpu_model(),
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "source_hash": source_hash(),
        "compiler_cache": compiler_cache(),
        "compiler_settings": compiler_settings,
        "cpu_model": cpu_model(),  # eager training is launch-bound: its speed is the CPU's as much as the GPU's
        "cpu_affinity": affinity,
        "cpu_threads": torch.get_num_threads(),
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "slurm": slurm,
        "gpu_status": _run([smi, "--query-gpu=uuid,name,driver_version,memory.total,power.limit,power.draw,"
                                 "clocks.current.sm,clocks.current.memory,utilization.gpu", "--format=csv"]),
        "gpu_topology": _run([smi, "topo", "-m"]),
        "cache_identity": cache_identity,
    }


def allocation_usage(environ=None, now=None):
    """Under SLURM, what this job's allocation has used so far (the reference's allocation-usage); else None."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    now = time.time() if now is None else now
    per_node = environ.get("SLURM_GPUS_ON_NODE")
    count = lambda text: sum(int(part.split(":")[-1]) for part in text.split(","))  # "4", "h100:4,a100:2"
    try:  # SLURM_GPUS is the job's total, not a node's
        gpus = (count(per_node) * int(environ.get("SLURM_NNODES", "1")) if per_node
                else count(environ.get("SLURM_GPUS") or "0"))
    except ValueError:
        gpus = None
    start = environ.get("SLURM_JOB_START_TIME")
    end = environ.get("SLURM_JOB_END_TIME")
    iso = lambda t: datetime.datetime.fromtimestamp(int(t)).isoformat() if t else None
    elapsed = int(now - int(start)) if start else None
    return {"job_id": job, "account": environ.get("SLURM_JOB_ACCOUNT"), "partition": environ.get("SLURM_JOB_PARTITION"),
            "gpus": gpus, "start_local": iso(start), "end_local": iso(end), "timezone": time.strftime("%Z"),
            "elapsed_seconds": elapsed,
            "gpu_hours": elapsed * gpus / 3600 if elapsed is not None and gpus is not None else None}


# Dense bf16 tensor-core peak by device name, for MFU (the datasheets give twice these, with sparsity). A name
# matches as whole words, longest first: "GH200" is not an H200's, "RTX A1000" not an A100's, and the PCIe and
# NVL cards run at lower clocks than the SXM parts named plainly ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_BF16_FLOPS = {"GH200": 989e12, "H200": 989e12, "H200 NVL": 835e12, "H100": 989e12, "H100 PCIe": 756e12,
                   "H100 NVL": 835e12, "A100": 312e12}


def mfu(flops_per_token, tokens_per_second_per_gpu, device_name):
    """Model FLOPs utilization: FLOPs per token x tokens/s per GPU / the GPU's dense bf16 peak (None if unknown)."""
    peak = peak_flops(device_name)
    return flops_per_token * tokens_per_second_per_gpu / peak if peak and tokens_per_second_per_gpu else None


def peak_flops(device_name):
    """Dense bf16 peak FLOP/s of a named GPU, or None when unknown (MFU is then reported as null)."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


def portable_traceback(limit=8):
    """The exception being handled, as traceback.format_exc writes it, without this machine's paths: repository
    files relative to the repository, installed packages from site-packages on, the standard library as stdlib/.
    The results file is shared."""
    text = traceback.format_exc(limit=limit).replace(f'"{REPO}{os.sep}', '"')
    text = text.replace(f'"{sysconfig.get_paths()["stdlib"]}{os.sep}', '"stdlib/')
    return re.sub(r'"[^"\n]*?[/\\]((?:site|dist)-packages[/\\])', r'"\1', text)


def new_run_id():
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
