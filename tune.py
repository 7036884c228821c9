"""Sweep execution settings that keep the math, within a time budget: python tune.py [config] --budget 45

Each candidate is one protocol-v2 run of bench.py in its own process, so an out-of-memory error, a crash or
a hang (past candidate_timeout) ends that candidate only. Not a grid: first the micro-batch knee in the
first compile mode, then attention backends at the best size, then the other compile modes (eager
included), then CPU threads. A size at or above one that ran out of memory is never tried with the same other
settings, and no candidate is started that the remaining budget cannot finish (estimated from those already
measured).
"""
import math
import subprocess
import sys
import time
from pathlib import Path

import bench
import env
import train
from data.loader import CacheError, TokenCache
from configurator import ConfigError, load_config, write_config_file
import results


# ---------------------------------------------------------------- defaults (plus everything bench.py takes)
budget = 45.0                    # minutes for the whole sweep
candidate_timeout = 10.0         # minutes; a candidate running longer is ended and recorded as an error
tune_micro_batch_sizes = "4,8,16,32"
tune_compile_modes = "default,reduce-overhead,max-autotune-no-cudagraphs,max-autotune,eager"
tune_backends = "auto,flash,efficient,cudnn"
tune_threads = ""                # e.g. "1,4,8"; empty keeps cpu_threads
tuned_dir = "out/tuned"
knee_gain = 0.03                 # a larger micro-batch must beat the last by 3% to continue the knee search

WHERE_KEYS = ("results_file", "out_dir")
TUNE_KEYS = ("budget", "candidate_timeout", "tune_micro_batch_sizes", "tune_compile_modes", "tune_backends",
             "tune_threads", "tuned_dir", "knee_gain")

DEFAULTS = dict(bench.DEFAULTS, name="tune", **{k: globals()[k] for k in TUNE_KEYS})
PROTOCOL_KEYS = ("warmup", "steps", "windows", "data_mode")


class BudgetExhausted(Exception):
    pass


def candidate_name(c):
    mode = "eager" if not c["compile"] else c["compile_mode"]
    return (f"micro-{c['micro_batch_size']}-compile-{int(c['compile'])}-{c['attention_backend']}-{mode}"
            f"-threads-{c['cpu_threads']}")


def make_candidate(micro_batch_size, mode, backend, threads):
    return {"micro_batch_size": micro_batch_size, "compile": mode != "eager",
            "compile_mode": "default" if mode == "eager" else mode, "attention_backend": backend, "cpu_threads": threads}


def other_settings(candidate):
    """A candidate's settings but its micro-batch size: one backend running out of memory at a size says nothing
    of another (the math kernel keeps the whole score matrix; cuDNN's does not)."""
    return tuple(sorted((k, v) for k, v in candidate.items() if k != "micro_batch_size"))


def is_out_of_memory(result):
    return result.get("status") != "ok" and "out of memory" in str(result.get("error", "")).lower()


