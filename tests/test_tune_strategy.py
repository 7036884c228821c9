"""tune.py's strategy without processes: the candidates (tune.py), and the Sweep (sweep.py) driven by a fake clock
and a fake measurement, so each rule of its docstring (the incumbent first, with the protocol the budget affords,
screen every candidate, confirm the best few, stop when the budget runs out, select only what was confirmed, compared
with the incumbent under its measurement's protocol, and the incumbent at least) is checked by what it decides."""
import random

import pytest
import torch

import model_kernels.attention
import settings
import sweep as sweep_lib
import train
import tune


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# The 20m_gh200 config's execution settings, and an eager one as tiny_cpu's.
GPU = {"attention_backend": "auto", "loss_impl": "fused", "compile": True, "compile_mode": "reduce-overhead",
       "compile_scope": "model", "activation_memory_budget": 1.0, "micro_batch_size": 32, "cpu_threads": 0}
CPU = dict(GPU, loss_impl="full", compile=False, compile_mode="default", micro_batch_size=16)
CHOICES = {"attention_backend": ["auto", "sdpa", "cudnn", "math", "fa4"],
           "loss_impl": ["full", "fused", "quack_chunked"],
           "compile_mode": ["eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
           "compile_scope": ["model", "blocks"], "activation_memory_budget": [0.8], "micro_batch_size": [16, 64],
           "cpu_threads": []}


def changed(candidate, incumbent):
    return {k for k in tune.LEVER_KEYS if candidate[k] != incumbent[k]}


class FakeBench:
    """Runs a candidate in fake time: outside_s to start, its compile, then each update at per_update_s x 1000 /
    its speed (ended at the timeout, as the real one is); the speed is set per changed setting and per stage."""

    def __init__(self, clock, incumbent, gains=None, screen_gains=None, compile_s=None, per_update_s=0.2,
                 outside_s=3.0, fail=None):
        self.clock, self.incumbent, self.gains = clock, incumbent, gains or {}
        self.screen_gains = screen_gains if screen_gains is not None else self.gains
        self.compile_s = compile_s or (lambda c: 20.0 if c["compile"] else 0.5)
        self.per_update_s, self.outside_s = per_update_s, outside_s
        self.fail = fail or (lambda c, stage: None)
        self.runs, self.timeouts, self.protocols = [], [], []

    def speed(self, candidate, stage):
        gains = self.screen_gains if stage == "screen" else self.gains
        speed = 1000.0
        for key in changed(candidate, self.incumbent):
            speed *= gains.get((key, candidate[key]), 1.0)
        return speed

    def __call__(self, candidate, stage, protocol, timeout):
        self.runs.append((stage, candidate))
        self.timeouts.append(timeout)
        self.protocols.append(protocol)
        first, speed = self.compile_s(candidate), self.speed(candidate, stage)
        per_update = self.per_update_s * 1000.0 / speed
        warmup = first + (protocol["warmup"] - 1) * per_update
        window = protocol["steps"] * per_update
        seconds = self.outside_s + warmup + protocol["windows"] * window
        if seconds > timeout:
            self.clock.now += timeout
            return {"status": "error", "error": f"timed out after {timeout / 60:.1f} minutes"}
        self.clock.now += seconds
        error = self.fail(candidate, stage)
        if error:
            return {"status": "error", "error": error, "first_update_seconds": first}
        return {"status": "ok", "tokens_per_second": speed, "first_update_seconds": first, "warmup_seconds": warmup,
                "measurements": [{"seconds": window, "updates": protocol["steps"]}] * protocol["windows"]}


def sweep_of(bench, budget, incumbent=GPU, space=None, **kw):
    space = tune.search_space(incumbent, CHOICES) if space is None else space
    return sweep_lib.Sweep(incumbent, space, bench, budget, clock=bench.clock, **kw)


def trial_of(sweep, **change):
    return next(t for t in sweep.trials if t.candidate == dict(sweep.incumbent.candidate, **change))


# With FakeBench's defaults, a GPU run outside its updates takes 3 s plus a 20 s compile, then 0.2 s an update:
SCREEN_S = 3 + 20 + (3 - 1 + 20) * 0.2        # 27.4 s: 3 warmup updates and one window of 20
CONFIRM_S = 3 + 20 + (20 - 1 + 3 * 100) * 0.2  # 86.8 s: protocol v2, 20 warmup updates and 3 windows of 100


# ---------------------------------------------------------------- the candidates

def test_the_levers_are_execution_keys_only():
    """A candidate may change how the math runs, never what it is (settings.py declares which keys those are)."""
    assert set(tune.LEVER_KEYS) <= settings.execution_keys()
    assert set(tune.LEVER_KEYS) == {"compile", "attention_backend", "loss_impl", "compile_mode", "compile_scope",
                                    "activation_memory_budget", "micro_batch_size", "cpu_threads"}
    recipe = settings.keys_of_role(settings.RECIPE) | settings.keys_of_role(settings.MODEL)
    assert not set(tune.LEVER_KEYS) & recipe  # none of them changes the math


def test_space_changes_one_lever_at_a_time_in_the_documented_order():
    space = tune.search_space(GPU, CHOICES)
    candidates = [c for _, c in space]
    assert GPU not in candidates and len(candidates) == len({tune.candidate_name(c) for c in candidates})
    assert len(candidates) >= 12
    for lever, c in space:
        assert changed(c, GPU) <= {lever, "compile"}  # one lever (a mode change may switch compile itself)
    assert candidates[0] == dict(GPU, attention_backend="fa4")  # the largest measured gain is screened first
    levers = [lever for lever, _ in space]
    for earlier, later in [("loss_impl", "compile_mode"), ("compile_mode", "compile_scope"),
                           ("compile_scope", "activation_memory_budget"),
                           ("activation_memory_budget", "micro_batch_size")]:
        assert levers.index(earlier) < levers.index(later)
    # SDPA's other kernels after the micro-batch neighbours, and the autotuning modes (minutes of compile) last
    assert levers.index("micro_batch_size") < levers.index("attention_backend", 1)
    assert [tune.mode_of(c) for c in candidates[-2:]] == ["max-autotune", "max-autotune-no-cudagraphs"]
    assert {c["loss_impl"] for c in candidates} == {"full", "fused", "quack_chunked"}
    assert dict(GPU, compile_scope="blocks") in candidates and dict(GPU, activation_memory_budget=0.8) in candidates


def test_an_eager_incumbent_has_its_scope_and_activation_memory_tried_compiled():
    space = [c for _, c in tune.search_space(CPU, dict(CHOICES, compile_mode=["eager", "default"]))]
    compiled = dict(CPU, compile=True)
    assert compiled in space and dict(compiled, compile_scope="blocks") in space
    assert dict(compiled, activation_memory_budget=0.8) in space
    # never on an eager run, where they would change nothing
    assert all(c["compile"] for c in space if c["compile_scope"] != "model" or c["activation_memory_budget"] != 1)


def tune_cfg(**overrides):
    return settings.Config(dict(tune.DEFAULTS, **overrides))


def test_the_levers_values_come_from_their_declarations():
    choices = tune.lever_choices(tune_cfg(device="cpu", micro_batch_size=8), cuda=False)
    declared = lambda key: list(settings.field_of(settings.TrainSettings, key).metadata["choices"])
    assert choices["attention_backend"] == declared("attention_backend")  # plan() says which cannot run here
    assert choices["loss_impl"] == declared("loss_impl") and choices["compile_scope"] == declared("compile_scope")
    assert choices["compile_mode"] == ["eager", *settings.COMPILE_MODES]
    assert choices["micro_batch_size"] == [4, 16]  # the config's neighbours
    assert choices["activation_memory_budget"] == [0.8] and choices["cpu_threads"] == []


def test_what_cannot_run_here_is_skipped_with_one_line_each(capsys):
    cfg = tune_cfg(device="cpu", tokens_per_update=8 * 1024, micro_batch_size=8)
    choices = dict(CHOICES, attention_backend=["auto", "sdpa", "cudnn", "math", "fa4"],
                   compile_mode=["eager", "default", "reduce-overhead"], micro_batch_size=[3, 4], loss_impl=[])
    incumbent, space, refused = tune.plan(cfg, choices, torch.device("cpu"))
    out = capsys.readouterr().out.splitlines()
    why = {r["change"]: r["error"] for r in refused}
    # SDPA's CUDA kernels and fa4 need a GPU, as CUDA graphs do; 3 does not divide the 8 sequences of an update;
    # and auto runs SDPA here, so sdpa would measure the incumbent again
    assert set(why) == {"attention_backend=cudnn", "attention_backend=fa4",
                        "compile=True, compile_mode=reduce-overhead", "micro_batch_size=3", "attention_backend=sdpa"}
    assert why["compile=True, compile_mode=reduce-overhead"] == "CUDA graphs need a GPU"
    assert why["attention_backend=sdpa"] == "what the incumbent's 'auto' runs here"
    assert all(sum(line.startswith(f"skipping {change}: ") for line in out) == 1 for change in why)
    assert [c for _, c in space if c["attention_backend"] != "auto"] == [
        dict(incumbent, attention_backend="math")]
    assert dict(incumbent, micro_batch_size=4) in [c for _, c in space]


def test_two_candidates_that_run_one_backend_are_not_both_screened(capsys):
    """With the incumbent on math on the CPU, auto and sdpa both run SDPA: both were screened, a duplicate screen
    that could take two of the confirmations."""
    cfg = tune_cfg(device="cpu", tokens_per_update=8 * 1024, micro_batch_size=8, attention_backend="math")
    choices = dict(CHOICES, attention_backend=["auto", "sdpa", "cudnn", "math", "fa4"], compile_mode=["eager"],
                   micro_batch_size=[], loss_impl=[], compile_scope=[], activation_memory_budget=[])
    incumbent, space, refused = tune.plan(cfg, choices, torch.device("cpu"))
    assert [c["attention_backend"] for _, c in space] == ["auto"]
    assert {"change": "attention_backend=sdpa", "error": "what attention_backend=auto runs here"}.items() <= \
        next(r for r in refused if r["change"] == "attention_backend=sdpa").items()


@pytest.mark.parametrize("fa4_runs, incumbent, left_out", [(True, "auto", "fa4"), (False, "auto", "sdpa"),
                                                             (True, "fa4", "auto"), (False, "sdpa", "auto")])
def test_the_backend_the_incumbent_runs_is_not_screened_again(monkeypatch, capsys, flash_attn_4_stand_in, fa4_runs,
                                                              incumbent, left_out):
    """auto is fa4 where flash-attn-4 can run, else SDPA: the one of them that auto is here, or auto beside it,
    would measure the incumbent under another name."""
    monkeypatch.setattr(model_kernels.attention, "fa4_problem", lambda device: None if fa4_runs else "no flash-attn-4")
    backends = lambda cfg: [lever_and_c[1]["attention_backend"] for lever_and_c in tune.plan(
        cfg, tune.lever_choices(cfg, cuda=True), torch.device("cuda"))[1] if lever_and_c[0] == "attention_backend"]
    screened = backends(tune_cfg(attention_backend=incumbent))
    assert left_out not in screened and "cudnn" in screened
    skipped = f"skipping attention_backend={left_out}: what the incumbent's '{incumbent}' runs here"
    assert skipped in capsys.readouterr().out
    named = backends(tune_cfg(attention_backend=incumbent, tune_backends=f"{left_out},cudnn"))
    assert named == [left_out, "cudnn"]  # named ones are tried as asked


def test_fa4_is_a_lever_where_it_can_run_and_named_where_it_cannot_is_refused(monkeypatch):
    monkeypatch.setattr(model_kernels.attention, "fa4_problem",
                        lambda device: None if device.type == "cuda" else "no GPU")
    # a config that pins SDPA (with auto, fa4 is the incumbent's own attention where it runs)
    assert "fa4" in tune.lever_choices(tune_cfg(attention_backend="sdpa"), cuda=True)["attention_backend"]
    with pytest.raises(tune.ConfigError, match="tune_backends names fa4, but no GPU"):
        tune.lever_choices(tune_cfg(tune_backends="auto,fa4"), cuda=False)


def test_compiled_levers_named_with_no_mode_to_compile_in_are_refused():
    """An eager config, tune_compile_modes=eager and scopes named: the scopes were dropped without a word (they are
    tried under a compiled mode of the list, and there was none)."""
    with pytest.raises(tune.ConfigError, match="tune_compile_scopes act on a compiled model, and the config is eager"):
        tune.lever_choices(tune_cfg(compile=False, tune_compile_modes="eager", tune_compile_scopes="model"), cuda=True)
    choices = tune.lever_choices(tune_cfg(compile=False, tune_compile_modes="eager,default",
                                          tune_compile_scopes="model"), cuda=True)
    assert {"compile": True, "compile_mode": "default", "compile_scope": "model"}.items() <= dict(
        next(c for lever, c in tune.search_space(dict(compile=False, compile_mode="default", compile_scope="blocks"),
                                                 choices) if lever == "compile_scope")).items()


# ---------------------------------------------------------------- the sweep

def test_the_incumbent_is_screened_then_measured_with_the_full_protocol_a_large_budget_affords_then_the_rest():
    bench = FakeBench(FakeClock(), GPU)
    sweep = sweep_of(bench, budget=36000)
    sweep.run()
    assert bench.runs[:3] == [("screen", GPU), ("confirm", GPU), ("screen", dict(GPU, attention_backend="fa4"))]
    assert bench.protocols[:2] == [sweep_lib.PROTOCOLS["screen"], sweep_lib.PROTOCOLS["confirm"]]
    stages, n = [stage for stage, _ in bench.runs], len(sweep.trials)
    assert stages[2:n + 1] == ["screen"] * (n - 1) and set(stages[n + 1:]) == {"confirm"}  # every screen, then confirms
    confirms = [p for (stage, _), p in zip(bench.runs, bench.protocols) if stage == "confirm"]
    assert all(p == sweep_lib.PROTOCOLS["confirm"] for p in confirms)


def test_the_protocols_a_budget_may_afford_halve_the_full_one_down_to_a_screens():
    shape = lambda rungs: [(p["warmup"], p["windows"], p["steps"]) for p in rungs]
    cpu_screen = {"warmup": 3, "steps": 10, "windows": 1}
    assert shape(sweep_lib.ladder(sweep_lib.PROTOCOLS["confirm"], cpu_screen)) == [
        (20, 3, 100), (10, 3, 50), (5, 3, 25), (3, 3, 12), (3, 3, 10), (3, 1, 10)]
    # never above the full protocol, and a full protocol no larger than a screen is its only rung
    tiny = {"warmup": 1, "steps": 2, "windows": 1}
    assert shape(sweep_lib.ladder(dict(tiny, windows=3), cpu_screen)) == [(1, 3, 2), (1, 1, 2)]
    assert sweep_lib.ladder(tiny, tiny) == [tiny]


def test_a_budget_that_fits_only_the_incumbent_selects_it_measured_with_the_protocol_that_fits():
    bench = FakeBench(FakeClock(), GPU, gains={("attention_backend", "fa4"): 1.05})
    # its screen takes 27.4 s; in half the 102.6 s left, protocol v2 (86.8 s) and its first half (54.8 s) do not
    # fit, the next, 5 + 3 x 25 updates (38.8 s), does; after it no screen leaves room for another confirmation
    sweep = sweep_of(bench, budget=130)
    assert sweep.run() is sweep.incumbent
    assert bench.runs == [("screen", GPU), ("confirm", GPU)] and sweep.elapsed() <= 130
    assert bench.protocols[1] == sweep.protocols["confirm"] == {"warmup": 5, "steps": 25, "windows": 3}
    assert sweep.measured_by(sweep.incumbent) == "confirm" and sweep.full == sweep_lib.PROTOCOLS["confirm"]
    assert all(set(t.not_started) == {"screen"} for t in sweep.trials[1:])
    assert "held for confirmations" in sweep.trials[1].not_started["screen"]
    assert sweep.status(sweep.trials[1], sweep.incumbent) == "not started (budget)"


@pytest.mark.parametrize("budget, measured_by", [(60, "confirm"), (40, "screen")])
def test_a_budget_that_fits_a_screen_answers_with_the_incumbent(budget, measured_by):
    """No rung fits in half what its 27.4 s screen leaves: the smallest (a screen's protocol) runs where it fits
    what is left (60 s), and where it does not (40 s) the incumbent's screen is its measurement."""
    bench = FakeBench(FakeClock(), GPU, gains={("attention_backend", "fa4"): 1.05})
    sweep = sweep_of(bench, budget=budget)
    assert sweep.run() is sweep.incumbent and sweep.measured_by(sweep.incumbent) == measured_by
    assert sweep.protocols["confirm"] == sweep_lib.PROTOCOLS["screen"] and sweep.elapsed() <= budget
    assert [stage for stage, _ in bench.runs] == ["screen", "confirm"][:1 + (measured_by == "confirm")]


def test_a_budget_that_cannot_finish_one_run_selects_nothing_and_ends_on_time():
    bench = FakeBench(FakeClock(), GPU)
    sweep = sweep_of(bench, budget=20)
    assert sweep.run() is None
    assert bench.timeouts == [20] and sweep.elapsed() <= 20  # the incumbent's screen, ended at the budget's end


@pytest.mark.parametrize("screen_gain, selected", [(1.2, True), (1.02, False)])
def test_where_the_incumbents_confirmation_fails_confirmed_candidates_are_compared_by_their_screens(screen_gain,
                                                                                                   selected):
    # the incumbent stands by its screen: fa4 (confirmed) is set against it by its own screen, the same protocol, and
    # selected only beyond tune_screen_noise (3%); its confirmation (1.2x) is not set against a screen
    fail = lambda c, stage: "RuntimeError: boom" if c == GPU and stage == "confirm" else None
    bench = FakeBench(FakeClock(), GPU, gains={("attention_backend", "fa4"): 1.2},
                      screen_gains={("attention_backend", "fa4"): screen_gain}, fail=fail)
    sweep = sweep_of(bench, budget=36000)
    fa4 = trial_of(sweep, attention_backend="fa4")
    assert sweep.run() is (fa4 if selected else sweep.incumbent)
    assert sweep.measured_by(sweep.incumbent) == "screen" and sweep.measured_by(fa4) == "screen"
    assert sweep_lib.rate(fa4.confirm) == pytest.approx(1200.0)


def test_screens_leave_time_to_confirm_the_best_they_found():
    """The budget split: a screen starts only where the confirmations the screens have earned (and one more, up to
    tune_confirm) still fit after it, so every candidate that goes on to the full protocol is confirmed."""
    gains = {("attention_backend", "fa4"): 1.05, ("loss_impl", "full"): 1.04, ("compile_mode", "default"): 1.02}
    bench = FakeBench(FakeClock(), GPU, gains=gains)
    sweep = sweep_of(bench, budget=600, confirm=2)
    selected = sweep.run()
    screened = [t for t in sweep.trials[1:] if t.screen]
    assert 3 <= len(screened) < len(sweep.trials) - 1  # the budget stopped the screens, not the list's end
    best = sweep.best_screened()
    assert [t.candidate for t in best] == [dict(GPU, attention_backend="fa4"), dict(GPU, loss_impl="full")]
    assert all(sweep_lib.rate(t.confirm) for t in best) and sweep.elapsed() <= 600
    assert selected is best[0] and sweep.status(best[1], selected) == "confirmed"
    assert all("held for confirmations" in t.not_started["screen"] for t in sweep.trials if not t.screen)


def test_an_interrupted_sweep_says_its_screens_were_not_compared():
    """The report of a sweep stopped after the candidates' screens called each "screened out", though no screen had
    been compared with another."""
    bench = FakeBench(FakeClock(), GPU)
    confirmations = []

    def stopped_at_a_candidates_confirmation(candidate, stage, protocol, timeout):
        confirmations.extend([candidate] if stage == "confirm" else [])
        if len(confirmations) == 2:  # the incumbent's, then the first candidate's
            raise KeyboardInterrupt
        return bench(candidate, stage, protocol, timeout)
    sweep = sweep_lib.Sweep(GPU, tune.search_space(GPU, CHOICES), stopped_at_a_candidates_confirmation, 36000,
                            clock=bench.clock)
    with pytest.raises(KeyboardInterrupt):
        sweep.run()
    screened = [t for t in sweep.trials[1:] if t.screen]
    assert screened and {sweep.status(t, None) for t in screened} == {"screened (the sweep stopped)"}
    finished = sweep_of(bench, budget=36000)
    assert finished.run() is not None and "screened out" in {finished.status(t, None) for t in finished.trials}


def test_at_most_tune_confirm_screens_are_confirmed_best_first():
    screens = {("micro_batch_size", 16): 1.01, ("compile_scope", "blocks"): 1.02, ("loss_impl", "full"): 0.99}
    bench = FakeBench(FakeClock(), GPU, gains={}, screen_gains=screens)
    sweep = sweep_of(bench, budget=36000, confirm=3)
    sweep.run()
    confirmed = [c for stage, c in bench.runs if stage == "confirm"][1:]
    assert confirmed[:2] == [dict(GPU, compile_scope="blocks"), dict(GPU, micro_batch_size=16)]
    assert len(confirmed) == 3 and bench.speed(confirmed[2], "screen") == 1000.0  # a tie with the incumbent's
    assert {sweep.status(t, None) for t in sweep.trials[1:]} == {"screened out", "confirmed"}


def test_a_screen_slower_than_the_incumbents_beyond_screen_noise_is_never_confirmed_nor_selected():
    # fa4 and the quack loss would win the full protocol, but screen slower than the incumbent beyond the noise
    gains = {("attention_backend", "fa4"): 1.5, ("loss_impl", "quack_chunked"): 1.4,
             ("compile_scope", "blocks"): 1.05}
    screens = {("attention_backend", "fa4"): 0.9, ("loss_impl", "quack_chunked"): 0.96,
               ("compile_scope", "blocks"): 1.05}
    bench = FakeBench(FakeClock(), GPU, gains=gains, screen_gains=screens)
    sweep = sweep_of(bench, budget=36000, screen_noise=0.03)
    selected = sweep.run()
    confirmed = [c for stage, c in bench.runs if stage == "confirm"]
    assert dict(GPU, attention_backend="fa4") not in confirmed
    assert dict(GPU, loss_impl="quack_chunked") not in confirmed
    assert selected.candidate == dict(GPU, compile_scope="blocks")
    assert sweep.status(trial_of(sweep, attention_backend="fa4"), selected) == "screened out"


def test_a_gain_within_noise_keeps_the_incumbent_and_one_beyond_it_is_selected():
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.008})
    sweep = sweep_of(bench, budget=36000, noise=0.01)
    assert sweep.run() is sweep.incumbent
    assert sweep_lib.rate(trial_of(sweep, compile_scope="blocks").confirm) > sweep_lib.rate(sweep.incumbent.confirm)
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.02})
    sweep = sweep_of(bench, budget=36000, noise=0.01)
    assert sweep.run() is trial_of(sweep, compile_scope="blocks")


