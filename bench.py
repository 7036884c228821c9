"""Protocol-v2 throughput benchmark of the real training update.

    python bench.py config/20m_gh200.py --compile=True --micro_batch_size=32 --name=final-20m

20 warmup updates, then 3 windows of 100 updates; each is Trainer.update, the step train.py runs
(forward, backward, clipping, optimizer). The headline is the median window's tokens/s. The entry goes to
benchmarks.NAME in the results file. Under torchrun, tokens/s are totals over all GPUs and per GPU.
"""
import gc
import os
import statistics
import sys
import time

from configurator import ConfigError, argv_value
from model_kernels import first_calls

if __name__ == "__main__":  # before torch's import: a cold run's helpers import beside this process (start_early)
    first_calls.start_early(sys.argv[1:], fresh=argv_value(sys.argv[1:], "cold", bool, False))

import numpy as np
import torch

import env
import model as model_lib
import plan as plan_lib
import settings
from data.loader import batch_stream, synthetic_batches
from distributed import all_reduce_sum
from plan import USER_ERRORS
from plots import finite_number, fmt
from profiling import kernel_breakdown, profiled_kernels
from results import check_writable, lookup, record
from settings import BenchSettings
from trainer import Trainer, peak_memory_bytes, reset_peak_memory

DEFAULTS = settings.defaults(BenchSettings)

def window_summary(window, seconds, n_updates, tokens_per_update, loss_sum, grad_norm):
    """One window's figures; loss is the token mean over its updates."""
    return {"window": window, "timestamp": time.time(), "seconds": seconds, "updates": n_updates,
            "tokens_per_second": n_updates * tokens_per_update / seconds,
            "loss": loss_sum / (n_updates * tokens_per_update), "grad_norm": grad_norm}


def median_window(measurements):
    return statistics.median(m["tokens_per_second"] for m in measurements)


