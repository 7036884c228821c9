"""Sweep the execution settings that keep the math, within a budget: python tune.py [config] --budget=45

1. Screen the incumbent (the config as given), then measure it with the largest protocol that fits in half the time
   left (protocol v2, bench.py's warmup, steps and windows, halved down to the screen's): every confirmation's.
2. Screen every candidate (the incumbent with one lever changed) briefly, leaving time to confirm the best.
3. Confirm the best tune_confirm screens (none below the incumbent's by more than tune_screen_noise), best first.
4. Stop when the budget runs out: no run starts unless its estimate fits; each ends by candidate_timeout at most.
5. Select the fastest confirmed run, set against the incumbent as the incumbent was measured (its confirmation, or
   its screen against the runs' screens where its confirmation failed or did not fit), if faster by more than
   tune_noise (tune_screen_noise between screens), else the incumbent: any budget that fits a screen answers.

Each run is bench.py in its own process, so an out-of-memory error, a crash or a hang ends that candidate only; a
value that cannot run here is skipped with one line. docs/TUNING.md: the levers, their order, what they cost.
"""
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import env
import plan as plan_lib
import results
import settings
from configurator import ConfigError, write_config_file
from data.loader import CacheError, TokenCache
from model_kernels import attention
from plan import USER_ERRORS
from plots import finite_number, fmt
from settings import BENCH_GROUPS, TrainSettings, setting
from sweep import PROTOCOL_KEYS, STAGES, Sweep, describe, rate, said
from trainer import uses_cudagraphs

TRAIN_DEFAULTS = settings.defaults(TrainSettings)  # the keys of a candidate's config file, which train.py runs


# ---------------------------------------------------------------- settings (the sweep's, then bench.py's)

@dataclasses.dataclass
class Tuning:
    """the sweep"""
    budget: float = setting(45.0, "minutes for the whole sweep", bounds="> 0")
    candidate_timeout: float = setting(10.0, "minutes; a longer run is ended, recorded as an error", bounds="> 0")
    tuned_dir: str = setting("out/tuned", "candidate configs go here (git ignores out/); never over a tracked file")
    tune_backends: str = setting("", 'attention backends to try; "": every one that runs here')
    tune_loss_impls: str = setting("", 'loss implementations to try; "": every one')
    tune_compile_modes: str = setting("", 'compile modes to try, "eager" among them; "": eager and every mode')
    tune_compile_scopes: str = setting("", 'compile scopes to try; "": every one')
    tune_activation_memory_budgets: str = setting("0.8", "activation memory budgets to try besides the config's")
    tune_micro_batch_sizes: str = setting("", 'micro-batch sizes to try; "": half and double the config\'s')
    tune_threads: str = setting("", 'CPU thread counts to try, e.g. "1,4,8"; "": the config\'s only')
    tune_screen_warmup: int = setting(3, "a screen: these updates (the first compiles), then a window", bounds=">= 1")
    tune_screen_steps: int = setting(0, "updates in a screen's window; 0: 10 on the CPU, 20 on a GPU", bounds=">= 0")
    tune_confirm: int = setting(4, "the best screens that go on to the full protocol (at most)", bounds=">= 1")
    tune_screen_noise: float = setting(0.03, "a screen this share below the incumbent's may be confirmed",
                                       bounds="[0, 1]")
    tune_noise: float = setting(0.01, "the share by which a candidate must beat the incumbent", bounds=">= 0")


def tune_rules(cfg):
    """Each list names values its lever takes (which of them can run here is why_not's to say); no compile_cache,
    which every candidate would read and overwrite in turn (the eager one refused with it)."""
    for key in LISTS:
        listed(cfg, key)
    if cfg.compile_cache:
        raise ConfigError(f"compile_cache {cfg.compile_cache!r}: tune.py times each candidate's own start, and every "
                          f"candidate would read and overwrite that one file; drop it (compare.py --tuned keeps the "
                          f"config's own)")


# The protocol's keys that a candidate's bench.py run takes; bench.py's others (profile, cold, presets, ...) are its
# own modes, not a screen's, so tune.py does not offer them.
PROTOCOL = settings.pick(settings.Protocol, *PROTOCOL_KEYS, "data_mode")
TuneSettings = settings.compose("TuneSettings", Tuning, PROTOCOL,
                                *(g for g in BENCH_GROUPS if g is not settings.Protocol), name=setting(
    "tune", "prefix of the candidates' entries under benchmarks.", settings.RUN, rule=settings.run_name_problem))