def test_a_candidate_confirmed_under_another_protocol_is_not_compared_with_the_incumbent():
    """Only a candidate measured as the incumbent was (the same stage and protocol) is set against it: blocks,
    confirmed 1.5x under a smaller rung, is passed over for loss_impl=full, 1.05x under the incumbent's."""
    gains = {("compile_scope", "blocks"): 1.5, ("loss_impl", "full"): 1.05}
    bench = FakeBench(FakeClock(), GPU, gains=gains)
    space = [("compile_scope", dict(GPU, compile_scope="blocks")), ("loss_impl", dict(GPU, loss_impl="full"))]
    sweep = sweep_of(bench, budget=36000, space=space)
    inc, blocks, full = sweep.trials
    sweep.attempt(inc, "screen")
    sweep.choose_protocol(inc)
    sweep.attempt(inc, "confirm")
    chosen = dict(sweep.protocols["confirm"])
    smaller = sweep_lib.ladder(sweep.full, sweep.protocols["screen"])[-1]
    assert smaller != chosen
    for trial, protocol in ((blocks, smaller), (full, chosen)):
        sweep.attempt(trial, "screen")
        sweep.protocols["confirm"] = dict(protocol)
        sweep.attempt(trial, "confirm")
    assert blocks.protocols["confirm"] == smaller and full.protocols["confirm"] == inc.protocols["confirm"] == chosen
    rate = lambda t: sweep_lib.rate(t.confirm)
    assert rate(blocks) > rate(full) > rate(inc) * (1 + sweep.noise)
    assert sweep.selection() is full
    # and with the faster one alone under another protocol, the incumbent stands
    full.results.pop("confirm")
    assert sweep.selection() is inc