class Sweep:
    """The strategy, separate from how a candidate is measured (a function), so tests can drive it."""

    def __init__(self, sizes, modes, backends, threads, measure, budget_seconds, clock=time.monotonic,
                 knee_gain=0.03, on_result=None):
        self.sizes, self.modes, self.backends, self.threads = sizes, modes, backends, threads
        self.measure, self.budget_seconds, self.clock, self.knee_gain = measure, budget_seconds, clock, knee_gain
        self.on_result = on_result or (lambda *a: None)
        self.start = clock()
        self.results = []  # (candidate, result, wall seconds)
        self.exhausted = False
        self.oom_sizes = {}  # the smallest size that ran out of memory, per the candidate's other settings
        self.planned = len(sizes) + len(backends) - 1 + len(modes) - 1 + max(len(threads) - 1, 0)

    def elapsed(self):
        return self.clock() - self.start

    def estimate(self, candidate):
        """Seconds a candidate should take: the slowest measured one of the same compile mode, else of any
        compiled mode (x2 for max-autotune, which searches kernels), else of anything."""
        def slowest(pred):
            times = [s for c, _, s in self.results if pred(c)]
            return max(times) if times else None
        mode = candidate["compile_mode"] if candidate["compile"] else "eager"
        same = slowest(lambda c: (c["compile_mode"] if c["compile"] else "eager") == mode)
        if same is not None:
            return same
        compiled = slowest(lambda c: c["compile"])
        if candidate["compile"] and compiled is not None:
            return compiled * (2 if "max-autotune" in mode else 1)
        return slowest(lambda c: True) or 0.0

    def best(self):
        ok = [(c, r) for c, r, _ in self.results if r.get("status") == "ok"]
        return max(ok, key=lambda cr: cr[1]["tokens_per_second"]) if ok else (None, None)

    def result_of(self, candidate):
        for c, r, _ in self.results:
            if c == candidate:
                return r
        return None

    def attempt(self, candidate):
        known = self.result_of(candidate)
        if known is not None:
            return known
        size, settings = candidate["micro_batch_size"], other_settings(candidate)
        if size >= self.oom_sizes.get(settings, math.inf):
            return None  # never above (or at) a size that ran out of memory with the same settings
        if self.results and self.elapsed() + self.estimate(candidate) > self.budget_seconds:
            self.exhausted = True
            raise BudgetExhausted
        start = self.clock()
        result = self.measure(candidate, self.budget_seconds - self.elapsed())
        seconds = self.clock() - start
        self.results.append((candidate, result, seconds))
        if is_out_of_memory(result):
            self.oom_sizes[settings] = min(size, self.oom_sizes.get(settings, size))
        self.on_result(self, candidate, result)
        return result

    def run(self):
        first_mode = next((m for m in self.modes if m != "eager"), self.modes[0])
        backend, threads = self.backends[0], self.threads[0]
        try:
            # 1. the micro-batch knee in the first mode
            last_rate = None
            for size in self.sizes:
                result = self.attempt(make_candidate(size, first_mode, backend, threads))
                if result is None or result.get("status") != "ok":
                    if result is not None and is_out_of_memory(result):
                        break
                    continue
                rate = result["tokens_per_second"]
                if last_rate is not None and rate < last_rate * (1 + self.knee_gain):
                    break
                last_rate = rate
            best, _ = self.best()
            if best is None:
                return
            # 2. attention backends at the best size, 3. compile modes, 4. CPU threads
            for b in self.backends[1:]:
                self.attempt(dict(best, attention_backend=b))
            best, _ = self.best()
            for m in self.modes:
                self.attempt(make_candidate(best["micro_batch_size"], m, best["attention_backend"], best["cpu_threads"]))
            best, _ = self.best()
            for t in self.threads[1:]:
                self.attempt(dict(best, cpu_threads=t))
        except BudgetExhausted:
            pass


def parse_list(text, kind, key):
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{key}={text!r}: expected a comma-separated list of {kind.__name__}") from None


