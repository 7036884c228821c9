"""Sweep execution settings that keep the math, within a time budget: python tune.py [config] --budget 45

The incumbent first. The config's own execution settings are screened (seconds: this says how long their full
protocol will take), then measured with the full protocol v2 (bench.py's warmup, steps and windows), so that any
budget that can finish one run ends with a selection, and every candidate is judged against them. Where the
full protocol would not finish in the budget (a small CPU), its windows are shortened to fit (tune_fit_protocol),
which is printed and recorded in the tuning section's protocols.

Screen, then confirm (successive halving, as in Hyperband). Every candidate is the incumbent with one lever
changed. Each first runs a screen: tune_screen_warmup updates, then one window of tune_screen_steps, its first
update (the compile) timed apart. Once all are screened, the levers that won their screens by more than
tune_screen_noise are also tried together, as one more candidate. The best tune_confirm_fraction of the screened
candidates (at least one), among those within tune_screen_noise of the incumbent's screen or faster, go on to the
full protocol, best screen first. Only a candidate measured with the full protocol can be selected, and one
displaces the incumbent only when it is faster by more than tune_noise, so the selection is never slower than
the config's own settings beyond noise.

The budget. No run starts that its estimate does not fit in what is left: the compile, from candidates measured
with the same compile settings (else scaled from another compile, else tune_compile_guess), plus the protocol's
updates at the incumbent's measured pace (slower by as much as the candidate screened slower) and the time a run
spends outside its updates (starting the process, building the model). A screen also leaves room for the confirmations
the screens so far have earned, or for one. A candidate that does not fit is skipped and the next, maybe cheaper,
one is tried. A run is ended at candidate_timeout or at the end of the budget. Each run is bench.py in its own
process, so an out-of-memory error, a crash or a hang ends that candidate only.

The levers, in the order they are screened: the largest gain this project measured first, and the costliest
compile last (docs/PERFORMANCE.md has the figures): the fa4 attention path (+2.9% on the H200); the loss
implementations (fused is the configs' default); the compile modes that compile as fast as the plain one (CUDA
graphs +1%, and eager); the compile scope (blocks: half the compile time, within 3%); activation_memory_budget
(less memory for a few percent); the micro-batch sizes next to the config's (the configs state their knee);
SDPA's other attention kernels (auto already picks the fastest, cuDNN, on the H200); CPU threads; and last the
modes that autotune kernels (minutes of compile for no measured gain). A value is tried only where it can run:
fa4 with the flash-attn-4 package on a Hopper or Blackwell GPU, CUDA graphs on a GPU, and every candidate must
pass train.check_execution (one printed line when it does not). A backend that runs what the incumbent's runs
(fa4 or SDPA, whichever "auto" is here) is left out with one line: it would measure the incumbent again.
"""
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

import bench
import env
import results
import train
from configurator import ConfigError, load_config, write_config_file
from data.loader import CacheError, TokenCache
from kernels import attention
from kernels.attention import CUDA_ONLY_BACKENDS

# ---------------------------------------------------------------- defaults (plus everything bench.py takes)
budget = 45.0                    # minutes for the whole sweep
candidate_timeout = 10.0         # minutes; a run longer than this is ended and recorded as an error
tuned_dir = "out/tuned"          # candidate configs go here (git ignores out/); never over a tracked file
tune_backends = ""               # attention backends; "": every one in kernels/attention.py that runs here
tune_loss_impls = ""             # "": every loss implementation in kernels/cross_entropy.py
tune_compile_modes = ""          # "": eager and every mode in train.COMPILE_MODES
tune_compile_scopes = ""         # "": every scope in train.COMPILE_SCOPES
tune_activation_memory_budgets = "0.8"  # besides the config's own; each in (0, 1]
tune_micro_batch_sizes = ""      # "": half and double the config's
tune_threads = ""                # e.g. "1,4,8"; "": the config's cpu_threads only
tune_screen_warmup = 3           # a screen: these updates (the first one compiles), then one window
tune_screen_steps = 0            # updates in a screen's window; 0: 10 on the CPU, 20 on a GPU
tune_confirm_fraction = 0.34     # the share of screened candidates that go on to the full protocol (at least one)
tune_screen_noise = 0.03         # a screen within this share below the incumbent's can still be confirmed
tune_noise = 0.01                # a candidate must beat the incumbent's full protocol by this share to be selected
tune_compile_guess = 60.0        # seconds a whole-model compile is assumed to take before any compile is measured
tune_fit_protocol = True         # shorten the confirmation's windows when the incumbent's would not finish in the
                                 # budget (printed and recorded), rather than select nothing

WHERE_KEYS = ("results_file", "out_dir")
TUNE_KEYS = ("budget", "candidate_timeout", "tuned_dir", "tune_backends", "tune_loss_impls", "tune_compile_modes",
             "tune_compile_scopes", "tune_activation_memory_budgets", "tune_micro_batch_sizes", "tune_threads",
             "tune_screen_warmup", "tune_screen_steps", "tune_confirm_fraction", "tune_screen_noise", "tune_noise",
             "tune_compile_guess", "tune_fit_protocol")

DEFAULTS = dict(bench.DEFAULTS, name="tune", **{k: globals()[k] for k in TUNE_KEYS})
LEVER_KEYS = ("attention_backend", "loss_impl", "compile", "compile_mode", "compile_scope",
              "activation_memory_budget", "micro_batch_size", "cpu_threads")