def test_a_confirmation_that_does_not_fit_is_not_started_and_a_cheaper_one_after_it_is():
    compile_s = lambda c: 200.0 if c["compile_scope"] == "blocks" else (20.0 if c["compile"] else 0.5)
    gains = {("compile_scope", "blocks"): 1.05, ("loss_impl", "full"): 1.02}
    bench = FakeBench(FakeClock(), GPU, gains=gains, compile_s=compile_s)
    space = [("loss_impl", dict(GPU, loss_impl="full")), ("compile_scope", dict(GPU, compile_scope="blocks"))]
    # blocks' screen is estimated from the incumbent's (27.4 s) but takes 207 s with its compile, after which its
    # own confirmation (264 s) no longer fits in the 211 s left, where loss_impl=full's (85 s) does
    sweep = sweep_of(bench, budget=560, space=space)
    selected = sweep.run()
    full, blocks = sweep.trials[1:]
    assert blocks.screen["status"] == "ok" and "confirm" in blocks.not_started
    assert sweep.estimate(blocks, "confirm") == pytest.approx(3 + 200 + 319 * 0.2 / 1.05)  # exact: one pace
    assert sweep.status(blocks, selected) == "not confirmed (budget)"
    assert selected is full and sweep.elapsed() <= sweep.budget_seconds


