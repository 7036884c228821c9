"""Protocol-v2 throughput benchmark of the real training update.

    python bench.py config/20m_gh200.py --compile=True --micro_batch_size=32 --name=final-20m

20 warmup updates, then 3 windows of 100 updates; each is Trainer.update, the step train.py runs
(forward, backward, clipping, optimizer). The headline is the median window's tokens/s. The entry goes to
benchmarks.NAME in the results file. Under torchrun, tokens/s are totals over all GPUs and per GPU.
"""
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import env
import model as model_lib
import train
from data.loader import CacheError, Prefetcher, TokenCache, TrainData
import settings
from configurator import ConfigError, load_config
from plots import fmt
from settings import TrainSettings, run_name_problem, setting
from results import check_writable, lookup, record
from trainer import Trainer, all_reduce_sum, distributed, peak_memory_bytes

# ---------------------------------------------------------------- settings (train.py's, plus the protocol's)

@dataclasses.dataclass
class BenchSettings(TrainSettings):
    name: str = setting("bench", "entry name under benchmarks. in the results file", rule=run_name_problem)
    warmup: int = setting(20, "updates before the timed windows (the first one compiles)", bounds=">= 1")
    steps: int = setting(100, "updates in each timed window", bounds=">= 1")
    windows: int = setting(3, "timed windows; the headline is the median window's tokens/s", bounds=">= 1")
    data_mode: str = setting("real", "real: the token cache; synthetic: random tokens, no dataset needed (the "
                                     "vocabulary still follows a cache at data_dir when there is one, else 32,000)",
                             choices=("real", "synthetic"))
    profile: bool = setting(False, "GPU kernel time by category over profile_updates updates, in profiles.NAME")
    profile_updates: int = setting(3, "updates the profiler records", bounds=">= 1")
    cold: bool = setting(False, "compile with fresh, empty inductor and Triton caches")
    partial_probe: bool = setting(False, "time single updates of 32, 11, 25 and 32 sequences")
    presets: str = setting("", 'e.g. "20m,50m,90m": run each preset, shown beside its previous entry')
    scaling_reference: str = setting("", "a one-GPU benchmarks entry to compute scaling efficiency against")

    @staticmethod
    def rules(cfg):
        check_protocol(cfg)


DEFAULTS = settings.defaults(BenchSettings)

# Kernel-name patterns by category, first match wins (order matters: attention before softmax, etc.).
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::matmul", "aten::linear", "splitkreduce", "sm90_", "sm80_")),
    ("cross_entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lpnorm", "clip_grad", "_amp_")),
    ("norm", ("rms_norm", "rmsnorm", "rsqrt", "layer_norm")),
    ("rotary", ("rotary", "rope", "cat_neg", "neg_cat", "cos", "sin")),
    ("elementwise", ("triton_poi", "triton_per", "triton_red", "elementwise", "vectorized", "copy", "fill",
                     "add", "mul", "silu", "swiglu", "sigmoid", "catarray", "aten::cat", "index", "embedding", "reduce")),
]
PROFILE_CATEGORIES = [c for c, _ in CATEGORIES] + ["other"]


def categorize(kernel_name):
    low = kernel_name.lower()
    if "nccl" in low:
        return "other"  # communication (DDP's all-reduce), whose names would match "reduce" below
    for category, patterns in CATEGORIES:
        if any(p in low for p in patterns):
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
    kernels twice (0.27 ms of a 14.90 ms 20m update), and torch's own table total leaves it out too."""
    device_us = getattr(evt, "self_device_time_total", None)
    if device_us is None:
        device_us = getattr(evt, "self_cuda_time_total", 0)
    if getattr(evt, "is_user_annotation", False) or not str(evt.device_type).endswith("CUDA"):
        return 0
    return device_us / 1e3


def profiled_kernels(trainer, batches, n_updates):
    """Run n_updates under torch.profiler; the device kernels (or, on the CPU, the ops) that ran."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
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
    attention = sorted(n for n in op_names | {k for k, _, _ in kernels} if categorize(n) == "attention")
    return kernels, attention


def window_summary(window, seconds, n_updates, tokens_per_update, loss_sum, grad_norm):
    """One window's figures; loss is the token mean over its updates."""
    return {"window": window, "timestamp": time.time(), "seconds": seconds, "updates": n_updates,
            "tokens_per_second": n_updates * tokens_per_update / seconds,
            "loss": loss_sum / (n_updates * tokens_per_update), "grad_norm": grad_norm}


def median_window(measurements):
    return statistics.median(m["tokens_per_second"] for m in measurements)