RUNGS = ("screen", "confirm")
PROTOCOLS = {"screen": {"warmup": 3, "steps": 20, "windows": 1}, "confirm": {"warmup": 20, "steps": 100, "windows": 3}}
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes trainer.py runs under CUDA graphs
# Screening order: a change's group, then its place in its list (see the module docstring for why).
ORDER = ("fa4", "loss_impl", "compile_mode", "compile_scope", "activation_memory_budget", "micro_batch_size",
         "attention_backend", "cpu_threads", "autotuning")
# Compile time relative to a plain compile of one block: whole-model compiles took 15 to 23 s against 8 to 14 s
# for blocks, and matmul autotuning 172 s against about 20 s (docs/PERFORMANCE.md).
SCOPE_COMPILE_WEIGHT = {"model": 2.0, "blocks": 1.0}
AUTOTUNE_COMPILE_WEIGHT = 8.0
FA4_COMPILE_SECONDS = 5.0        # flash-attn-4 compiles its backward in the first update: 3 to 4 s


def mode_of(candidate):
    return candidate["compile_mode"] if candidate["compile"] else "eager"


def candidate_name(candidate):
    c = candidate
    return (f"micro-{c['micro_batch_size']}-{mode_of(c)}-{c['compile_scope']}-{c['attention_backend']}-"
            f"{c['loss_impl']}-amb-{c['activation_memory_budget']:g}-threads-{c['cpu_threads']}")


def describe(c, incumbent):
    """What a candidate changes in the incumbent, as a person would write it."""
    parts = []
    if c["compile"] != incumbent["compile"]:
        parts.append("compile=True" if c["compile"] else "eager")
    parts += [f"{k}={c[k]:g}" if isinstance(c[k], float) else f"{k}={c[k]}" for k in LEVER_KEYS
              if k != "compile" and c[k] != incumbent[k] and (c["compile"] or k != "compile_mode")]
    return ", ".join(parts) or "incumbent (the config's own)"


def rate(result):
    return result["tokens_per_second"] if result and result.get("status") == "ok" else None


def is_out_of_memory(result):
    return bool(result) and result.get("status") != "ok" and "out of memory" in str(result.get("error", "")).lower()


# ---------------------------------------------------------------- the search space

def lever_changes(incumbent, choices, cuda):
    """(group, lever, change) for every listed value of every lever but the incumbent's own, in list order."""
    inc, out = incumbent, []
    modes = [m for m in choices["compile_mode"] if m == "eager" or cuda or m not in CUDA_GRAPH_MODES]
    for b in choices["attention_backend"]:
        out.append(("fa4" if b == "fa4" else "attention_backend", "attention_backend", {"attention_backend": b}))
    out += [("loss_impl", "loss_impl", {"loss_impl": v}) for v in choices["loss_impl"]]
    for m in modes:
        group = "autotuning" if "max-autotune" in m else "compile_mode"
        change = {"compile": False} if m == "eager" else {"compile": True, "compile_mode": m}
        out.append((group, "compile_mode", change))
    # Scope and activation memory act only on a compiled model: an eager incumbent's are tried compiled.
    compiled = {} if inc["compile"] else next(({"compile": True, "compile_mode": m} for m in modes
                                               if m != "eager" and "max-autotune" not in m), None)
    if compiled is not None:
        out += [("compile_scope", "compile_scope", dict(compiled, compile_scope=s)) for s in choices["compile_scope"]]
        out += [("activation_memory_budget", "activation_memory_budget", dict(compiled, activation_memory_budget=a))
                for a in choices["activation_memory_budget"]]
    out += [("micro_batch_size", "micro_batch_size", {"micro_batch_size": m}) for m in choices["micro_batch_size"]]
    out += [("cpu_threads", "cpu_threads", {"cpu_threads": t}) for t in choices["cpu_threads"]]
    return out


def search_space(incumbent, choices, cuda):
    """The candidates to screen, in order, as (lever, settings): each the incumbent with one lever changed, none
    twice, none the incumbent itself. CUDA-graph modes only where cuda is true."""
    changes = lever_changes(incumbent, choices, cuda)
    changes.sort(key=lambda g: ORDER.index(g[0]))  # stable: a group keeps its list order
    space, seen = [], [incumbent]
    for _, lever, change in changes:
        candidate = dict(incumbent, **change)
        if candidate not in seen:
            seen.append(candidate)
            space.append((lever, candidate))
    return space


# ---------------------------------------------------------------- the strategy

class Trial:
    """One candidate: its settings, the lever it changes, and its screen and confirm results."""

    def __init__(self, candidate, lever):
        self.candidate, self.lever = candidate, lever
        self.results = {}       # rung -> the measure function's result
        self.seconds = {}       # rung -> wall seconds on the sweep's clock
        self.not_started = {}   # rung -> why it was not started

    @property
    def screen(self):
        return self.results.get("screen")

    @property
    def confirm(self):
        return self.results.get("confirm")


class Progress:
    """What a sweep says while it runs; this one says nothing (tests), tune() prints."""

    def start(self, sweep, trial, rung, timeout):
        pass

    def result(self, sweep, trial, rung, result):
        pass

    def skip(self, sweep, trial, rung, why):
        pass

    def note(self, sweep, text):
        pass


