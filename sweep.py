"""tune.py's strategy (its docstring's five steps) apart from how a run is measured, so that tests drive it in fake
time: which run starts next within the budget, from what it is estimated, and which trial is selected."""
import math
import time

import settings

STAGES = ("screen", "confirm")
PROTOCOL_KEYS = ("warmup", "steps", "windows")
# A Sweep's protocols unless given (tune() gives the config's: a screen's keys, and bench.py's for confirmations).
# The screen's are tune.py's defaults on a GPU, written out: tune.py declares them and imports this module.
PROTOCOLS = {"screen": {"warmup": 3, "steps": 20, "windows": 1},
             "confirm": {k: settings.defaults(settings.Protocol)[k] for k in PROTOCOL_KEYS}}
INCUMBENT_SHARE = 0.5  # of the time left after the incumbent's screen: its measurement's, which sets the protocol


def ladder(full, floor):
    """The confirmation protocols a budget may afford, largest first: the full one with its warmup and steps halved
    together (neither below the floor's nor above the full's), then the floor's own single window (a screen's)."""
    halved = lambda k: {key: min(full[key], max(floor[key], full[key] >> k)) for key in ("warmup", "steps")}
    rungs = [dict(halved(k), windows=full["windows"]) for k in range(max(full["warmup"], full["steps"]).bit_length())]
    rungs.append({key: min(full[key], floor[key]) for key in PROTOCOL_KEYS})
    return [rung for i, rung in enumerate(rungs) if rung not in rungs[:i]]


def updates(protocol):
    return protocol["warmup"] + protocol["windows"] * protocol["steps"]


def said(protocol):
    return f"{protocol['warmup']} + {protocol['windows']} x {protocol['steps']} updates"


def describe(c, incumbent):
    """What a candidate changes in the incumbent (a dict of the same keys), as a person would write it."""
    parts = []
    if c["compile"] != incumbent["compile"]:
        parts.append("compile=True" if c["compile"] else "eager")
    parts += [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()
              if k != "compile" and v != incumbent[k] and (c["compile"] or k != "compile_mode")]
    return ", ".join(parts) or "incumbent (the config's own)"


def rate(result):
    return result["tokens_per_second"] if result and result.get("status") == "ok" else None


class Trial:
    """One candidate: its settings, its lever, and per stage its result, its seconds, or why it did not start."""

    def __init__(self, candidate, lever):
        self.candidate, self.lever = candidate, lever
        self.results, self.seconds, self.not_started, self.protocols = {}, {}, {}, {}

    screen = property(lambda self: self.results.get("screen"))
    confirm = property(lambda self: self.results.get("confirm"))