TuneSettings.rules = staticmethod(tune_rules)
DEFAULTS = settings.defaults(TuneSettings)
# The lists of values to try, and the train.py key each one sets ("eager" is a compile mode here).
LISTS = {"tune_backends": "attention_backend", "tune_loss_impls": "loss_impl", "tune_compile_modes": "compile_mode",
         "tune_compile_scopes": "compile_scope", "tune_activation_memory_budgets": "activation_memory_budget",
         "tune_micro_batch_sizes": "micro_batch_size", "tune_threads": "cpu_threads"}
LEVER_KEYS = ("compile", *LISTS.values())  # the train.py keys a candidate may change
# Only keys that change how the math runs, never what it is: a lever outside them would change the recipe.
assert set(LEVER_KEYS) <= settings.execution_keys(), set(LEVER_KEYS) - settings.execution_keys()
WHERE_KEYS = ("results_file", "out_dir")  # where a run writes: its caller's choice, not a setting to reproduce
MACHINE_KEYS = ("gpu", "gpu_count", "cpu_model", "cpu_affinity", "versions", "cuda", "cudnn",
                "compiler_settings")  # env.fingerprint()'s fields that a measurement depends on


def mode_of(candidate):
    return candidate["compile_mode"] if candidate["compile"] else "eager"


def candidate_name(candidate):
    c = candidate
    return (f"micro-{c['micro_batch_size']}-{mode_of(c)}-{c['compile_scope']}-{c['attention_backend']}-"
            f"{c['loss_impl']}-amb-{c['activation_memory_budget']:g}-threads-{c['cpu_threads']}")


# ---------------------------------------------------------------- the candidates