class Sweep:
    """The strategy, separate from how a candidate is measured, so tests can drive it with a fake clock.

    measure(candidate, rung, protocol, timeout_seconds) -> a bench entry: status, tokens_per_second,
    first_update_seconds (compile included), and optionally warmup_seconds, measurements (seconds and updates
    of each window), peak_memory_bytes, wall_seconds (a reused measurement's own), error. protocols: warmup,
    steps and windows per rung. valid(candidate) -> None, or why the candidate cannot run."""

    def __init__(self, incumbent, space, measure, budget_seconds, clock=time.monotonic, candidate_timeout=math.inf,
                 confirm_fraction=0.34, screen_noise=0.03, noise=0.01, compile_guess=60.0, valid=None,
                 progress=None, protocols=None, fit=True):
        self.protocols = {rung: dict(p) for rung, p in (protocols or PROTOCOLS).items()}
        self.fit, self.fitted = fit, None
        self.incumbent = Trial(incumbent, "incumbent")
        self.trials = [self.incumbent] + [Trial(c, lever) for lever, c in space]
        self.measure, self.budget_seconds, self.clock = measure, budget_seconds, clock
        self.candidate_timeout, self.confirm_fraction = candidate_timeout, confirm_fraction
        self.screen_noise, self.noise, self.compile_guess = screen_noise, noise, compile_guess
        self.valid = valid or (lambda c: None)
        self.progress = progress or Progress()
        self.refused = []       # (candidate, why) of combinations that valid() refused
        self.start_time = clock()

    def elapsed(self):
        return self.clock() - self.start_time

    def left(self):
        return self.budget_seconds - self.elapsed()

    # -- estimates

    def measured(self, rung=None):
        """(trial, rung, result) of every run so far, of one rung or all."""
        return [(t, r, res) for t in self.trials for r, res in t.results.items() if rung in (None, r)]

    def wall(self, trial, rung):
        return trial.results[rung].get("wall_seconds", trial.seconds.get(rung, 0.0))

    def compile_estimate(self, c):
        """Seconds of c's first update: the slowest measured with c's compile settings, else the slowest other
        compile scaled by the known ratios, else tune_compile_guess scaled the same way."""
        def weight(x):
            w = SCOPE_COMPILE_WEIGHT.get(x["compile_scope"], 2.0)
            return w * (AUTOTUNE_COMPILE_WEIGHT if "max-autotune" in mode_of(x) else 1.0)

        def signature(x):
            return (mode_of(x), x["compile_scope"] if x["compile"] else None, x["attention_backend"] == "fa4")
        firsts = [(t.candidate, res["first_update_seconds"]) for t, _, res in self.measured()
                  if res.get("first_update_seconds") is not None]
        same = [s for x, s in firsts if signature(x) == signature(c)]
        if same:
            return max(same)
        fa4 = FA4_COMPILE_SECONDS if c["attention_backend"] == "fa4" else 0.0
        if not c["compile"]:
            return fa4 + max([s for x, s in firsts if not x["compile"]], default=0.0)
        scaled = [s * weight(c) / weight(x) for x, s in firsts if x["compile"]]
        return fa4 + (max(scaled) if scaled else self.compile_guess * weight(c) / SCOPE_COMPILE_WEIGHT["model"])

    def pace(self):
        """(seconds per update, seconds of a run outside its updates, the trial it ran) from the incumbent's
        longest run, else any run with window figures; None before there is one."""
        ok = [(t, r, res) for t, r, res in self.measured() if rate(res) and res.get("measurements")
              and all(m.get("updates") for m in res["measurements"])]
        if not ok:
            return None
        t, r, res = max(ok, key=lambda x: (x[0] is self.incumbent, x[1] == "confirm"))
        window_s = sum(m["seconds"] for m in res["measurements"])
        per_update = window_s / sum(m["updates"] for m in res["measurements"])
        outside = self.wall(t, r) - (res.get("warmup_seconds") or res.get("first_update_seconds") or 0.0) - window_s
        return per_update, max(0.0, outside), t

    def run_estimate(self, trial, rung):
        """Seconds a run of trial in rung should take: its compile, plus the updates of the rung's protocol and
        the time outside them at the incumbent's pace, slower by as much as trial screened slower (screens are
        compared with screens, a confirmation's pace being steadier than a screen's). Before
        any run has window figures: the rest of a run of that rung (else of the other) beside its compile."""
        compile_s, own = self.compile_estimate(trial.candidate), rate(trial.screen)
        pace = self.pace()
        if pace:
            per_update, outside, ref = pace
            p, ref_screen = self.protocols[rung], rate(ref.screen)
            slower = max(1.0, ref_screen / own) if own and ref_screen and ref is not trial else 1.0
            return compile_s + outside + (p["warmup"] + p["windows"] * p["steps"]) * per_update * slower
        ok = [(t, r) for t, r, res in self.measured() if res.get("status") == "ok"]
        ref = [(t, r) for t, r in ok if r == rung] or ok
        rest = max((self.wall(t, r) - (t.results[r].get("first_update_seconds") or 0.0) for t, r in ref), default=0.0)
        inc_screen = rate(self.incumbent.screen)
        slower = max(1.0, inc_screen / own) if inc_screen and own else 1.0
        return compile_s + max(0.0, rest) * slower

    def fit_confirmation(self):
        """Shorten the confirmation when the incumbent's full protocol would not finish in the budget left (a
        small CPU): its windows, and its warmup in proportion, to fit in a third of what is left (the rest holds
        screens and one more confirmation), else in all of it, else as short as a screen's window and warmup,
        the best chance left of a selection. Returns the protocol chosen, or None when the full one fits."""
        p, pace = self.protocols["confirm"], self.pace()
        if not self.fit or not pace or self.run_estimate(self.incumbent, "confirm") <= self.left():
            return None
        per_update, outside, _ = pace
        fixed = self.compile_estimate(self.incumbent.candidate) + outside
        least = self.protocols["screen"]
        shapes = [(max(least["warmup"], round(p["warmup"] * steps / p["steps"])), steps)
                  for steps in range(p["steps"], min(least["steps"], p["steps"]) - 1, -1)]
        fits = lambda room: [s for s in shapes if fixed + (s[0] + p["windows"] * s[1]) * per_update <= room]
        warmup, steps = (fits(self.left() / 3) or fits(self.left()) or shapes[-1:])[0]
        self.fitted = {"warmup": p["warmup"], "steps": p["steps"], "fitted_warmup": warmup, "fitted_steps": steps,
                       "budget_left_seconds": self.left()}
        self.progress.note(self, f"the full protocol ({p['warmup']} + {p['windows']} x {p['steps']} updates) would "
                                 f"not finish in the {self.left():.0f} s left: confirming with {warmup} + "
                                 f"{p['windows']} x {steps}")
        p.update(warmup=warmup, steps=steps)
        return dict(p)

    # -- runs

    def attempt(self, trial, rung, reserve=0.0, gate=True):
        """Measure trial in rung if its estimate fits in the budget left after `reserve` seconds (or, gate
        false, whatever it is); its result, or None when it was not started."""
        if rung in trial.results:
            return trial.results[rung]
        room = self.left() - reserve
        compile_seconds, estimate = self.compile_estimate(trial.candidate), self.run_estimate(trial, rung)
        if room <= 0 or gate and (compile_seconds > room or estimate > room):
            held = f", {reserve:.0f} s of them held for confirmations" if reserve > 0 else ""
            left = f"{max(self.left(), 0):.0f} s left{held}"
            what = "compile" if compile_seconds > room else "run"
            seconds = compile_seconds if what == "compile" else estimate
            why = f"budget: {left}" if room <= 0 else f"budget: its {what} is estimated at {seconds:.0f} s; {left}"
            trial.not_started[rung] = why
            self.progress.skip(self, trial, rung, why)
            return None
        timeout = min(self.candidate_timeout, room)
        self.progress.start(self, trial, rung, timeout)
        start = self.clock()
        result = self.measure(trial.candidate, rung, dict(self.protocols[rung]), timeout)
        trial.seconds[rung] = self.clock() - start
        trial.results[rung] = result
        self.progress.result(self, trial, rung, result)
        return result

    def screen_ratio(self, trial):
        inc, own = rate(self.incumbent.screen), rate(trial.screen)
        return own / inc if inc and own else None

    def promoted(self):
        """The screened candidates that go on to the full protocol, best screen first."""
        ok = [t for t in self.trials if t is not self.incumbent and rate(t.screen)]
        quota = max(1, math.ceil(self.confirm_fraction * len(ok)))
        close = [t for t in ok if self.screen_ratio(t) is None or self.screen_ratio(t) >= 1 - self.screen_noise]
        return sorted(close, key=lambda t: -rate(t.screen))[:quota]

    def reserve(self):
        """Seconds a screen must leave: the confirmations the screens so far have earned, or one like the
        incumbent's, so that a winner found late can still be confirmed."""
        waiting = [t for t in self.promoted() if "confirm" not in t.results]
        if waiting:
            return sum(self.run_estimate(t, "confirm") for t in waiting)
        return self.run_estimate(self.incumbent, "confirm") if self.incumbent.confirm else 0.0

    def combined(self):
        """The incumbent with every lever that won its screen by more than the screen noise, the best first; None
        unless two levers won. A change that contradicts one already taken is left out."""
        winners = sorted((t for t in self.trials if t is not self.incumbent and t.lever != "combined"
                          and (self.screen_ratio(t) or 0) > 1 + self.screen_noise), key=lambda t: -rate(t.screen))
        inc, merged, levers = self.incumbent.candidate, {}, set()
        for t in winners:
            change = {k: v for k, v in t.candidate.items() if v != inc[k]}
            if t.lever in levers or any(merged.get(k, v) != v for k, v in change.items()):
                continue
            merged.update(change)
            levers.add(t.lever)
        candidate = dict(inc, **merged)
        if len(levers) < 2 or any(t.candidate == candidate for t in self.trials):
            return None
        why = self.valid(candidate)
        if why:
            self.refused.append((candidate, why))
            return None
        return candidate

    def run(self):
        # The incumbent's screen (seconds) says how long its full protocol will take; nothing is measured yet
        # to estimate either from, and only the second guarantees a selection: both run whatever their compile
        # is guessed to take, ended by the budget at worst.
        self.attempt(self.incumbent, "screen", gate=False)
        self.fit_confirmation()
        self.attempt(self.incumbent, "confirm", gate=False)
        for trial in self.trials[1:]:
            self.attempt(trial, "screen", self.reserve())
        candidate = self.combined()
        if candidate is not None:
            self.trials.append(Trial(candidate, "combined"))
            self.attempt(self.trials[-1], "screen", self.reserve())
        for trial in self.promoted():
            self.attempt(trial, "confirm")
        return self.selection()

    def selection(self):
        """The fastest trial measured with the full protocol; the incumbent unless beaten by more than noise."""
        confirmed = [t for t in self.trials if rate(t.confirm)]
        if not confirmed:
            return None
        best = max(confirmed, key=lambda t: rate(t.confirm))
        inc = rate(self.incumbent.confirm)
        if inc and best is not self.incumbent and rate(best.confirm) <= inc * (1 + self.noise):
            return self.incumbent
        return best

    def exhausted(self):
        """Whether the budget cut the sweep short: a run not started, or a promoted candidate not confirmed."""
        return any(t.not_started for t in self.trials)

    def seconds_to_finish(self):
        """About how long the whole sweep would take: the incumbent's two runs, a screen of every candidate,
        and the confirmations its screens would earn (as many as the fraction gives of all of them)."""
        others = [t for t in self.trials if t is not self.incumbent]
        done = sum(self.incumbent.seconds.values())
        screens = sum(t.seconds.get("screen") or self.run_estimate(t, "screen") for t in others)
        quota = max(1, math.ceil(self.confirm_fraction * len(others)))
        return done + screens + quota * self.run_estimate(self.incumbent, "confirm")

    def budget_split(self):
        """Where the time went: compiling (first updates), measuring (the other updates), and the rest
        (starting processes, building models, writing results); measurements reused cost nothing."""
        compile_s = measure_s = 0.0
        for t, rung, res in self.measured():
            if res.get("reused"):
                continue
            first = res.get("first_update_seconds") or 0.0
            compile_s += first
            measure_s += max(0.0, (res.get("warmup_seconds") or first) - first)
            measure_s += sum(m.get("seconds", 0.0) for m in res.get("measurements") or [])
        rungs = {r: sum(t.seconds.get(r, 0.0) for t in self.trials) for r in RUNGS}
        elapsed = self.elapsed()
        return {"elapsed_seconds": elapsed, "compile_seconds": compile_s, "measure_seconds": measure_s,
                "other_seconds": max(0.0, elapsed - compile_s - measure_s), "screen_seconds": rungs["screen"],
                "confirm_seconds": rungs["confirm"]}

    def status(self, trial, selected):
        """One word or phrase for the report."""
        if trial is selected:
            return "selected"
        for rung in ("confirm", "screen"):
            res = trial.results.get(rung)
            if res and res.get("status") != "ok":
                return f"{rung}: " + ("out of memory" if is_out_of_memory(res) else "error")
        if trial.confirm:
            return "confirmed"
        if trial.not_started:
            return "not started" if "screen" in trial.not_started else "not confirmed (budget)"
        if trial in self.promoted():
            return "promoted"
        return "screened out" if trial.screen else "-"