def synthetic_batches(cfg, vocab, sequences_per_update, rank, world_size):
    """A few updates of random tokens, cycled: the same shapes as real data, no dataset needed."""
    rng = np.random.default_rng(cfg.seed)
    n_seq = 4 * sequences_per_update
    tokens = rng.integers(0, vocab, size=n_seq * cfg.seq_len + 1, dtype=np.int64)
    data = TrainData(tokens, cfg.seq_len, sequences_per_update, cfg.seed)
    return data, lambda u: data.micro_batches(0, u % data.updates_per_epoch, cfg.micro_batch_size, rank, world_size)


def batch_stream(make_batches, device, total):
    for _, micro_batches, n_tokens in Prefetcher(make_batches, range(total), device):
        yield micro_batches, n_tokens


def cache_state(cold_requested):
    """Point the compiler caches at fresh folders when a cold compile is asked for; report their state."""
    if cold_requested:
        root = tempfile.mkdtemp(prefix="tiny-llm-cold-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    folders = env.compiler_cache()
    inductor = folders["TORCHINDUCTOR_CACHE_DIR"]
    was_cold = not (inductor and Path(inductor).is_dir() and any(Path(inductor).iterdir()))
    return folders, was_cold


def device_used_bytes(device):
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


PRESET_SHAPE_KEYS = settings.MODEL_SHAPE_KEYS[:-1]  # what a preset fixes; its vocabulary follows the data


def check_protocol(cfg):
    """The bench keys' combinations (their own bounds and choices are declared in BenchSettings)."""
    if cfg.presets:
        check_presets(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.scaling_reference and world_size == 1:  # run_protocol computes it only over several processes
        raise ConfigError(f"scaling_reference={cfg.scaling_reference} compares several processes with that "
                          f"one-GPU entry, and this is one process; run under torchrun --nproc_per_node=N, or "
                          f"drop scaling_reference")
    on_cpu = cfg.device != "cuda" and settings.resolve_device(cfg) == "cpu"  # settings' rule for "auto"
    if cfg.profile and on_cpu:
        raise ConfigError("profile records GPU kernel time, and this runs on the CPU (where it would record CPU "
                          "operator time as kernel_ms); profile on a GPU, or drop profile")


def preset_names(cfg):
    return [p.strip() for p in cfg.presets.split(",") if p.strip()]


def check_presets(cfg):
    """Known preset names, and no shape key beside them: run() gives each preset its own shape, so a dim or
    n_heads given with presets would be dropped without a word."""
    if not preset_names(cfg):
        raise ConfigError(f"presets={cfg.presets!r} names no preset; valid: {', '.join(model_lib.PRESETS)}")
    for preset in preset_names(cfg):
        try:
            model_lib.get_preset(preset)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    shape = [f"{k}={cfg[k]}" for k in PRESET_SHAPE_KEYS if cfg[k]]
    if shape:
        raise ConfigError(f"presets={cfg.presets} runs each preset in its own shape, so {', '.join(shape)} would be "
                          f"ignored; leave them at 0 with presets, or drop presets to time this shape")


def cache_and_model(cfg):
    """The verified token cache (None for synthetic data) and the model config; a mistake in either is a
    ConfigError, which is the user's to fix, not a measurement to record."""
    if cfg.data_mode == "real":
        cache, mcfg, _ = train.setup(cfg)
        return cache, mcfg
    try:  # the LM head train.py would build from this config; the Llama tokenizer's 32,000 without a cache
        vocab = TokenCache(cfg.data_dir, verify=False).vocab_size
    except CacheError:
        vocab = 32000
    return None, train.model_config(cfg, vocab)


def protocol_data(cfg, sequences_per_update, rank, world_size):
    """(data, make_batches(u), model config, cache identity): the recipe's full updates from the token cache,
    cycled over its epochs, or synthetic tokens of the same shapes."""
    cache, mcfg = cache_and_model(cfg)
    if not cache:
        return (*synthetic_batches(cfg, mcfg.vocab_size, sequences_per_update, rank, world_size), mcfg, None)
    data = train.training_data(cfg, cache, sequences_per_update)
    full_updates = data.n_sequences // sequences_per_update  # the timed updates are all full ones
    if full_updates == 0:
        raise ConfigError("the training subset holds less than one full update")
    make = lambda u: data.micro_batches(u // full_updates, u % full_updates, cfg.micro_batch_size, rank, world_size)
    return data, make, mcfg, cache.identity


def say(cfg, text):
    """A progress line on the main process: a compile or a window can take minutes."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{cfg.name}: {text}", flush=True)


def timed_windows(cfg, trainer, batches, entry, world_size):
    """The protocol proper: warmup (its first update, which compiles, timed alone), then the windows.
    Returns the windows' summaries and the device memory in use at each window's end."""
    dev = trainer.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    say(cfg, "first update" + (" (compiles the model)" if cfg.compile else "") + " ...")
    sync()
    start = time.perf_counter()
    trainer.update(*next(batches))
    sync()
    entry["first_update_seconds"] = time.perf_counter() - start
    say(cfg, f"first update {entry['first_update_seconds']:.1f} s; {cfg.warmup - 1} more warmup updates")
    for _ in range(cfg.warmup - 1):
        trainer.update(*next(batches))
    sync()
    entry["warmup_seconds"] = time.perf_counter() - start
    device_peaks, measurements = [device_used_bytes(dev)], []
    for w in range(cfg.windows):
        loss_total = torch.zeros((), device=dev)
        sync()
        start = time.perf_counter()
        for _ in range(cfg.steps):
            loss_sum, grad_norm = trainer.update(*next(batches))
            loss_total += loss_sum
        sync()
        seconds = time.perf_counter() - start
        loss_total = all_reduce_sum(loss_total, world_size)
        measurements.append(window_summary(w, seconds, cfg.steps, cfg.tokens_per_update, loss_total.item(),
                                           grad_norm.item()))
        device_peaks.append(device_used_bytes(dev))
        say(cfg, f"window {w + 1}/{cfg.windows}: {measurements[-1]['tokens_per_second']:,.0f} tokens/s")
    return measurements, device_peaks


def new_entry(cfg, world_size):
    """The entry's fields known before anything runs: what is measured, how, and with which code."""
    entry = {"name": cfg.name, "run_id": env.new_run_id(), "status": "running", "preset": cfg.preset,
             "micro_batch_size": cfg.micro_batch_size, "compile": cfg.compile, "compile_mode": cfg.compile_mode,
             "attention_backend": cfg.attention_backend, "loss_impl": cfg.loss_impl, "mlp_impl": cfg.mlp_impl,
             "cpu_threads": cfg.cpu_threads, "world_size": world_size,
             "config_identity": env.config_identity(dict(cfg)), "source_hash": env.source_hash(), "config": dict(cfg)}
    folders, was_cold = cache_state(cfg.cold)
    entry.update(compiler_cache=folders, cache_was_cold=was_cold if cfg.compile else None)
    entry["protocol"] = {"version": 2, "warmup": cfg.warmup, "steps": cfg.steps, "windows": cfg.windows,
                         "data_mode": cfg.data_mode, "profile": cfg.profile, "cache_identity": None}
    return entry


def run_protocol(cfg):
    """One protocol-v2 run; returns its entry (status "error" with the error text if it failed)."""
    rank, local_rank, world_size = distributed()
    entry = new_entry(cfg, world_size)
    trainer = None
    try:
        device = settings.resolve_device(cfg, local_rank)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sequences_per_update = train.check_execution(cfg, world_size)
        attention = settings.check_device(cfg, torch.device(device))
        data, make, mcfg, entry["protocol"]["cache_identity"] = protocol_data(cfg, sequences_per_update, rank,
                                                                              world_size)
        total = cfg.warmup + cfg.windows * cfg.steps + (cfg.profile_updates if cfg.profile else 1)
        say(cfg, f"building the {cfg.preset} model on {device}")
        used_before = device_used_bytes(torch.device(device))
        trainer = Trainer(cfg, mcfg, device, total_updates=total, world_size=world_size, local_rank=local_rank,
                          attention=attention)
        entry["parameters"] = sum(p.numel() for p in trainer.raw_model.parameters())
        entry["attention"] = trainer.attention  # what "auto" ran as here
        say(cfg, f"attention {trainer.attention} ({trainer.attention_reason})")
        batches = batch_stream(make, device, total)
        measurements, device_peaks = timed_windows(cfg, trainer, batches, entry, world_size)
        kernels, attention = profiled_kernels(trainer, batches, cfg.profile_updates if cfg.profile else 1)
        entry.update(status="ok", vocab_size=mcfg.vocab_size, measurements=measurements, attention_kernels=attention,
                     **throughput(cfg, mcfg, median_window(measurements), world_size, trainer.device),
                     **memory(trainer.device, device_peaks, used_before))
        if cfg.profile:
            entry["profile"] = dict(kernel_breakdown(kernels), profiled_updates=cfg.profile_updates,
                                    device=trainer.device.type)
        if cfg.partial_probe:
            sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
            entry["partial_probe"] = probe_partial_updates(trainer, data, cfg, sync, rank, world_size)
        if world_size > 1 and cfg.scaling_reference:
            reference = lookup(cfg.results_file, ["benchmarks", cfg.scaling_reference, "tokens_per_second"])
            entry["scaling_efficiency"] = entry["tokens_per_second"] / world_size / reference if reference else None
    except train.USER_ERRORS:
        raise  # a user mistake, not a measurement
    except Exception as exc:  # an out-of-memory or a compile failure is a result too
        entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=env.portable_traceback())
    finally:
        del trainer
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return entry


def throughput(cfg, mcfg, tokens_per_second, world_size, device):
    """tokens/s in all and per GPU, FLOPs per token and MFU (model.flops_per_token, env.mfu)."""
    flops = model_lib.flops_per_token(mcfg, cfg.seq_len)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"tokens_per_second": tokens_per_second, "tokens_per_second_per_gpu": tokens_per_second / world_size,
            "flops_per_token": flops, "mfu": env.mfu(flops, tokens_per_second / world_size, gpu_name)}


def memory(device, device_peaks, used_before):
    """The allocator's peaks, and what the device had in use at the window ends (CUDA graph pools, the
    context, everything) and before the model existed, so that the difference is ours."""
    cuda = device.type == "cuda"
    return {"peak_memory_bytes": peak_memory_bytes(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
            "device_peak_used_bytes": max(device_peaks) if cuda else None, "device_used_before_bytes": used_before}


def probe_partial_updates(trainer, data, cfg, sync, rank, world_size):
    """Single updates of 32, 11, 25 and 32 sequences (scaled to the update size): a recompile shows as a
    slow update on a new count."""
    per_update = data.sequences_per_update
    probes = []
    for count in [per_update, max(1, per_update * 11 // 32), max(1, per_update * 25 // 32), per_update]:
        micro, _ = data.batches_of(np.arange(count), cfg.micro_batch_size, rank, world_size)
        micro = [(x.to(trainer.device), y.to(trainer.device)) for x, y in micro]
        sync()
        start = time.perf_counter()
        loss_sum, _ = trainer.update(micro, count * cfg.seq_len)
        sync()
        probes.append({"sequences": count, "seconds": time.perf_counter() - start,
                       "loss": loss_sum.item() * world_size / (count * cfg.seq_len) if world_size == 1
                       else None})
    return probes


def record_entry(cfg, entry):
    record(cfg.results_file, ["benchmarks", cfg.name], entry)
    if "profile" in entry:
        record(cfg.results_file, ["profiles", cfg.name], dict(entry["profile"], run_id=entry["run_id"]))
    if "partial_probe" in entry:
        record(cfg.results_file, ["partial-probe"], {"benchmark": cfg.name, "run_id": entry["run_id"],
                                                          "probes": entry["partial_probe"]})


def run(cfg):
    """Run the protocol (once, or per preset) and record it; returns the entries."""
    rank = int(os.environ.get("RANK", "0"))
    settings.check(BenchSettings, cfg)  # on the settings as given: each preset's run below has the preset's shape
    check_writable(cfg.results_file, sections=["benchmarks", "profiles"])  # before any measurement, not after it
    runs = [(cfg.name, cfg)]
    if cfg.presets:  # each preset in its own shape (check_presets refused shape keys beside them)
        runs = [(f"{cfg.name}-{preset}", train.Config(cfg, preset=preset, name=f"{cfg.name}-{preset}"))
                for preset in preset_names(cfg)]
    entries = []
    fingerprint = None
    for name, run_cfg in runs:
        previous = lookup(cfg.results_file, ["benchmarks", name]) if rank == 0 else None
        entry = run_protocol(run_cfg)
        if rank == 0:
            fingerprint = fingerprint or env.fingerprint(entry["protocol"]["cache_identity"])
            entry["environment"] = fingerprint
            record_entry(run_cfg, entry)
        entries.append((name, previous, entry))
    if rank == 0:
        print_table(entries)
    return [e for _, _, e in entries]


def print_table(entries):
    gb = lambda b: f"{b / 2**30:.2f}" if b else "-"
    header = f"{'name':<28}{'status':>7}{'tok/s':>12}{'before':>12}{'ratio':>7}{'MFU':>7}{'first s':>9}" \
             f"{'peak GiB':>9}{'dev GiB':>9}"
    print(header)
    for name, previous, e in entries:
        before = previous.get("tokens_per_second") if isinstance(previous, dict) else None
        now = e.get("tokens_per_second")
        ratio = f"{now / before:.2f}" if now and before else "-"
        mfu = f"{100 * e['mfu']:.1f}%" if e.get("mfu") else "-"
        first = fmt(e.get("first_update_seconds"), ".1f")
        print(f"{name:<28}{e['status']:>7}{(f'{now:,.0f}' if now else '-'):>12}"
              f"{(f'{before:,.0f}' if before else '-'):>12}{ratio:>7}{mfu:>7}{first:>9}"
              f"{gb(e.get('peak_memory_bytes')):>9}{gb(e.get('device_peak_used_bytes')):>9}")
        if e["status"] == "error":
            print(f"  error: {e['error']}")


def main(argv):
    try:
        cfg = settings.Config(load_config(BenchSettings, argv))  # run() checks it
        entries = run(cfg)
    except train.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