def test_estimates_come_from_the_nearest_run_measured():
    bench = FakeBench(FakeClock(), GPU, compile_s=lambda c: 50.0 if c["attention_backend"] == "fa4" else 20.0)
    sweep = sweep_of(bench, budget=1e9, space=[("attention_backend", dict(GPU, attention_backend="fa4"))])
    fa4 = sweep.trials[1]
    assert sweep.estimate(sweep.incumbent, "confirm") is None  # the first run has nothing to go by
    sweep.attempt(sweep.incumbent, "confirm")
    assert sweep.estimate(sweep.incumbent, "screen") == pytest.approx(SCREEN_S)  # its confirmation, less updates
    assert sweep.estimate(fa4, "screen") == pytest.approx(SCREEN_S)  # the incumbent's: nothing of its own yet
    sweep.attempt(fa4, "screen")
    assert sweep.estimate(fa4, "confirm") == pytest.approx(CONFIRM_S + 30)  # its own screen, with its compile


def test_every_run_is_ended_by_candidate_timeout_and_by_the_budget():
    bench = FakeBench(FakeClock(), GPU, compile_s=lambda c: 900.0 if c["compile_mode"] == "max-autotune" else 20.0)
    sweep = sweep_of(bench, budget=1500, candidate_timeout=300.0)
    sweep.run()
    autotune = trial_of(sweep, compile_mode="max-autotune")
    assert autotune.screen["error"] == "timed out after 5.0 minutes" and sweep.elapsed() <= 1500
    assert all(t <= 300.0 for t in bench.timeouts)
    assert sweep.status(autotune, None) == "screen: error"