# ---------------------------------------------------------------- the settings

def parse_list(text, kind, key):
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{key}={text!r}: expected a comma-separated list of {kind.__name__}") from None


def named_choices(cfg, key, valid, what):
    """The listed values of a lever given by name, each one of `valid`; "" gives them all."""
    values = parse_list(cfg[key], str, key) if cfg[key].strip() else list(valid)
    if not values:
        raise ConfigError(f"{key} is empty; give at least one value, or \"\" for every {what}")
    for v in values:
        if v not in valid:
            raise ConfigError(f"{key}: {v!r} is not one of {', '.join(valid)}")
    return values


def lever_choices(cfg, cuda):
    """Each lever's values to try, checked; fa4 asked for by name but unable to run here is a ConfigError."""
    backends = named_choices(cfg, "tune_backends", list(train.model_lib.ATTENTION_BACKENDS), "attention backend")
    device = torch.device("cuda" if cuda else "cpu")
    if "fa4" in backends:
        why = attention.fa4_problem(device)  # the package, or a GPU that is not Hopper or Blackwell
        if why and cfg.tune_backends.strip():
            raise ConfigError(f"tune_backends names fa4, but {why}; leave it out")
        if why:
            print(f"skipping attention_backend=fa4: {why}")
            backends.remove("fa4")
    # "auto" runs fa4 where it can and SDPA elsewhere, so one of those is the incumbent's attention under another
    # name: a screen of it would measure the incumbent again
    runs = lambda backend: attention.resolve_backend(backend, device)[0]
    same = [b for b in backends if b != cfg.attention_backend and runs(b) == runs(cfg.attention_backend)]
    if same and not cfg.tune_backends.strip():  # named ones are tried as asked
        print(f"skipping attention_backend={', '.join(same)}: what the incumbent's {cfg.attention_backend!r} runs here")
        backends = [b for b in backends if b not in same]
    gpu_only = [b for b in backends if b in CUDA_ONLY_BACKENDS]
    if not cuda and gpu_only and not cfg.tune_backends.strip():  # named ones are tried, and fail in one line
        print(f"skipping attention_backend {', '.join(gpu_only)}: SDPA runs them only on CUDA GPUs")
        backends = [b for b in backends if b not in CUDA_ONLY_BACKENDS]
    modes = named_choices(cfg, "tune_compile_modes", ["eager", *train.COMPILE_MODES], "compile mode")
    choices = {"attention_backend": backends, "compile_mode": modes,
               "loss_impl": named_choices(cfg, "tune_loss_impls", list(train.model_lib.LOSS_IMPLEMENTATIONS),
                                          "loss implementation"),
               "compile_scope": named_choices(cfg, "tune_compile_scopes", list(train.COMPILE_SCOPES), "scope"),
               "activation_memory_budget": parse_list(cfg.tune_activation_memory_budgets, float,
                                                      "tune_activation_memory_budgets"),
               "micro_batch_size": parse_list(cfg.tune_micro_batch_sizes, int, "tune_micro_batch_sizes")
               or [m for m in (cfg.micro_batch_size // 2, cfg.micro_batch_size * 2) if m >= 1],
               "cpu_threads": parse_list(cfg.tune_threads, int, "tune_threads")}
    for a in choices["activation_memory_budget"]:
        if not 0 < a <= 1:
            raise ConfigError(f"tune_activation_memory_budgets: {a:g} does not lie in (0, 1]")
    if not cuda:
        skipped = [m for m in modes if m in CUDA_GRAPH_MODES]
        if skipped:
            print(f"skipping compile_mode {', '.join(skipped)}: CUDA graphs need a GPU")
    return choices


def check_settings(cfg):
    """The sweep's own keys, refused as one line before any work."""
    for key in ("budget", "candidate_timeout"):
        if cfg[key] <= 0:
            raise ConfigError(f"{key} must be a positive number of minutes, got {cfg[key]}")
    if cfg.tune_screen_warmup < 1:
        raise ConfigError(f"tune_screen_warmup must be at least 1 (the first update compiles), got "
                          f"{cfg.tune_screen_warmup}")
    if cfg.tune_screen_steps < 0:
        raise ConfigError(f"tune_screen_steps must be 0 (10 on the CPU, 20 on a GPU) or more, got "
                          f"{cfg.tune_screen_steps}")
    if not 0 < cfg.tune_confirm_fraction <= 1:
        raise ConfigError(f"tune_confirm_fraction must lie in (0, 1], got {cfg.tune_confirm_fraction}")
    for key in ("tune_screen_noise", "tune_noise", "tune_compile_guess"):
        if cfg[key] < 0:
            raise ConfigError(f"{key} must be 0 or more, got {cfg[key]}")


# ---------------------------------------------------------------- measuring a candidate: bench.py in a process

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


def candidate_identity(cfg, candidate, protocol, where):
    """What a measurement depends on: the candidate's training config, the protocol, the machine and the
    data, not names or paths."""
    settings = {k: v for k, v in dict(cfg, **candidate).items()
                if k in train.DEFAULTS and k not in ("name", *WHERE_KEYS)}
    return env.hash_json({"settings": settings, "protocol": protocol, "machine": where})


def tracked_files(folder):
    """The files git tracks under folder (none when it is outside the repository or git is missing)."""
    try:
        out = subprocess.run(["git", "-C", str(env.REPO), "ls-files", "-z", "--", str(Path(folder).resolve())],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {(env.REPO / p).resolve() for p in out.stdout.split("\0") if p} if out.returncode == 0 else set()


class BenchRunner:
    """measure() for the Sweep: writes the candidate's config and runs bench.py on it in its own process."""

    def __init__(self, cfg, where, previous):
        self.cfg, self.where, self.previous = cfg, where, previous
        self.source = env.source_hash()
        self.tuned_dir = Path(cfg.tuned_dir)
        try:  # each candidate's config is written there before it runs
            self.tuned_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"tuned_dir {cfg.tuned_dir!r} cannot be made ({exc.strerror}); give a writable "
                              f"folder") from None
        self.tracked = tracked_files(self.tuned_dir)

    def config_path(self, candidate):
        path = self.tuned_dir / f"{candidate_name(candidate)}.py"
        if path.resolve() in self.tracked:
            raise ConfigError(f"tuned_dir {self.cfg.tuned_dir!r} holds {path}, a file git tracks; give a folder "
                              f"git ignores, such as the default out/tuned")
        return path

    def write_config(self, candidate):
        name, path = candidate_name(candidate), self.config_path(candidate)
        # where a run writes its results and checkpoints is its caller's choice, not a setting to reproduce
        settings = {k: v for k, v in dict(self.cfg, **candidate, name=name).items()
                    if k in train.DEFAULTS and k not in WHERE_KEYS}
        write_config_file(path, settings, train.DEFAULTS,
                          header=f"tune.py candidate {name}\nreproduce: python train.py {path}")
        return path

    def __call__(self, candidate, rung, protocol, timeout):
        cfg, protocol = self.cfg, dict(protocol, data_mode=self.cfg.data_mode)
        name, path = candidate_name(candidate), self.write_config(candidate)
        identity = candidate_identity(cfg, candidate, protocol, self.where)
        if identity in self.previous:
            return dict(self.previous[identity], reused=True, config_path=str(path))
        bench_name = f"{cfg.name}-{name}-{rung}"
        command = [sys.executable, str(env.REPO / "bench.py"), str(path), f"--name={bench_name}",
                   f"--results_file={cfg.results_file}"] + [f"--{k}={v}" for k, v in protocol.items()]
        start = time.time()
        before = (results.lookup(cfg.results_file, ["benchmarks", bench_name]) or {}).get("run_id")
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, timeout))
            entry = results.lookup(cfg.results_file, ["benchmarks", bench_name])
            if not entry or entry.get("run_id") == before:  # the process died before recording
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                entry = {"status": "error", "error": f"exit code {proc.returncode}: " + " | ".join(tail)}
        except subprocess.TimeoutExpired:
            entry = {"status": "error", "error": f"timed out after {timeout / 60:.1f} minutes"}
        record = {k: v for k, v in entry.items() if k not in ("config", "traceback")}
        record.update(name=name, rung=rung, config_path=str(path), candidate_identity=identity,
                      source_hash=self.source, wall_seconds=time.time() - start, reused=False)
        return record