def device_used_bytes(device):
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def protocol_data(plan):
    """(data, make_batches(u)): the recipe's full updates from the token cache, cycled over its epochs, or synthetic
    tokens of the same shapes."""
    cfg, rank, world_size = plan.cfg, plan.rank, plan.world_size
    if not plan.cache:
        return synthetic_batches(cfg, plan.model.vocab_size, plan.sequences_per_update, rank, world_size)
    data = plan_lib.training_data(plan)
    full_updates = data.n_sequences // plan.sequences_per_update  # the timed updates are all full ones
    if full_updates == 0:
        need, total = plan.sequences_per_update * cfg.seq_len + 1, len(plan.cache.train)
        held = f"train_subset_tokens {cfg.train_subset_tokens:,}" if cfg.train_subset_tokens else "the whole cache"
        fix = (f"give at least {need:,} tokens, or 0 for all of them" if need <= total else
               f"the cache holds {total:,} training tokens: give a smaller tokens_per_update")
        raise ConfigError(f"{held} holds {data.n_sequences} sequences of {cfg.seq_len}, less than one full update of "
                          f"tokens_per_update {cfg.tokens_per_update:,} ({plan.sequences_per_update} sequences); {fix}")
    make = lambda u: data.micro_batches(u // full_updates, u % full_updates, cfg.micro_batch_size, rank, world_size)
    return data, make


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
    mark, start = env.compile_totals(), time.perf_counter()  # this run's compile: an earlier preset's is not reset
    trainer.update(*next(batches))
    sync()
    entry["first_update_seconds"] = time.perf_counter() - start
    graphs, seconds = env.compiled_since(mark)
    entry["first_update_graphs"] = graphs if cfg.compile else None
    entry["first_update_compile_seconds"] = seconds if cfg.compile else None
    entry["first_calls"] = first_calls.timings() or None  # when the children had each kernel, and the waits
    say(cfg, f"first update {entry['first_update_seconds']:.1f} s; {cfg.warmup - 1} more warmup updates")
    for _ in range(cfg.warmup - 1):
        trainer.update(*next(batches))
    sync()
    entry["warmup_seconds"] = time.perf_counter() - start
    if trainer.compile_cache_due():  # after the warmup's time: writing the file is no update
        trainer.save_compile_cache()
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
    folders, was_cold = env.compiler_cache_state(fresh=cfg.cold)
    entry.update(compiler_cache=folders, cache_was_cold=was_cold if cfg.compile else None)
    entry["protocol"] = {"version": 2, "warmup": cfg.warmup, "steps": cfg.steps, "windows": cfg.windows,
                         "data_mode": cfg.data_mode, "profile": cfg.profile, "cache_identity": None}
    return entry


def run_protocol(cfg):
    """One protocol-v2 run; returns its entry (status "error" with the error text if it failed)."""
    entry = new_entry(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    trainer = None
    try:
        plan = plan_lib.resolve(cfg, BenchSettings, synthetic=cfg.data_mode == "synthetic", prestart=True)
        reset_peak_memory(torch.device(plan.device))
        data, make = protocol_data(plan)
        entry["protocol"]["cache_identity"] = plan.cache.identity if plan.cache else None
        total = cfg.warmup + cfg.windows * cfg.steps + (cfg.profile_updates if cfg.profile else 1)
        parameters = model_lib.parameter_count(plan.model)
        shaped = any(cfg[k] for k in settings.MODEL_SHAPE_KEYS[:-1])
        say(cfg, f"building a {parameters / 1e6:.1f}M-parameter model (the {cfg.preset} preset"
                 f"{' with its shape overridden' if shaped else ''}) on {plan.device}")
        used_before = device_used_bytes(torch.device(plan.device))
        trainer = Trainer.from_plan(plan, total)
        entry["parameters"] = sum(p.numel() for p in trainer.raw_model.parameters())
        entry["attention"] = trainer.attention  # what "auto" ran as here
        if trainer.compile_cache_loaded:  # a --compile_cache put into the empty caches: not a cold start
            entry["cache_was_cold"] = False
        say(cfg, f"attention {trainer.attention} ({trainer.attention_reason})")
        batches = batch_stream(make, plan.device, total)
        measurements, device_peaks = timed_windows(cfg, trainer, batches, entry, plan.world_size)
        kernels, attention = profiled_kernels(trainer, batches, cfg.profile_updates if cfg.profile else 1)
        entry.update(status="ok", vocab_size=plan.model.vocab_size, measurements=measurements,
                     attention_kernels=attention,
                     **throughput(cfg, plan.model, median_window(measurements), plan.world_size, trainer.device),
                     **memory(trainer.device, device_peaks, used_before))
        if cfg.profile:
            entry["profile"] = dict(kernel_breakdown(kernels), profiled_updates=cfg.profile_updates,
                                    device=trainer.device.type)
        if cfg.partial_probe:
            sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
            entry["partial_probe"] = probe_partial_updates(trainer, data, cfg, sync, plan.rank, plan.world_size)
        if plan.world_size > 1 and cfg.scaling_reference:
            reference = lookup(cfg.results_file, ["benchmarks", cfg.scaling_reference, "tokens_per_second"])
            entry["scaling_efficiency"] = (entry["tokens_per_second"] / plan.world_size / reference
                                           if reference else None)
    except USER_ERRORS:
        raise  # a user mistake, not a measurement
    except Exception as exc:  # an out-of-memory or a compile failure is a result too
        entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=env.portable_traceback())
    finally:
        del trainer
        gc.collect()  # the model's cycles, so that the next preset's peak starts without them
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


SCALING_KEYS = ("preset", "seq_len", "tokens_per_update", *settings.MODEL_SHAPE_KEYS)  # the reference's and the run's


def check_scaling_reference(cfg):
    """Refuse before any work, not as a null or wrong efficiency after the whole multi-GPU run: a scaling_reference
    without a rate to divide by, of several processes (its rate is not one GPU's), or of another model or update
    (another preset, context, update size or shape); with presets, each would be divided by the one entry."""
    if not cfg.scaling_reference:
        return
    name = f"scaling_reference={cfg.scaling_reference}"
    entry = lookup(cfg.results_file, ["benchmarks", cfg.scaling_reference])
    rate = entry.get("tokens_per_second") if isinstance(entry, dict) else None
    if not (finite_number(rate) and rate > 0):
        raise ConfigError(f"{name} is no entry under benchmarks in {cfg.results_file} with a tokens_per_second above "
                          f"0; give the name of a one-GPU bench.py entry there")
    if cfg.presets:
        raise ConfigError(f"{name} is one preset's one-GPU entry and presets={cfg.presets} measures several; bench "
                          f"one preset (--preset=P) against its own reference")
    if entry.get("world_size", 1) != 1:
        raise ConfigError(f"{name} ran {entry['world_size']} processes; give a one-GPU entry (bench.py without "
                          f"torchrun)")
    config = entry.get("config") if isinstance(entry.get("config"), dict) else {}
    differ = [f"{k} {config[k]!r} against {cfg[k]!r}" for k in SCALING_KEYS if k in config and config[k] != cfg[k]]
    if differ:
        raise ConfigError(f"{name} measured another model or update ({'; '.join(differ)}); give a one-GPU entry "
                          f"of the same preset, shape, seq_len and tokens_per_update")


def run(cfg):
    """Run the protocol (once, or per preset) and record it; returns the entries."""
    rank = int(os.environ.get("RANK", "0"))
    settings.check(BenchSettings, cfg)  # on the settings as given: each preset's run below has the preset's shape
    check_writable(cfg.results_file, sections=["benchmarks", "profiles"])  # before any measurement, not after it
    check_scaling_reference(cfg)
    for line in settings.doubtful_values(cfg, 0) if rank == 0 else ():  # 0: bench's updates have no lr schedule
        print(f"warning: {line}")
    runs = [(cfg.name, cfg)]
    if cfg.presets:  # each preset in its own shape (the settings refused shape keys beside them)
        runs = [(f"{cfg.name}-{preset}", settings.Config(cfg, preset=preset, name=f"{cfg.name}-{preset}"))
                for preset in settings.preset_names(cfg)]
    for name, run_cfg in runs if cfg.presets else []:  # a key that fits one preset's shape may not fit the next's
        try:
            plan_lib.check_shape(run_cfg)
        except ConfigError as exc:
            raise ConfigError(f"preset {run_cfg.preset}: {exc}") from None
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
        cfg = settings.load(BenchSettings, argv)  # run() checks it
        entries = run(cfg)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