def test_a_failed_run_ends_only_that_candidate():
    oom = lambda c, stage: "torch.OutOfMemoryError: CUDA out of memory." if c["micro_batch_size"] == 64 else None
    bench = FakeBench(FakeClock(), GPU, gains={("micro_batch_size", 64): 2.0, ("loss_impl", "quack_chunked"): 1.05},
                      fail=oom)
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    big = trial_of(sweep, micro_batch_size=64)
    assert sweep.status(big, selected) == "screen: out of memory" and "confirm" not in big.results
    assert selected.candidate == dict(GPU, loss_impl="quack_chunked")


def test_a_failed_incumbent_still_selects_a_confirmed_candidate():
    fail = lambda c, stage: "RuntimeError: boom" if c == GPU else None
    bench = FakeBench(FakeClock(), GPU, gains={("loss_impl", "quack_chunked"): 0.9}, fail=fail)
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    assert selected is not None and selected is not sweep.incumbent and sweep_lib.rate(selected.confirm)
    assert sweep.status(sweep.incumbent, selected) == "screen: error" and "confirm" not in sweep.incumbent.results
    assert sweep.protocols["confirm"] == sweep_lib.PROTOCOLS["confirm"]  # chosen from the first screen that ran


@pytest.mark.parametrize("seed", range(40))
def test_random_sweeps_keep_every_rule(seed):
    """Whatever the speeds, compile times and budget: the sweep ends within its budget, measures the incumbent
    first, answers whenever the incumbent's screen finished, confirms with one protocol, selects only a candidate
    confirmed among the best screened with the incumbent's measurement's protocol, and never one slower than the
    incumbent or within the noise of it."""
    rng = random.Random(seed)
    space = tune.search_space(GPU, CHOICES)
    gains = {(k, c[k]): rng.uniform(0.8, 1.15) for lever, c in space for k in changed(c, GPU)}
    screens = {key: g * rng.uniform(0.95, 1.05) for key, g in gains.items()}
    compile_of = {tune.candidate_name(c): rng.uniform(5, 300) for _, c in [(None, GPU)] + space}
    bench = FakeBench(FakeClock(), GPU, gains=gains, screen_gains=screens,
                      compile_s=lambda c: compile_of.get(tune.candidate_name(c), 30.0),
                      per_update_s=rng.uniform(0.05, 0.4))
    budget = rng.uniform(60, 2400)
    sweep = sweep_of(bench, budget=budget, candidate_timeout=600.0, noise=0.01, confirm=rng.randint(1, 5))
    selected = sweep.run()
    assert sweep.elapsed() <= budget + 1e-6 and all(t <= 600.0 for t in bench.timeouts)
    assert bench.runs[0] == ("screen", GPU)
    confirms = [p for (stage, _), p in zip(bench.runs, bench.protocols) if stage == "confirm"]
    assert len(confirms) <= sweep.confirm + 1 and all(p == sweep.protocols["confirm"] for p in confirms)
    inc = sweep.incumbent
    if selected is None:
        assert not sweep_lib.rate(inc.screen)
        return
    assert selected is inc or (sweep_lib.rate(selected.confirm) and selected in sweep.best_screened())
    measured = lambda t: sweep_lib.rate(t.results[sweep.measured_by(t)])
    stage = sweep.measured_by(inc)
    if stage:  # candidates compare by the incumbent's stage: confirmations, or screens where it stands by its screen
        noise = 1.03 if stage == "screen" else 1.01
        same = [t for t in sweep.trials[1:] if sweep_lib.rate(t.confirm) and sweep_lib.rate(t.results.get(stage))
                and t.protocols[stage] == inc.protocols[stage]]
        assert all(sweep.measured_by(t) == stage for t in same)
        assert selected is inc or (selected in same and measured(selected) > measured(inc) * noise)
        best = max([measured(inc)] + [measured(t) for t in same])
        assert measured(selected) >= best / noise  # the fastest of those measured alike, unless within noise of it