def previous_measurements(cfg):
    """Earlier sweeps' measurements by identity, from the same code: only successes, since an error may have
    been the budget's cut or a passing fault and is measured again."""
    source, previous = env.source_hash(), {}
    tuning = results.lookup(cfg.results_file, ["tuning"]) or {}
    for record in tuning.get("candidates", []):
        for res in (record.get("screen"), record.get("confirm")):
            if isinstance(res, dict) and res.get("source_hash") == source and res.get("status") == "ok" \
                    and res.get("candidate_identity"):
                previous[res["candidate_identity"]] = with_environment(res, tuning.get("environment"))
    return previous


# ---------------------------------------------------------------- what a person reads

class PrintedProgress(Progress):
    """A line as each run starts (a run's output is kept for its error, so say what runs), and as it ends."""

    def __init__(self, cfg):
        self.cfg = cfg

    def head(self, sweep, rung):
        done = sum(1 for t in sweep.trials if rung in t.results or rung in t.not_started)
        total = len(sweep.trials) if rung == "screen" else max(len(sweep.promoted()), 1) + 1
        return f"[{rung} {done}/{total}] {sweep.elapsed() / 60:.1f}/{self.cfg.budget:g} min"

    def start(self, sweep, trial, rung, timeout):
        label = describe(trial.candidate, sweep.incumbent.candidate)
        print(f"  running {label}: {rung} (at most {timeout / 60:.1f} min)...", flush=True)

    def result(self, sweep, trial, rung, result):
        label = describe(trial.candidate, sweep.incumbent.candidate)
        if rate(result):
            text = f"{rate(result):,.0f} tok/s"
            ratio = sweep.screen_ratio(trial) if rung == "screen" else None
            text += f" ({ratio:.3f}x the incumbent's screen)" if ratio and trial is not sweep.incumbent else ""
            if result.get("first_update_seconds") is not None:
                text += f", first update {result['first_update_seconds']:.1f} s"
        else:
            text = f"error: {str(result.get('error'))[:100]}"
        reused = " (measured before)" if result.get("reused") else ""
        print(f"{self.head(sweep, rung)}  {label}: {text}{reused}", flush=True)

    def skip(self, sweep, trial, rung, why):
        label = describe(trial.candidate, sweep.incumbent.candidate)
        print(f"{self.head(sweep, rung)}  {label}: {rung} not started ({why})", flush=True)

    def note(self, sweep, text):
        print(text, flush=True)