def machine():
    """What a measurement also depends on: the GPU and the CPU (eager is launch-bound) it ran on."""
    import torch
    return {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpu": env.cpu_model()}


def cache_identity(cfg):
    """The token cache's identity from its meta.json (None for synthetic data or no cache)."""
    if cfg.data_mode != "real":
        return None
    try:
        return TokenCache(cfg.data_dir, verify=False).identity
    except CacheError:
        return None


def candidate_identity(cfg, candidate, where):
    """What a measurement depends on: the candidate's training config, the protocol, the machine and the
    data, not names or paths."""
    settings = {k: v for k, v in dict(cfg, **candidate).items()
                if k in train.DEFAULTS and k not in ("name", *WHERE_KEYS)}
    return env.hash_json({"settings": settings, "protocol": {k: cfg[k] for k in PROTOCOL_KEYS}, "machine": where})


def tune(cfg):
    sizes = parse_list(cfg.tune_micro_batch_sizes, int, "tune_micro_batch_sizes")
    modes = parse_list(cfg.tune_compile_modes, str, "tune_compile_modes")
    backends = parse_list(cfg.tune_backends, str, "tune_backends")
    threads = parse_list(cfg.tune_threads, int, "tune_threads") or [cfg.cpu_threads]
    for b in backends:
        if b not in train.model_lib.ATTENTION_BACKENDS:
            raise ConfigError(f"tune_backends: {b!r} is not one of {', '.join(train.model_lib.ATTENTION_BACKENDS)}")
        if b == "fa4":
            # a missing flash-attn-4 would fail every fa4 candidate the same way (a GPU that is not Hopper or
            # Blackwell is refused by each candidate as it starts)
            train.check_execution(train.Config(cfg, attention_backend=b))
    for m in modes:
        if m != "eager" and m not in train.COMPILE_MODES:
            raise ConfigError(f"tune_compile_modes: {m!r} is not one of eager, {', '.join(train.COMPILE_MODES)}")
    for key, values in (("tune_micro_batch_sizes", sizes), ("tune_compile_modes", modes), ("tune_backends", backends)):
        if not values:
            raise ConfigError(f"{key} is empty; give at least one value")
    for key in ("budget", "candidate_timeout"):
        if cfg[key] <= 0:
            raise ConfigError(f"{key} must be a positive number of minutes, got {cfg[key]}")
    bench.check_protocol(cfg)  # or every candidate would fail the same way, and the sweep record no selection
    bench.cache_and_model(cfg)
    valid_sizes = []
    for size in sorted(set(sizes)):
        try:
            train.check_execution(train.Config(cfg, micro_batch_size=size))
            valid_sizes.append(size)
        except ConfigError as exc:
            print(f"skipping micro-batch {size}: {exc}")
    if not valid_sizes:
        raise ConfigError("no micro-batch size in tune_micro_batch_sizes divides an update")

    source = env.source_hash()
    previous = {}
    old = results.lookup(cfg.results_file, ["tuning"]) or {}
    for record in old.get("candidates", []):
        # only measurements: an error may have been the budget's cut or a passing fault, so it is tried again
        if record.get("source_hash") == source and record.get("candidate_identity") and record.get("status") == "ok":
            previous[record["candidate_identity"]] = record
    where = dict(machine(), cache_identity=cache_identity(cfg))
    records = []
    tuned_dir = Path(cfg.tuned_dir)
    try:  # each candidate's config is written there before it runs
        tuned_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"tuned_dir {cfg.tuned_dir!r} cannot be made ({exc.strerror}); give a writable "
                              f"folder") from None

    def measure(candidate, seconds_left):
        name = candidate_name(candidate)
        identity = candidate_identity(cfg, candidate, where)
        config_path = tuned_dir / f"{name}.py"
        candidate_cfg = dict(cfg, **candidate, name=name)
        # where a run writes its results and checkpoints is its caller's choice, not a setting to reproduce
        settings = {k: v for k, v in candidate_cfg.items() if k in train.DEFAULTS and k not in WHERE_KEYS}
        write_config_file(config_path, settings,
                              train.DEFAULTS, header=f"tune.py candidate {name}\nreproduce: python train.py {config_path}")
        if identity in previous:
            record = dict(previous[identity], reused=True, config_path=str(config_path))
            records.append(record)
            return record
        bench_name = f"{cfg.name}-{name}"
        # a candidate's output is kept for its error message, so say what runs while it compiles and measures
        print(f"  running {name} (at most {min(cfg.candidate_timeout, seconds_left / 60):.1f} min)...", flush=True)
        command = [sys.executable, str(env.REPO / "bench.py"), str(config_path), f"--name={bench_name}",
                   f"--results_file={cfg.results_file}"] + [f"--{k}={cfg[k]}" for k in PROTOCOL_KEYS]
        timeout = max(1.0, min(cfg.candidate_timeout * 60, seconds_left))
        start = time.time()
        before = (results.lookup(cfg.results_file, ["benchmarks", bench_name]) or {}).get("run_id")
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            entry = results.lookup(cfg.results_file, ["benchmarks", bench_name])
            if not entry or entry.get("run_id") == before:  # the process died before recording
                entry = None
            if entry is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                entry = {"status": "error", "error": f"exit code {proc.returncode}: " + " | ".join(tail)}
        except subprocess.TimeoutExpired:
            entry = {"status": "error", "error": f"timed out after {timeout / 60:.1f} minutes"}
        record = {k: v for k, v in entry.items() if k not in ("config", "traceback")}
        record.update(name=name, config_path=str(config_path), candidate_identity=identity, source_hash=source,
                      wall_seconds=time.time() - start, reused=False, **candidate)
        records.append(record)
        return record

    budget_seconds = cfg.budget * 60

    def progress(sweep, candidate, result):
        best, best_result = sweep.best()
        rate = f"{result['tokens_per_second']:,.0f} tok/s" if result.get("status") == "ok" else \
            f"error: {str(result.get('error'))[:80]}"
        best_text = f"{best_result['tokens_per_second']:,.0f} ({candidate_name(best)})" if best else "-"
        reused = " (measured before)" if result.get("reused") else ""
        print(f"[{len(sweep.results)}/{sweep.planned}] {sweep.elapsed() / 60:.1f}/{cfg.budget:g} min  "
              f"{candidate_name(candidate)}: {rate}{reused}  best: {best_text}", flush=True)

    sweep = Sweep(valid_sizes, modes, backends, threads, measure, budget_seconds, knee_gain=cfg.knee_gain,
                  on_result=progress)
    sweep.run()
    best, best_result = sweep.best()
    if sweep.exhausted:
        print(f"budget exhausted: the next candidate would not finish within {cfg.budget:g} minutes")
    tuning = {"run_id": env.new_run_id(), "budget_minutes": cfg.budget, "budget_exhausted": sweep.exhausted,
              "elapsed_minutes": sweep.elapsed() / 60, "source_hash": source, "candidates": records,
              "selected": best_result, "selected_config_path": best_result["config_path"] if best_result else None,
              "base_config": {k: v for k, v in cfg.items() if k in train.DEFAULTS}}
    results.record(cfg.results_file, ["tuning"], tuning)
    if best_result:
        print(f"selected {best_result['name']}: {best_result['tokens_per_second']:,.0f} tok/s -> "
              f"python train.py {best_result['config_path']}")
    return tuning


def main(argv):
    try:
        cfg = train.Config(load_config(DEFAULTS, argv))
        tuning = tune(cfg)
    except train.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if tuning["selected"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