class Sweep:
    """The strategy of tune.py's docstring, apart from how a run is measured, so tests drive it in fake time.

    measure(candidate, stage, protocol, timeout_seconds) -> a bench entry: status, tokens_per_second,
    first_update_seconds, and optionally warmup_seconds, measurements (each window's seconds and updates),
    peak_memory_bytes, wall_seconds (a reused measurement's own), error. say(text) prints progress."""

    def __init__(self, incumbent, space, measure, budget_seconds, protocols=PROTOCOLS, clock=time.monotonic,
                 candidate_timeout=math.inf, confirm=4, screen_noise=0.03, noise=0.01, say=lambda text: None,
                 started=None):
        self.incumbent = Trial(incumbent, "incumbent")
        self.trials = [self.incumbent] + [Trial(c, lever) for lever, c in space]
        self.measure, self.budget_seconds, self.clock, self.say = measure, budget_seconds, clock, say
        self.protocols = {stage: dict(p) for stage, p in protocols.items()}
        self.full, self.chosen = dict(self.protocols["confirm"]), False  # the confirmations' until chosen
        self.finished = False  # run() came to its selection (an interrupted sweep judged no screen)
        self.candidate_timeout, self.confirm = candidate_timeout, confirm
        # started: when the budget began by clock (tune.py's checks and plan come out of it too), else now
        self.screen_noise, self.noise, self.start_time = screen_noise, noise, clock() if started is None else started

    def elapsed(self):
        return self.clock() - self.start_time

    def left(self):
        return self.budget_seconds - self.elapsed()

    def left_as_measured(self):
        """The time left had the measurements reused cost their own wall time again: what sets the protocol, so that
        a rerun with the budget of the sweep it repeats asks for the protocol that sweep measured (and reuses it)."""
        return self.left() - sum(res.get("wall_seconds") or 0.0 for t in self.trials for res in t.results.values()
                                 if res.get("reused"))

    def run(self):
        """The selected trial, or None."""
        for trial in self.trials:  # the incumbent's screen first: no estimate yet, it may take the whole budget
            self.attempt(trial, "screen")
            if not self.chosen and rate(trial.screen):  # a candidate's only where the incumbent's screen failed
                self.choose_protocol(trial)
                if trial is self.incumbent:
                    self.attempt(trial, "confirm")
        for trial in self.best_screened():
            self.attempt(trial, "confirm")
        self.finished = True
        return self.selection()

    def choose_protocol(self, trial):
        """Every confirmation's protocol: the ladder's largest whose estimate for trial (the incumbent) fits in
        INCUMBENT_SHARE of the time left, else its smallest (which runs only where it fits what is left)."""
        rungs, room = ladder(self.full, self.protocols["screen"]), INCUMBENT_SHARE * self.left_as_measured()
        fits = [p for p in rungs if self.estimate(trial, "confirm", p) <= room]
        self.protocols["confirm"], self.chosen = dict(fits[0] if fits else rungs[-1]), True
        why = "the full protocol" if fits and fits[0] == self.full else \
            f"{said(self.full)} would not fit in {INCUMBENT_SHARE:.0%} of the {self.left_as_measured():.0f} s left"
        self.say(f"confirmations: {said(self.protocols['confirm'])} ({why})")

    def attempt(self, trial, stage):
        """Run trial's stage if its estimate fits in the time left (less, for a screen, the time held back for
        confirmations), ended by candidate_timeout or by that time's end; else record and say why not."""
        room = self.left() - (self.held_back() if stage == "screen" else 0.0)
        estimate = self.estimate(trial, stage)
        if room <= 0 or (estimate or 0.0) > room:
            held = f", {self.held_back():.0f} s of them held for confirmations" if stage == "screen" else ""
            why = f"budget: estimated at {estimate or 0:.0f} s; {max(self.left(), 0):.0f} s left{held}"
            trial.not_started[stage] = why
            return self.say(f"{self.head(stage)}  {self.label(trial)}: {stage} not started ({why})")
        timeout = min(self.candidate_timeout, room)
        self.say(f"  running {self.label(trial)}: {stage} (at most {timeout / 60:.1f} min)...")
        start = self.clock()
        trial.protocols[stage] = dict(self.protocols[stage])
        res = trial.results[stage] = self.measure(trial.candidate, stage, dict(self.protocols[stage]), timeout)
        trial.seconds[stage] = self.clock() - start
        outcome = f"{rate(res):,.0f} tok/s" if rate(res) else f"error: {str(res.get('error'))[:100]}"
        self.say(f"{self.head(stage)}  {self.label(trial)}: {outcome}{' (measured before)' * bool(res.get('reused'))}")

    def estimate(self, trial, stage, protocol=None):
        """Seconds a run of stage (with protocol, else the stage's) should take, from the nearest run measured
        (trial's own, its screen, else the incumbent's): its wall time, plus or minus the updates the protocols
        differ by at its pace (the process start and the compile are the same). None before any run."""
        inc, protocol = self.incumbent, protocol or self.protocols[stage]
        for t, s in ((trial, stage), (trial, "screen"), (inc, stage), (inc, "confirm"), (inc, "screen")):
            res = t.results.get(s)
            if res:
                windows = res.get("measurements") or []
                timed = sum(m.get("updates") or 0 for m in windows)
                pace = sum(m["seconds"] for m in windows) / timed if timed else 0.0
                wall = res.get("wall_seconds", t.seconds.get(s, 0.0))
                return max(0.0, wall + (updates(protocol) - updates(t.protocols.get(s, self.protocols[s]))) * pace)
        return None

    def held_back(self):
        """Seconds the screens leave: the confirmations they have earned and one more (a winner found late), at
        most tune_confirm, each as long as the longest expected of the incumbent's and theirs."""
        best = self.best_screened()
        longest = max(self.estimate(t, "confirm") or 0.0 for t in [self.incumbent, *best])
        return min(self.confirm, len(best) + 1) * longest

    def screen_ratio(self, trial):
        inc, own = rate(self.incumbent.screen), rate(trial.screen)
        return own / inc if inc and own else None

    def best_screened(self):
        """The candidates that go on to the full protocol: the best tune_confirm screens, best first, none below
        the incumbent's screen by more than tune_screen_noise (all may go when the incumbent's failed)."""
        close = [t for t in self.trials[1:] if rate(t.screen) and (self.screen_ratio(t) or 1) + self.screen_noise >= 1]
        return sorted(close, key=lambda t: -rate(t.screen))[:self.confirm]

    def measured_by(self, trial):
        """The stage whose rate stands for trial, as the incumbent is measured: the incumbent's confirmation, else its
        screen; a confirmed candidate's confirmation, or its screen where the incumbent stands by its screen (its
        confirmation failed or did not fit), so the two compare under one protocol; None for the others."""
        if trial is self.incumbent:
            return "confirm" if rate(trial.confirm) else "screen" if rate(trial.screen) else None
        if not rate(trial.confirm):  # only a confirmation selects
            return None
        return "screen" if self.measured_by(self.incumbent) == "screen" and rate(trial.screen) else "confirm"

    def selection(self):
        """The fastest candidate measured as the incumbent (measured_by: the same stage and protocol), if faster than
        it by more than noise (tune_screen_noise between screens), else the incumbent; where the incumbent could not
        be measured, the fastest confirmed."""
        inc, stage = self.incumbent, self.measured_by(self.incumbent)
        alike = [t for t in self.trials[1:] if self.measured_by(t)
                 and (stage is None or t.protocols[self.measured_by(t)] == inc.protocols[stage])]
        measured = lambda t: rate(t.results[self.measured_by(t)])
        best = max(alike, key=measured, default=None)
        noise = self.screen_noise if stage == "screen" else self.noise
        if stage and not (best and measured(best) > rate(inc.results[stage]) * (1 + noise)):
            return inc
        return best

    def seconds_to_finish(self):
        """About how long the whole sweep would take with the full protocol (the budget to ask for): a screen of
        every trial, and the incumbent's and tune_confirm confirmations like it."""
        screens = sum(t.seconds.get("screen") or self.estimate(t, "screen") or 0.0 for t in self.trials)
        confirm = self.estimate(self.incumbent, "confirm", self.full) or 0.0
        return screens + (1 + min(self.confirm, len(self.trials) - 1)) * confirm

    def budget_split(self):
        """Where the time went: compiling (first updates), measuring (the other updates), and the rest
        (starting processes, building models, writing results); measurements reused cost nothing."""
        runs = [res for t in self.trials for res in t.results.values() if not res.get("reused")]
        compile_s = sum(res.get("first_update_seconds") or 0.0 for res in runs)
        measure_s = sum(max(0.0, (res.get("warmup_seconds") or 0.0) - (res.get("first_update_seconds") or 0.0))
                        + sum(m.get("seconds", 0.0) for m in res.get("measurements") or []) for res in runs)
        elapsed = self.elapsed()
        return {"elapsed_seconds": elapsed, "compile_seconds": compile_s, "measure_seconds": measure_s,
                "other_seconds": max(0.0, elapsed - compile_s - measure_s),
                **{f"{s}_seconds": sum(t.seconds.get(s, 0.0) for t in self.trials) for s in STAGES}}

    def status(self, trial, selected):
        """One word or phrase for the report."""
        if trial is selected:
            return "selected"
        for stage, res in [(s, trial.results.get(s)) for s in ("confirm", "screen")]:
            if res and not rate(res):
                return f"{stage}: " + ("out of memory" if "out of memory" in str(res.get("error")).lower() else "error")
        if trial.confirm:
            return "confirmed"
        if trial.not_started:
            return "not started (budget)" if "screen" in trial.not_started else "not confirmed (budget)"
        if trial.screen:  # an interrupted sweep compared no screens
            return "screened out" if self.finished else "screened (the sweep stopped)"
        return "-"

    # -- what a person reads while it runs (a run's output is kept for its error, so say what runs)

    def label(self, trial):
        return describe(trial.candidate, self.incumbent.candidate)

    def head(self, stage):
        done = sum(1 for t in self.trials if stage in t.results or stage in t.not_started)
        total = len(self.trials) if stage == "screen" else len(self.best_screened()) + 1
        return f"[{stage} {done}/{total}] {self.elapsed() / 60:.1f}/{self.budget_seconds / 60:g} min"