def trial_record(sweep, trial, selected):
    """A candidate's entry in the tuning record: its settings, both rungs' results, and its status."""
    runs = [res for res in (trial.screen, trial.confirm) if res]
    firsts = [res["first_update_seconds"] for res in runs if res.get("first_update_seconds") is not None]
    peaks = [res["peak_memory_bytes"] for res in runs if res.get("peak_memory_bytes")]
    return dict(trial.candidate, name=candidate_name(trial.candidate), lever=trial.lever,
                change=describe(trial.candidate, sweep.incumbent.candidate),
                config_path=next((res["config_path"] for res in runs if res.get("config_path")), None),
                status=sweep.status(trial, selected), screen=trial.screen, confirm=trial.confirm,
                screen_ratio=sweep.screen_ratio(trial), tokens_per_second=rate(trial.confirm),
                compile_seconds=firsts[0] if firsts else None, peak_memory_bytes=max(peaks) if peaks else None,
                not_started=trial.not_started or None)


def print_report(tuning):
    """The candidates' table, the selection and its gain, where the budget went, and the selected config."""
    fmt = lambda v, f: format(v, f) if v is not None else "-"
    inc = tuning["incumbent"]["tokens_per_second"]
    print(f"\n{'candidate':<46}{'screen tok/s':>13}{'x inc':>7}{'confirm tok/s':>14}{'gain':>8}{'compile s':>10}"
          f"{'peak GiB':>9}  status")
    for c in tuning["candidates"]:
        gain = c["tokens_per_second"] / inc - 1 if c["tokens_per_second"] and inc else None
        peak = c["peak_memory_bytes"] / 2**30 if c["peak_memory_bytes"] else None
        print(f"{c['change'][:45]:<46}{fmt(rate(c['screen']), ',.0f'):>13}{fmt(c['screen_ratio'], '.3f'):>7}"
              f"{fmt(c['tokens_per_second'], ',.0f'):>14}{fmt(gain, '+.1%'):>8}"
              f"{fmt(c['compile_seconds'], '.1f'):>10}{fmt(peak, '.2f'):>9}  {c['status']}")
    for c in tuning["candidates"]:
        for rung in RUNGS:
            if c[rung] and c[rung].get("status") != "ok":
                print(f"  {c['change']}, {rung}: {str(c[rung].get('error'))[:200]}")
    split = tuning["budget_split"]
    print(f"budget: {split['elapsed_seconds'] / 60:.1f} of {tuning['budget_minutes']:g} min; screens "
          f"{split['screen_seconds'] / 60:.1f}, confirmations {split['confirm_seconds'] / 60:.1f}; compiling "
          f"{split['compile_seconds'] / 60:.1f}, measuring {split['measure_seconds'] / 60:.1f}, starting "
          f"processes and the rest {split['other_seconds'] / 60:.1f}")
    fitted = tuning["confirm_protocol_fitted"]
    if fitted:
        windows = tuning["protocols"]["confirm"]["windows"]
        print(f"confirmations ran {fitted['fitted_warmup']} + {windows} x {fitted['fitted_steps']} updates instead of "
              f"{fitted['warmup']} + {windows} x {fitted['steps']}: the full protocol would not have finished in "
              f"the budget")
    if tuning["budget_exhausted"]:
        print(f"budget exhausted: some runs were not started (their estimates did not fit in what was left); "
              f"screening every candidate and confirming the best would take about "
              f"{math.ceil(tuning['minutes_to_finish']):.0f} min (--budget)")
    sel = tuning["selected"]
    if not sel:
        print("no selection: no candidate finished the full protocol")
        return
    gain = tuning["gain_over_incumbent"]
    versus = f"{100 * gain:+.1f}% over the incumbent" if gain is not None else "the incumbent failed"
    print(f"selected {sel['change']}: {sel['tokens_per_second']:,.0f} tok/s ({versus}) -> "
          f"python train.py {sel['config_path']}")
    beaten = [c for c in tuning["candidates"][1:] if c["tokens_per_second"] and inc and c["tokens_per_second"] > inc]
    if sel["lever"] == "incumbent" and beaten:
        print(f"  kept: {len(beaten)} confirmed candidate(s) measured faster, none by more than tune_noise "
              f"({tuning['noise']:.1%})")
    if sel["config_path"] and Path(sel["config_path"]).is_file():
        print(Path(sel["config_path"]).read_text().rstrip())