def test_the_budget_split_adds_up():
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.05})
    sweep = sweep_of(bench, budget=36000)
    sweep.run()
    split = sweep.budget_split()
    assert split["compile_seconds"] == pytest.approx(sum(bench.compile_s(c) for _, c in bench.runs))
    # each part on its own, not only their sum (other_seconds is what is left of the elapsed time)
    assert split["other_seconds"] == pytest.approx(bench.outside_s * len(bench.runs))
    total = split["compile_seconds"] + split["measure_seconds"] + split["other_seconds"]
    assert total == pytest.approx(split["elapsed_seconds"])
    assert split["screen_seconds"] + split["confirm_seconds"] == pytest.approx(split["elapsed_seconds"])


def test_the_tuning_record_has_every_field_a_reader_uses():
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.05})
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    cfg = tune_cfg(budget=600.0)
    tuning = tune.tuning_record(cfg, sweep, selected, [], "hash")
    assert {"run_id", "budget_minutes", "budget_exhausted", "elapsed_minutes", "source_hash", "environment",
            "protocols", "full_protocol", "incumbent", "candidates", "selected", "selected_config_path",
            "gain_over_incumbent",
            "budget_split", "minutes_to_finish", "noise", "screen_noise", "refused", "base_config"} <= set(tuning)
    assert tuning["selected"]["change"] == "compile_scope=blocks" and not tuning["budget_exhausted"]
    assert tuning["selected"]["measured_by"] == "confirm"
    assert tuning["selected"]["protocol"] == tuning["protocols"]["confirm"] == tuning["full_protocol"]
    assert tuning["minutes_to_finish"] * 60 >= sweep.budget_split()["screen_seconds"]
    assert tuning["gain_over_incumbent"] == pytest.approx(0.05)
    record = tuning["candidates"][1]
    for field in ("name", "lever", "change", "config_path", "status", "screen", "confirm", "screen_ratio",
                  "tokens_per_second", "measured_by", "protocol", "compile_seconds", "peak_memory_bytes",
                  "not_started", *tune.LEVER_KEYS):
        assert field in record
    # and the values a reader takes from them: the fake bench gives blocks 1.05x, every compile 20 s
    [blocks] = [r for r in tuning["candidates"] if r["change"] == "compile_scope=blocks"]
    assert blocks["screen_ratio"] == pytest.approx(1.05) and tuning["candidates"][0]["screen_ratio"] == 1.0
    assert blocks["tokens_per_second"] == pytest.approx(1050.0) and blocks["compile_seconds"] == 20.0
    assert blocks["status"] == "selected" and blocks["compile_scope"] == "blocks"