def listed(cfg, key):
    """The values a list names, each checked as its train.py key checks it; "" gives every value a named key
    declares (eager and every compile mode), and none of a numeric one."""
    lever, field = LISTS[key], settings.field_of(TrainSettings, LISTS[key])
    every = (["eager"] if lever == "compile_mode" else []) + list(field.metadata["choices"] or ())
    if not cfg[key].strip():
        return every
    try:
        values = [field.type(v.strip()) for v in cfg[key].split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{key}={cfg[key]!r}: expected a comma-separated list of {field.type.__name__}") from None
    if not values:
        raise ConfigError(f'{key} is empty; give at least one value, or "" for the default')
    for value in values:  # a name is a declared one (or eager); a number is within its key's bounds
        problem = (value not in every and f"{value!r} is not one of {', '.join(every)}") if every \
            else settings.check_value(lever, value, field)
        if problem:
            raise ConfigError(f"{key}: {problem}")
    return values


def lever_choices(cfg, cuda):
    """Each lever's values to try: the lists, with the config's micro-batch neighbours by default; fa4 named
    where it cannot run is a ConfigError (a sweep without it would not answer the question asked)."""
    choices = {lever: listed(cfg, key) for key, lever in LISTS.items()}
    mb = cfg.micro_batch_size
    choices["micro_batch_size"] = choices["micro_batch_size"] or [m for m in (mb // 2, mb * 2) if m >= 1]
    named_fa4 = "fa4" in choices["attention_backend"] and cfg.tune_backends.strip()
    why = attention.fa4_problem(torch.device("cuda" if cuda else "cpu")) if named_fa4 else None
    if why:
        raise ConfigError(f"tune_backends names fa4, but {why}; leave it out")
    compiled = [m for m in choices["compile_mode"] if m != "eager" and "max-autotune" not in m]
    asked = [key for key in ("tune_compile_scopes", "tune_activation_memory_budgets") if cfg[key] != DEFAULTS[key]]
    if asked and not cfg.compile and not compiled:  # search_space tries them under a compiled mode of the list
        raise ConfigError(f"{' and '.join(asked)} act on a compiled model, and the config is eager with no mode to "
                          f"compile it in tune_compile_modes (max-autotune aside); add one (default) or drop them")
    return choices


def search_space(incumbent, choices):
    """(lever, candidate) pairs in docs/TUNING.md's order: each the incumbent with one lever changed (a compile
    mode may switch compile on or off), none twice, none the incumbent itself."""
    mode = lambda m: {"compile": False} if m == "eager" else {"compile": True, "compile_mode": m}
    autotunes = lambda m: "max-autotune" in m
    modes = choices["compile_mode"]
    # scope and activation memory act only on a compiled model: an eager incumbent's are tried compiled
    compiled = {} if incumbent["compile"] else next((mode(m) for m in modes if m != "eager" and not autotunes(m)),
                                                    None)
    when_compiled = lambda changes: [] if compiled is None else [dict(compiled, **c) for c in changes]
    backends = choices["attention_backend"]
    groups = [("attention_backend", [{"attention_backend": "fa4"}] if "fa4" in backends else []),
              ("loss_impl", [{"loss_impl": v} for v in choices["loss_impl"]]),
              ("compile_mode", [mode(m) for m in modes if not autotunes(m)]),
              ("compile_scope", when_compiled({"compile_scope": s} for s in choices["compile_scope"])),
              ("activation_memory_budget", when_compiled({"activation_memory_budget": a}
                                                         for a in choices["activation_memory_budget"])),
              ("micro_batch_size", [{"micro_batch_size": m} for m in choices["micro_batch_size"]]),
              ("attention_backend", [{"attention_backend": b} for b in backends if b != "fa4"]),
              ("cpu_threads", [{"cpu_threads": t} for t in choices["cpu_threads"]]),
              ("compile_mode", [mode(m) for m in modes if autotunes(m)])]
    space = [(lever, dict(incumbent, **change)) for lever, changes in groups for change in changes]
    return [(lever, c) for i, (lever, c) in enumerate(space) if c != incumbent and c not in [x for _, x in space[:i]]]


def why_not(cfg, candidate, device):
    """Why a candidate is left out on this device (a torch.device), or None: train.py's checks and the machine's,
    CUDA graphs without a GPU, and a backend that runs what the incumbent's does ("auto" is fa4 where it can run,
    else SDPA: under another name its screen would measure the incumbent again; named ones are tried as asked)."""
    c, runs = settings.Config(cfg, **candidate), lambda backend: attention.resolve_backend(backend, device)[0]
    if not cfg.tune_backends.strip() and c.attention_backend != cfg.attention_backend \
            and runs(c.attention_backend) == runs(cfg.attention_backend):
        return f"what the incumbent's {cfg.attention_backend!r} runs here"
    if uses_cudagraphs(c) and device.type != "cuda":
        return "CUDA graphs need a GPU"
    try:
        settings.check(TuneSettings, c)
        settings.sequences_per_update(c)
        plan_lib.check_device(c, device)
    except ConfigError as exc:
        return str(exc)
    return None


def plan(cfg, choices, device):
    """The incumbent, the candidates, and those left out, with one printed line each (why_not, or a backend that
    runs what a candidate kept before runs: "auto" and "sdpa" where fa4 cannot run, say)."""
    incumbent, space, refused = {k: cfg[k] for k in LEVER_KEYS}, [], []
    runs = lambda c: dict(c, attention_backend=attention.resolve_backend(c["attention_backend"], device)[0])
    for lever, candidate in search_space(incumbent, choices):
        why = why_not(cfg, candidate, device) or next((
            f"what {describe(other, incumbent)} runs here" for _, other in space
            if not cfg.tune_backends.strip() and runs(other) == runs(candidate)), None)
        if why:
            print(f"skipping {describe(candidate, incumbent)}: {why}")
            refused.append({"change": describe(candidate, incumbent), "error": why, **candidate})
        else:
            space.append((lever, candidate))
    return incumbent, space, refused


# ---------------------------------------------------------------- measuring a candidate: bench.py in a process

def tracked_files(folder):
    """The files git tracks under folder (none when it is outside the repository or git is missing)."""
    try:
        out = subprocess.run(["git", "-C", str(env.REPO), "ls-files", "-z", "--", str(Path(folder).resolve())],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {(env.REPO / p).resolve() for p in out.stdout.split("\0") if p} if out.returncode == 0 else set()


def reusable(res):
    """A recorded measurement the sweep can take as it is: a success whose rate, wall time and windows are the
    numbers bench.py and the runner write (a hand-edited one is measured again, never a TypeError mid-sweep)."""
    windows = res.get("measurements") if isinstance(res, dict) else None
    return (isinstance(res, dict) and res.get("status") == "ok" and finite_number(res.get("tokens_per_second"))
            and finite_number(res.get("wall_seconds")) and isinstance(windows, list)
            and all(isinstance(m, dict) and finite_number(m.get("seconds")) and isinstance(m.get("updates"), int)
                    for m in windows))


def run_whole(command, timeout):
    """subprocess.run's result for command, run in a process group of its own that a timeout or an interrupt ends
    whole: bench.py's compile workers with it (left running, they would share the next candidate's GPU and CPU)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:  # the timeout, or Ctrl-C and SIGTERM (main): the whole group, then the pipes drained
        with contextlib.suppress(ProcessLookupError):  # a group that ended just then
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def bench_entry(results_file, name):
    """benchmarks.NAME of the results file: {} for none, or for one edited by hand into something else."""
    entry = results.lookup(results_file, ["benchmarks", name])
    return entry if isinstance(entry, dict) else {}


class BenchRunner:
    """measure() for the Sweep: writes the candidate's config and runs bench.py on it in its own process, or
    returns an earlier sweep's measurement of the same thing (a rerun with a larger budget costs only what is new)."""

    def __init__(self, cfg):
        self.cfg, self.source, self.tuned_dir = cfg, env.source_hash(), Path(cfg.tuned_dir)
        try:  # each candidate's config is written there before it runs
            self.tuned_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"tuned_dir {cfg.tuned_dir!r} cannot be made ({exc.strerror}); give a writable "
                              f"folder") from None
        self.tracked = tracked_files(self.tuned_dir)
        try:  # the data (synthetic data too: the model's vocabulary follows the cache at data_dir)
            cache = TokenCache(cfg.data_dir, verify=False).identity
        except CacheError:
            cache = None
        # what a measurement depends on besides its settings: the GPU, the CPU (eager is launch-bound) and the cores
        # it may use, the packages and the compiler's environment, as the fingerprint states them; and the data
        fingerprint = env.fingerprint()
        self.where = dict({k: fingerprint[k] for k in MACHINE_KEYS}, cache_identity=cache)
        # each base config its own candidates' files: another sweep's selection is not overwritten
        self.base = env.hash_json({k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS
                                   and k not in ("name", *WHERE_KEYS, *LEVER_KEYS)})[:8]
        # only successes, from the same code: an error may have been the budget's cut or a passing fault; each
        # stage its own (a screen and a confirmation of one protocol would otherwise stand in for each other, and a
        # rerun would rank the screens by another measurement than the sweep it repeats)
        data, self.previous = results.read_results(cfg.results_file), {}
        history = data.get("history") if isinstance(data.get("history"), list) else []
        sweeps = [h.get("value") for h in history if isinstance(h, dict) and h.get("path") == ["tuning"]]
        for tuning in [t for t in sweeps + [data.get("tuning")] if isinstance(t, dict)]:  # the latest last
            records = tuning.get("candidates") if isinstance(tuning.get("candidates"), list) else []
            for stage, res in [(s, record.get(s)) for record in records if isinstance(record, dict) for s in STAGES]:
                if reusable(res) and res.get("source_hash") == self.source and \
                        isinstance(res.get("candidate_identity"), str):
                    self.previous[res["candidate_identity"], stage] = with_environment(res, tuning.get("environment"))

    def config_path(self, candidate):
        path = self.tuned_dir / f"{candidate_name(candidate)}-{self.base}.py"
        if path.resolve() in self.tracked:
            raise ConfigError(f"tuned_dir {self.cfg.tuned_dir!r} holds {path}, a file git tracks; give a folder "
                              f"git ignores, such as the default out/tuned")
        return path

    def identity(self, candidate, protocol):
        """What a measurement depends on: the training config, the protocol, the machine, not names or paths."""
        keys = {k: v for k, v in dict(self.cfg, **candidate).items() if k in TRAIN_DEFAULTS
                and k not in ("name", *WHERE_KEYS)}
        return env.hash_json({"settings": keys, "protocol": protocol, "machine": self.where})

    def __call__(self, candidate, stage, protocol, timeout):
        cfg, protocol = self.cfg, dict(protocol, data_mode=self.cfg.data_mode)
        name, path = candidate_name(candidate), self.config_path(candidate)
        identity = self.identity(candidate, protocol)
        # the run's name carries the base config's hash, as the file's does: two sweeps' runs get two folders
        keys = {k: v for k, v in dict(cfg, **candidate, name=path.stem).items() if k in TRAIN_DEFAULTS
                and k not in WHERE_KEYS}
        # The candidate's levers are written even at train.py's defaults: compare.py --tuned layers this file over
        # the given config, whose own value of a lever would otherwise stand in for the candidate's.
        write_config_file(path, keys, TRAIN_DEFAULTS, header=f"tune.py candidate {name}\nreproduce: python train.py "
                                                             f"{path}", keep=LEVER_KEYS)
        if (identity, stage) in self.previous:
            return dict(self.previous[identity, stage], reused=True, config_path=str(path))
        bench_name = f"{cfg.name}-{name}-{stage}"
        command = [sys.executable, str(env.REPO / "bench.py"), str(path), f"--name={bench_name}",
                   f"--results_file={cfg.results_file}"] + [f"--{k}={v}" for k, v in protocol.items()]
        start = time.time()
        before = bench_entry(cfg.results_file, bench_name).get("run_id")
        try:
            proc = run_whole(command, timeout=max(1.0, timeout))
            entry = bench_entry(cfg.results_file, bench_name)
            if not entry or entry.get("run_id") == before:  # the process died before recording
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                entry = {"status": "error", "error": f"exit code {proc.returncode}: " + " | ".join(tail)}
        except subprocess.TimeoutExpired:
            entry = {"status": "error", "error": f"timed out after {timeout / 60:.1f} minutes"}
        record = {k: v for k, v in entry.items() if k not in ("config", "traceback")}
        # "rung": the results field that names the stage (screen or confirm)
        record.update(name=name, rung=stage, config_path=str(path), candidate_identity=identity,
                      source_hash=self.source, wall_seconds=time.time() - start, reused=False)
        return record


# ---------------------------------------------------------------- the record and the report

def shared_environment(records):
    """The fingerprint's fields that every run of the sweep shares (one machine), and the records with each run
    keeping only its own (the GPU's clocks and power at that moment, say): the record states the machine once."""
    envs = [rec[s]["environment"] for rec in records for s in STAGES if rec[s] and rec[s].get("environment")]
    shared = {k: v for k, v in envs[0].items() if all(k in e and e[k] == v for e in envs)} if envs else None
    own = lambda run: dict(run, environment={k: v for k, v in run["environment"].items() if k not in shared}) \
        if run and run.get("environment") else run
    return shared, [dict(rec, **{s: own(rec[s]) for s in STAGES}) for rec in records]


def with_environment(run, shared):
    """A run as measured: its own fingerprint fields over the sweep's shared ones."""
    own, shared = run.get("environment"), shared if isinstance(shared, dict) else {}  # a hand-edited file's
    return dict(run, environment={**shared, **(own if isinstance(own, dict) else {})})


def trial_record(sweep, trial, selected):
    """A candidate's entry: its settings, both stages' results, its config file, its status, and the rate that
    stands for it (sweep.measured_by: as the incumbent was measured) with the stage and protocol it was measured by."""
    runs, stage = [res for res in (trial.screen, trial.confirm) if res], sweep.measured_by(trial)
    firsts = [res["first_update_seconds"] for res in runs if res.get("first_update_seconds") is not None]
    peaks = [res["peak_memory_bytes"] for res in runs if res.get("peak_memory_bytes")]
    return dict(trial.candidate, name=candidate_name(trial.candidate), lever=trial.lever, change=sweep.label(trial),
                config_path=next((res["config_path"] for res in runs if res.get("config_path")), None),
                status=sweep.status(trial, selected), screen=trial.screen, confirm=trial.confirm,
                screen_ratio=sweep.screen_ratio(trial), tokens_per_second=rate(trial.results.get(stage)),
                measured_by=stage, protocol=trial.protocols.get(stage),
                compile_seconds=firsts[0] if firsts else None, peak_memory_bytes=max(peaks) if peaks else None,
                not_started=trial.not_started or None)


def tuning_record(cfg, sweep, selected, refused, source):
    """The results file's tuning section: every candidate, the selection and its gain, where the time went."""
    environment, records = shared_environment([trial_record(sweep, t, selected) for t in sweep.trials])
    summary = lambda record: {k: v for k, v in record.items() if k not in STAGES}  # its runs are under candidates
    chosen = summary(records[sweep.trials.index(selected)]) if selected else None
    inc_rate = records[0]["tokens_per_second"]
    return {"run_id": env.new_run_id(), "budget_minutes": cfg.budget,
            "budget_exhausted": any(t.not_started for t in sweep.trials) or sweep.protocols["confirm"] != sweep.full,
            "elapsed_minutes": sweep.elapsed() / 60, "source_hash": source, "environment": environment,
            "protocols": sweep.protocols, "full_protocol": sweep.full,
            "confirmations": sweep.confirm, "incumbent": summary(records[0]), "candidates": records, "selected": chosen,
            "selected_config_path": chosen["config_path"] if chosen else None,
            "gain_over_incumbent": chosen["tokens_per_second"] / inc_rate - 1 if chosen and inc_rate else None,
            "budget_split": sweep.budget_split(), "minutes_to_finish": sweep.seconds_to_finish() / 60,
            "noise": sweep.noise, "screen_noise": sweep.screen_noise, "refused": refused,
            "base_config": {k: v for k, v in cfg.items() if k in TRAIN_DEFAULTS}}


def print_report(tuning):
    """The candidates' table, the selection and its gain, where the budget went, and the selected config."""
    print_candidates(tuning)
    print_budget(tuning)
    print_selection(tuning)


def print_candidates(tuning):
    """One row a candidate (its screen and confirmation, gain over the incumbent), then each failed stage's error."""
    inc, inc_protocol = tuning["incumbent"]["tokens_per_second"], tuning["incumbent"]["protocol"]
    print(f"\n{'candidate':<46}{'screen tok/s':>13}{'x inc':>7}{'confirm tok/s':>14}{'gain':>8}{'compile s':>10}"
          f"{'peak GiB':>9}  status")
    for c in tuning["candidates"]:
        gain = c["tokens_per_second"] / inc - 1 if c["tokens_per_second"] and inc and c["protocol"] == inc_protocol \
            else None
        peak = c["peak_memory_bytes"] / 2**30 if c["peak_memory_bytes"] else None
        print(f"{c['change'][:45]:<46}{fmt(rate(c['screen']), ',.0f'):>13}{fmt(c['screen_ratio'], '.3f'):>7}"
              f"{fmt(rate(c['confirm']), ',.0f'):>14}{fmt(gain, '+.1%'):>8}"
              f"{fmt(c['compile_seconds'], '.1f'):>10}{fmt(peak, '.2f'):>9}  {c['status']}")
    for c in tuning["candidates"]:
        for stage in STAGES:
            if c[stage] and c[stage].get("status") != "ok":
                print(f"  {c['change']}, {stage}: {str(c[stage].get('error'))[:200]}")


def print_budget(tuning):
    """Where the budget went, and what an exhausted budget left out."""
    split = tuning["budget_split"]
    print(f"budget: {split['elapsed_seconds'] / 60:.1f} of {tuning['budget_minutes']:g} min; screens "
          f"{split['screen_seconds'] / 60:.1f}, confirmations {split['confirm_seconds'] / 60:.1f}; compiling "
          f"{split['compile_seconds'] / 60:.1f}, measuring {split['measure_seconds'] / 60:.1f}, starting "
          f"processes and the rest {split['other_seconds'] / 60:.1f}")
    if tuning["budget_exhausted"]:
        confirm, full = tuning["protocols"]["confirm"], tuning["full_protocol"]
        cut = [what for what, why in (("some runs did not fit in what was left", any(c["not_started"] for c in
                                                                                      tuning["candidates"])),
                                      (f"confirmations ran {said(confirm)}, not {said(full)}", confirm != full)) if why]
        print(f"budget exhausted: {'; '.join(cut)}; screening every candidate and confirming the best with the full "
              f"protocol would take about {math.ceil(tuning['minutes_to_finish']):.0f} min (--budget)")


def print_selection(tuning):
    """The selected candidate, its gain and how it was measured, and its config."""
    inc, inc_protocol = tuning["incumbent"]["tokens_per_second"], tuning["incumbent"]["protocol"]
    sel = tuning["selected"]
    if not sel:
        print("no selection: the incumbent could not be measured (not even its screen), nor any candidate confirmed")
        return
    gain = tuning["gain_over_incumbent"]
    versus = f"{100 * gain:+.1f}% over the incumbent" if gain is not None else "the incumbent failed"
    stage = "confirmation" if sel["measured_by"] == "confirm" else "screen"
    print(f"selected {sel['change']}: {sel['tokens_per_second']:,.0f} tok/s ({versus}), measured with "
          f"{said(sel['protocol'])} (its {stage}) -> python train.py {sel['config_path']}")
    if sel["lever"] == "incumbent" and any((c["tokens_per_second"] or 0) > inc and c["protocol"] == inc_protocol
                                           for c in tuning["candidates"]):
        noise = "tune_screen_noise" if tuning["incumbent"]["measured_by"] == "screen" else "tune_noise"
        print(f"  kept: confirmed candidates measured faster, none by more than {noise} "
              f"({tuning[noise.removeprefix('tune_')]:.1%})")
    if sel["config_path"] and Path(sel["config_path"]).is_file():
        print(Path(sel["config_path"]).read_text().rstrip())


# ---------------------------------------------------------------- the sweep

def tune(cfg):
    """Every check first (a mistake that would fail every candidate is one line, not a sweep), then the sweep."""
    started = time.monotonic()  # the budget's start: the checks, the plan and the machine's fingerprint count
    run_plan = plan_lib.resolve(cfg, TuneSettings, world=(0, 0, 1), synthetic=cfg.data_mode == "synthetic")
    results.check_writable(cfg.results_file, sections=["tuning", "benchmarks"])  # where the sweep records
    device = torch.device(run_plan.device)
    cuda = device.type == "cuda"
    incumbent, space, refused = plan(cfg, lever_choices(cfg, cuda), device)
    screen = {"warmup": cfg.tune_screen_warmup, "steps": cfg.tune_screen_steps or (20 if cuda else 10), "windows": 1}
    confirm = {"warmup": cfg.warmup, "steps": cfg.steps, "windows": cfg.windows}  # bench.py's: protocol v2
    runner = BenchRunner(cfg)
    for candidate in [incumbent] + [c for _, c in space]:
        runner.config_path(candidate)  # a tracked file in the way is refused now, not halfway through
    print(f"{len(space)} candidates besides the incumbent; screens: {said(screen)}; confirmations: {said(confirm)} "
          f"or less, as the budget affords after the incumbent's screen", flush=True)
    sweep = Sweep(incumbent, space, runner, cfg.budget * 60, {"screen": screen, "confirm": confirm},
                  candidate_timeout=cfg.candidate_timeout * 60, confirm=cfg.tune_confirm,
                  screen_noise=cfg.tune_screen_noise, noise=cfg.tune_noise, say=lambda text: print(text, flush=True),
                  started=started)
    try:
        selected = sweep.run()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (main): what was measured is recorded, for a rerun to reuse
        results.record(cfg.results_file, ["tuning"],
                       dict(tuning_record(cfg, sweep, None, refused, runner.source), interrupted=True))
        raise
    tuning = tuning_record(cfg, sweep, selected, refused, runner.source)
    results.record(cfg.results_file, ["tuning"], tuning)
    print_report(tuning)
    return tuning


def interrupt(signum, frame):
    raise KeyboardInterrupt  # a scheduler's SIGTERM, as Ctrl-C: the sweep records what it measured


def main(argv):
    signal.signal(signal.SIGTERM, interrupt)
    try:
        cfg = settings.load(TuneSettings, argv)  # tune() checks it
        tuning = tune(cfg)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the runs measured so far are recorded under tuning (interrupted), and a rerun reuses "
              "them", file=sys.stderr)
        return 130
    return 0 if tuning["selected"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