# ---------------------------------------------------------------- the sweep

def validity(cfg):
    """valid() for the Sweep: why train.check_execution refuses a candidate (CUDA-graph combinations that cannot
    work among them), or None."""
    def valid(candidate):
        try:
            train.check_execution(train.Config(cfg, **candidate))
        except ConfigError as exc:
            return str(exc)
        return None
    return valid


def plan(cfg, choices, cuda):
    """The incumbent, the space (each candidate checked by train.check_execution), and what was refused."""
    incumbent, valid = {k: cfg[k] for k in LEVER_KEYS}, validity(cfg)
    space, refused = [], []
    for lever, candidate in search_space(incumbent, choices, cuda):
        why = valid(candidate)
        if why:
            print(f"skipping {describe(candidate, incumbent)}: {why}")
            refused.append({"change": describe(candidate, incumbent), "error": why, **candidate})
        else:
            space.append((lever, candidate))
    return incumbent, space, refused


def protocols_of(cfg, cuda):
    """The screen's protocol (tune's keys) and the confirmation's (bench.py's: protocol v2 by default)."""
    screen_steps = cfg.tune_screen_steps or (20 if cuda else 10)
    return {"screen": {"warmup": cfg.tune_screen_warmup, "steps": screen_steps, "windows": 1},
            "confirm": {"warmup": cfg.warmup, "steps": cfg.steps, "windows": cfg.windows}}