def test_a_15_minute_gpu_sweep_screens_every_cheap_lever_and_confirms_the_best():
    """The H200 figures of docs/TUNING.md in fake time: a process takes 12 s to start, a whole-model compile 20 s
    (blocks 10 s, fa4's backward 4 s more, autotuning 170 s), an update of 32,768 tokens 16 ms."""
    def compile_s(c):
        if not c["compile"]:
            return 1.0
        seconds = 20.0 if c["compile_scope"] == "model" else 10.0
        return seconds * (8.5 if "max-autotune" in c["compile_mode"] else 1.0) + 4.0 * (c["attention_backend"] == "fa4")
    gains = {("attention_backend", "fa4"): 1.028, ("loss_impl", "full"): 0.92, ("loss_impl", "quack_chunked"): 0.9,
             ("compile", False): 0.35, ("compile_mode", "default"): 0.99, ("compile_scope", "blocks"): 0.98,
             ("activation_memory_budget", 0.8): 0.965, ("micro_batch_size", 16): 0.97,
             ("attention_backend", "cudnn"): 1.004, ("attention_backend", "math"): 0.5}
    bench = FakeBench(FakeClock(), GPU, gains=gains, compile_s=compile_s, per_update_s=0.016, outside_s=12.0)
    sweep = sweep_of(bench, budget=15 * 60)
    selected = sweep.run()
    screened = [t for t in sweep.trials[1:] if t.screen]
    assert len(screened) >= 12 and sweep.elapsed() <= 15 * 60
    changes = {sweep_lib.describe(t.candidate, GPU) for t in screened}
    assert {"attention_backend=fa4", "loss_impl=full", "loss_impl=quack_chunked", "compile_scope=blocks"} <= changes
    assert all(sweep_lib.rate(t.confirm) for t in sweep.best_screened())
    assert selected.candidate == dict(GPU, attention_backend="fa4")  # +2.8%, beyond the 1% noise