def shared_environment(records):
    """The fingerprint's fields that every run of the sweep shares (one machine), and the records with each run
    keeping only its own (the GPU's clocks and power at that moment, say): the tuning record states the machine
    once, not once per run."""
    runs = [rec[rung] for rec in records for rung in RUNGS if rec[rung] and rec[rung].get("environment")]
    if not runs:
        return None, records
    shared = dict(runs[0]["environment"])
    for run in runs[1:]:
        shared = {k: v for k, v in shared.items() if k in run["environment"] and run["environment"][k] == v}

    def own(run):
        if not run or not run.get("environment"):
            return run
        return dict(run, environment={k: v for k, v in run["environment"].items() if k not in shared})
    return shared, [dict(rec, **{rung: own(rec[rung]) for rung in RUNGS}) for rec in records]


def with_environment(run, shared):
    """A run as measured: its own fingerprint fields over the sweep's shared ones."""
    return dict(run, environment={**(shared or {}), **(run.get("environment") or {})})


def summary(record):
    """A candidate's record without its runs, for the tuning record's incumbent and selection (the runs are
    under candidates)."""
    return {k: v for k, v in record.items() if k not in RUNGS}


def tuning_record(cfg, sweep, selected, refused, source):
    """The results file's tuning section: every candidate, the selection and its gain, where the time went."""
    environment, records = shared_environment([trial_record(sweep, t, selected) for t in sweep.trials])
    chosen = summary(records[sweep.trials.index(selected)]) if selected else None
    inc_rate, incumbent = records[0]["tokens_per_second"], sweep.incumbent.candidate
    return {"run_id": env.new_run_id(), "budget_minutes": cfg.budget, "budget_exhausted": sweep.exhausted(),
            "elapsed_minutes": sweep.elapsed() / 60, "source_hash": source, "environment": environment,
            "protocols": sweep.protocols, "confirm_protocol_fitted": sweep.fitted, "incumbent": summary(records[0]),
            "candidates": records, "selected": chosen, "selected_config_path": chosen["config_path"] if chosen else None,
            "gain_over_incumbent": chosen["tokens_per_second"] / inc_rate - 1 if chosen and inc_rate else None,
            "budget_split": sweep.budget_split(), "minutes_to_finish": sweep.seconds_to_finish() / 60,
            "noise": sweep.noise, "screen_noise": sweep.screen_noise,
            "refused": refused + [{"change": describe(c, incumbent), "error": why, **c} for c, why in sweep.refused],
            "base_config": {k: v for k, v in cfg.items() if k in train.DEFAULTS}}


def tune(cfg):
    check_settings(cfg)
    results.check_writable(cfg.results_file)
    bench.check_protocol(cfg)  # or every candidate would fail the same way, and the sweep select nothing
    bench.cache_and_model(cfg)
    train.check_execution(cfg)  # the incumbent
    cuda = train.resolve_device(cfg) == "cuda"
    choices = lever_choices(cfg, cuda)
    incumbent, space, refused = plan(cfg, choices, cuda)
    protocols = protocols_of(cfg, cuda)
    runner = BenchRunner(cfg, dict(machine(), cache_identity=cache_identity(cfg)), previous_measurements(cfg))
    for candidate in [incumbent] + [c for _, c in space]:
        runner.config_path(candidate)  # a tracked file in the way is refused now, not halfway through
    screen, confirm = protocols["screen"], protocols["confirm"]
    print(f"{len(space)} candidates besides the incumbent; screens: {screen['warmup']} + {screen['steps']} "
          f"updates, confirmations: {confirm['warmup']} + {confirm['windows']} x {confirm['steps']}", flush=True)
    sweep = Sweep(incumbent, space, runner, cfg.budget * 60, candidate_timeout=cfg.candidate_timeout * 60,
                  confirm_fraction=cfg.tune_confirm_fraction, screen_noise=cfg.tune_screen_noise,
                  noise=cfg.tune_noise, compile_guess=cfg.tune_compile_guess, valid=validity(cfg),
                  progress=PrintedProgress(cfg), protocols=protocols, fit=cfg.tune_fit_protocol)
    selected = sweep.run()
    tuning = tuning_record(cfg, sweep, selected, refused, runner.source)
    results.record(cfg.results_file, ["tuning"], tuning)
    print_report(tuning)
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