def test_a_rerun_with_the_same_budget_asks_for_the_protocol_it_measured_and_reuses_it():
    """A reused incumbent screen cost no time, so the rerun had the whole budget for its protocol, chose a larger
    rung than the sweep it repeated, and measured the incumbent's confirmation again."""
    store = {}

    def reusing(bench):
        def measure(candidate, stage, protocol, timeout):
            key = (tune.candidate_name(candidate), stage, tuple(sorted(protocol.items())))
            if key in store:
                return dict(store[key], reused=True)
            start = bench.clock.now
            res = dict(bench(candidate, stage, protocol, timeout), wall_seconds=None)
            res["wall_seconds"] = bench.clock.now - start
            store[key] = res
            return res
        return measure

    protocols, runs = [], []
    for _ in range(2):
        bench = FakeBench(FakeClock(), GPU)
        sweep = sweep_of(bench, budget=130, space=[])
        sweep.measure = reusing(bench)
        sweep.run()
        protocols.append(sweep.protocols["confirm"])
        runs.append(len(bench.runs))
    assert protocols[0] == protocols[1] != sweep_lib.PROTOCOLS["confirm"]  # a smaller rung, the same one again
    assert runs == [2, 0]  # the rerun measured nothing


def test_the_budget_counts_from_when_the_sweep_was_asked_for():
    """The Sweep's clock started after tune.py's checks, plan and fingerprint: a 15 s budget took 18 s."""
    bench = FakeBench(FakeClock(), GPU)
    bench.clock.now = 100.0
    sweep = sweep_of(bench, budget=60, space=[], started=90.0)
    assert sweep.elapsed() == 10.0 and sweep.left() == 50.0


def test_where_the_incumbent_stands_by_its_screen_the_record_and_report_compare_screens(capsys):
    # its confirmation fails; blocks screens 2% faster (within tune_screen_noise) and confirms 10% faster
    fail = lambda c, stage: "RuntimeError: boom" if c == GPU and stage == "confirm" else None
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.1},
                      screen_gains={("compile_scope", "blocks"): 1.02}, fail=fail)
    sweep = sweep_of(bench, budget=36000)
    tuning = tune.tuning_record(tune_cfg(budget=600.0), sweep, sweep.run(), [], "hash")
    [blocks] = [r for r in tuning["candidates"] if r["change"] == "compile_scope=blocks"]
    assert tuning["selected"]["lever"] == "incumbent" and tuning["incumbent"]["measured_by"] == "screen"
    assert blocks["measured_by"] == "screen" and blocks["tokens_per_second"] == pytest.approx(1020.0)
    tune.print_selection(tuning)
    assert "none by more than tune_screen_noise (3.0%)" in capsys.readouterr().out
