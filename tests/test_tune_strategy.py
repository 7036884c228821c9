"""tune.py's strategy without processes: the search space, and the Sweep driven by a fake clock and a fake
measurement, so each rule (incumbent first, screen then confirm, the budget) is checked by what it decides."""
import random

import pytest

import kernels.attention
import kernels.cross_entropy
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
CHOICES = {"attention_backend": ["auto", "flash", "efficient", "cudnn", "math", "fa4"],
           "loss_impl": ["full", "chunked", "fused"],
           "compile_mode": ["eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
           "compile_scope": ["model", "blocks"], "activation_memory_budget": [0.8], "micro_batch_size": [16, 64],
           "cpu_threads": []}


def changed(candidate, incumbent):
    return {k for k in tune.LEVER_KEYS if candidate[k] != incumbent[k]}


class FakeBench:
    """Runs a candidate in fake time: outside_s to start, its compile, then each update at per_update_s x 1000 /
    its speed (ended at the timeout, as the real one is); the speed is set per changed setting and per rung."""

    def __init__(self, clock, incumbent, gains=None, screen_gains=None, compile_s=None, per_update_s=0.2,
                 outside_s=3.0, fail=None, screen_pace=1.0):
        self.clock, self.incumbent, self.gains = clock, incumbent, gains or {}
        self.screen_gains = screen_gains if screen_gains is not None else self.gains
        self.compile_s = compile_s or (lambda c: 20.0 if c["compile"] else 0.5)
        self.per_update_s, self.outside_s, self.screen_pace = per_update_s, outside_s, screen_pace
        self.fail = fail or (lambda c, rung: None)
        self.runs, self.timeouts, self.protocols = [], [], []

    def speed(self, candidate, rung):
        gains = self.screen_gains if rung == "screen" else self.gains
        speed = 1000.0
        for key in changed(candidate, self.incumbent):
            speed *= gains.get((key, candidate[key]), 1.0)
        return speed

    def __call__(self, candidate, rung, protocol, timeout):
        self.runs.append((rung, candidate))
        self.timeouts.append(timeout)
        self.protocols.append(protocol)
        first, speed = self.compile_s(candidate), self.speed(candidate, rung)
        speed /= self.screen_pace if rung == "screen" else 1.0
        per_update = self.per_update_s * 1000.0 / speed
        warmup = first + (protocol["warmup"] - 1) * per_update
        window = protocol["steps"] * per_update
        seconds = self.outside_s + warmup + protocol["windows"] * window
        if seconds > timeout:
            self.clock.now += timeout
            return {"status": "error", "error": f"timed out after {timeout / 60:.1f} minutes"}
        self.clock.now += seconds
        error = self.fail(candidate, rung)
        if error:
            return {"status": "error", "error": error, "first_update_seconds": first}
        return {"status": "ok", "tokens_per_second": speed, "first_update_seconds": first, "warmup_seconds": warmup,
                "measurements": [{"seconds": window, "updates": protocol["steps"]}] * protocol["windows"]}


def sweep_of(bench, budget, incumbent=GPU, space=None, **kw):
    space = tune.search_space(incumbent, CHOICES, cuda=True) if space is None else space
    return tune.Sweep(incumbent, space, bench, budget, clock=bench.clock, **kw)


# ---------------------------------------------------------------- the space

def test_space_changes_one_lever_at_a_time_in_the_documented_order():
    space = tune.search_space(GPU, CHOICES, cuda=True)
    candidates = [c for _, c in space]
    assert GPU not in candidates and len(candidates) == len({tune.candidate_name(c) for c in candidates})
    assert len(candidates) >= 12
    for lever, c in space:
        assert changed(c, GPU) <= {lever, "compile"}  # one lever (a mode change may switch compile itself)
    assert candidates[0] == dict(GPU, attention_backend="fa4")  # the largest measured gain is screened first
    levers = [lever for lever, _ in space]
    for earlier, later in [("loss_impl", "compile_scope"), ("compile_scope", "activation_memory_budget"),
                           ("activation_memory_budget", "micro_batch_size")]:
        assert levers.index(earlier) < levers.index(later)
    # SDPA's other kernels after the micro-batch neighbours, and the autotuning modes (minutes of compile) last
    assert levers.index("micro_batch_size") < levers.index("attention_backend", 1)
    assert [tune.mode_of(c) for c in candidates[-2:]] == ["max-autotune", "max-autotune-no-cudagraphs"]
    assert {c["loss_impl"] for c in candidates} == {"full", "chunked", "fused"}
    assert dict(GPU, compile_scope="blocks") in candidates and dict(GPU, activation_memory_budget=0.8) in candidates


def test_no_cuda_graphs_on_the_cpu_and_an_eager_incumbent_is_tried_compiled():
    space = [c for _, c in tune.search_space(CPU, CHOICES, cuda=False)]
    assert not [c for c in space if c["compile"] and c["compile_mode"] in tune.CUDA_GRAPH_MODES]
    compiled = dict(CPU, compile=True)
    assert compiled in space and dict(compiled, compile_scope="blocks") in space
    assert dict(compiled, activation_memory_budget=0.8) in space
    assert dict(CPU, compile=True, compile_mode="max-autotune-no-cudagraphs") in space
    # scope and activation memory never on an eager run, where they would change nothing
    assert all(c["compile"] for c in space if c["compile_scope"] != "model" or c["activation_memory_budget"] != 1)


def tune_cfg(**overrides):
    return train.Config(dict(tune.DEFAULTS, **overrides))


def test_levers_are_read_from_the_kernels_at_run_time(monkeypatch, capsys):
    monkeypatch.setitem(kernels.attention.ATTENTION_BACKENDS, "xformers", None)
    monkeypatch.setattr(kernels.cross_entropy, "LOSS_IMPLEMENTATIONS", ("full", "chunked", "fused", "liger"))
    monkeypatch.setattr(train.model_lib, "LOSS_IMPLEMENTATIONS", kernels.cross_entropy.LOSS_IMPLEMENTATIONS)
    choices = tune.lever_choices(tune_cfg(device="cpu", micro_batch_size=8), cuda=False)
    assert "xformers" in choices["attention_backend"] and "liger" in choices["loss_impl"]
    assert choices["micro_batch_size"] == [4, 16]  # the config's neighbours
    assert choices["compile_mode"] == ["eager", *train.COMPILE_MODES]
    # fa4 cannot run on a CPU: left out of the default list with one line, never a candidate
    assert "fa4" not in choices["attention_backend"]
    assert "skipping attention_backend=fa4" in capsys.readouterr().out


@pytest.mark.parametrize("fa4_runs, incumbent, left_out", [(True, "auto", "fa4"), (False, "auto", "sdpa"),
                                                             (True, "fa4", "auto"), (False, "sdpa", "auto")])
def test_the_backend_the_incumbent_runs_is_not_screened_again(monkeypatch, capsys, fa4_runs, incumbent, left_out):
    """auto is fa4 where flash-attn-4 can run, else SDPA: the one of them that auto is here, or auto beside it,
    would measure the incumbent under another name."""
    monkeypatch.setattr(kernels.attention, "fa4_problem", lambda device: None if fa4_runs else "no flash-attn-4")
    backends = tune.lever_choices(tune_cfg(attention_backend=incumbent), cuda=True)["attention_backend"]
    assert left_out not in backends and "cudnn" in backends
    skipped = f"skipping attention_backend={left_out}: what the incumbent's '{incumbent}' runs here"
    assert skipped in capsys.readouterr().out
    named = tune.lever_choices(tune_cfg(attention_backend=incumbent, tune_backends=f"{left_out},cudnn"), cuda=True)
    assert named["attention_backend"] == [left_out, "cudnn"]  # named ones are tried as asked


def test_fa4_is_a_lever_where_it_can_run(monkeypatch, flash_attn_4_stand_in):
    monkeypatch.setattr(kernels.attention, "fa4_problem", lambda device: None if device.type == "cuda" else "no GPU")
    # a config that pins SDPA (with auto, fa4 is the incumbent's own attention where it runs)
    assert "fa4" in tune.lever_choices(tune_cfg(attention_backend="sdpa"), cuda=True)["attention_backend"]
    with pytest.raises(tune.ConfigError, match="tune_backends names fa4, but no GPU"):
        tune.lever_choices(tune_cfg(tune_backends="auto,fa4"), cuda=False)


# ---------------------------------------------------------------- the sweep

def test_incumbent_is_measured_first_with_the_full_protocol_then_screened():
    bench = FakeBench(FakeClock(), GPU)
    sweep = sweep_of(bench, budget=3600)
    sweep.run()
    # its screen (seconds) first, which says how long its full protocol takes; then that protocol
    assert bench.runs[:2] == [("screen", GPU), ("confirm", GPU)]
    assert bench.protocols[1] == tune.PROTOCOLS["confirm"] and bench.protocols[0] == tune.PROTOCOLS["screen"]
    assert all(rung == "screen" for rung, _ in bench.runs[2:len(sweep.trials) + 1])  # all screens before confirms
    assert sweep.fitted is None


def test_a_budget_that_fits_only_the_incumbent_selects_it():
    bench = FakeBench(FakeClock(), GPU, gains={("attention_backend", "fa4"): 1.05})
    # the incumbent's screen takes 27 s and its confirmation 87: no other screen leaves room for a confirmation
    sweep = sweep_of(bench, budget=130)
    assert sweep.run() is sweep.incumbent
    assert bench.runs == [("screen", GPU), ("confirm", GPU)]
    assert sweep.exhausted() and sweep.elapsed() <= 130
    assert all(set(t.not_started) == {"screen"} for t in sweep.trials[1:])


def test_the_incumbent_runs_whatever_its_compile_is_guessed_to_take():
    bench = FakeBench(FakeClock(), GPU, compile_s=lambda c: 5.0)
    sweep = sweep_of(bench, budget=100, compile_guess=600.0)  # the guess says 600 s; both runs take 84
    assert sweep.run() is sweep.incumbent


CPU_PROTOCOLS = {"screen": {"warmup": 3, "steps": 10, "windows": 1}, "confirm": dict(tune.PROTOCOLS["confirm"])}


def test_a_full_protocol_that_cannot_finish_is_shortened_to_fit():
    """A small CPU: an update takes 1 s, so protocol v2 (320 updates) would take 5 minutes of a 4-minute budget."""
    bench = FakeBench(FakeClock(), CPU, per_update_s=1.0)
    space = tune.search_space(CPU, CHOICES, cuda=False)
    sweep = sweep_of(bench, budget=240, incumbent=CPU, space=space, protocols=CPU_PROTOCOLS)
    selected = sweep.run()
    # 224.5 s left after the 15.5 s screen: 4 + 3 x 22 updates fit its confirmation in a third of that
    assert sweep.fitted == {"warmup": 20, "steps": 100, "fitted_warmup": 4, "fitted_steps": 22,
                            "budget_left_seconds": pytest.approx(224.5)}
    assert all(p == dict(CPU_PROTOCOLS["confirm"], warmup=4, steps=22)
               for (rung, _), p in zip(bench.runs, bench.protocols) if rung == "confirm")
    assert selected is not None and tune.rate(selected.confirm) and sweep.elapsed() <= 240
    assert CPU_PROTOCOLS["confirm"]["steps"] == 100  # the caller's protocols are not changed
    assert sum(1 for t in sweep.trials if t.screen) > 1  # the rest of the budget still screened others
    # where nothing fits, as short as a screen: the best chance left of a selection
    bench = FakeBench(FakeClock(), CPU, per_update_s=1.0)
    sweep = sweep_of(bench, budget=50, incumbent=CPU, space=space, protocols=CPU_PROTOCOLS)
    sweep.run()
    assert (sweep.fitted["fitted_warmup"], sweep.fitted["fitted_steps"]) == (3, 10) and sweep.elapsed() <= 50
    # without fitting, the incumbent's full protocol runs into the end of the budget and nothing is selected
    bench = FakeBench(FakeClock(), CPU, per_update_s=1.0)
    sweep = sweep_of(bench, budget=240, incumbent=CPU, space=space, protocols=CPU_PROTOCOLS, fit=False)
    assert sweep.run() is None and sweep.elapsed() <= 240


def test_estimates_compare_screens_with_screens():
    """Screens run slower per update than confirmations (less warmed up, or a busy CPU): the incumbent's
    confirmation estimate must come from its own confirmation, not be scaled by its slow screen."""
    bench = FakeBench(FakeClock(), GPU, screen_pace=5.0)
    # (not fitted: the slow screen alone would say the full protocol cannot finish)
    sweep = sweep_of(bench, budget=280, space=[("loss_impl", dict(GPU, loss_impl="full"))], fit=False)
    sweep.run()
    # screens of 45 s and confirmations of 87: after the incumbent's, 148 s hold one more of each
    assert sweep.run_estimate(sweep.incumbent, "confirm") == pytest.approx(87.0)
    assert [rung for rung, _ in bench.runs] == ["screen", "confirm", "screen", "confirm"]


def test_a_screened_out_candidate_is_never_selected():
    # fa4 and chunked loss would win the full protocol, but screen slower than the incumbent beyond the noise
    gains = {("attention_backend", "fa4"): 1.5, ("loss_impl", "chunked"): 1.4, ("compile_scope", "blocks"): 1.05}
    screens = {("attention_backend", "fa4"): 0.9, ("loss_impl", "chunked"): 0.95, ("compile_scope", "blocks"): 1.05}
    bench = FakeBench(FakeClock(), GPU, gains=gains, screen_gains=screens)
    sweep = sweep_of(bench, budget=3600)
    selected = sweep.run()
    confirmed = [c for rung, c in bench.runs if rung == "confirm"]
    assert dict(GPU, attention_backend="fa4") not in confirmed and dict(GPU, loss_impl="chunked") not in confirmed
    assert selected.candidate == dict(GPU, compile_scope="blocks")
    assert sweep.status(sweep.trials[1], selected) == "screened out"


def test_only_the_best_fraction_is_confirmed_best_screen_first():
    screens = {("micro_batch_size", 16): 1.01, ("compile_scope", "blocks"): 1.02, ("loss_impl", "full"): 0.99}
    bench = FakeBench(FakeClock(), GPU, gains={}, screen_gains=screens)
    sweep = sweep_of(bench, budget=36000, confirm_fraction=0.1)
    sweep.run()
    screened = sum(1 for t in sweep.trials[1:] if tune.rate(t.screen))
    confirmed = [c for rung, c in bench.runs if rung == "confirm"][1:]
    assert len(confirmed) == -(-screened // 10)  # ceil(0.1 x the screened)
    assert confirmed[0] == dict(GPU, compile_scope="blocks")
    assert confirmed[1] == dict(GPU, micro_batch_size=16)
    assert all(sweep.status(t, None) in ("screened out", "confirmed") for t in sweep.trials[1:])


def test_a_compile_that_does_not_fit_is_not_started_and_a_cheaper_candidate_after_it_is():
    compile_s = lambda c: 400.0 if "max-autotune" in tune.mode_of(c) else (20.0 if c["compile"] else 0.5)
    bench = FakeBench(FakeClock(), GPU, compile_s=compile_s)
    space = [("compile_mode", dict(GPU, compile_mode="max-autotune")), ("loss_impl", dict(GPU, loss_impl="full"))]
    # after the incumbent's 27 s screen and 87 s confirmation, 216 s are left, 87 of them held for a
    # confirmation: autotuning's compile, estimated at 8 x the 20 s measured, does not fit; a 27 s screen does
    sweep = sweep_of(bench, budget=330, space=space)
    sweep.run()
    autotune, loss = sweep.trials[1:]
    assert ("screen", autotune.candidate) not in bench.runs and "compile" in autotune.not_started["screen"]
    assert ("screen", loss.candidate) in bench.runs
    assert sweep.compile_estimate(autotune.candidate) == pytest.approx(160.0)


def test_compile_estimates_come_from_what_was_measured():
    bench = FakeBench(FakeClock(), GPU)
    sweep = sweep_of(bench, budget=1e9, space=[], compile_guess=60.0)
    assert sweep.compile_estimate(GPU) == 60.0  # nothing measured: the guess for a whole-model compile
    assert sweep.compile_estimate(dict(GPU, compile_scope="blocks")) == 30.0
    assert sweep.compile_estimate(dict(GPU, compile=False)) == 0.0
    sweep.incumbent.results["confirm"] = {"status": "ok", "tokens_per_second": 1.0, "first_update_seconds": 22.0}
    assert sweep.compile_estimate(dict(GPU, loss_impl="full")) == 22.0  # same compile settings
    assert sweep.compile_estimate(dict(GPU, compile_scope="blocks")) == 11.0
    assert sweep.compile_estimate(dict(GPU, compile_mode="max-autotune")) == 176.0
    assert sweep.compile_estimate(dict(GPU, attention_backend="fa4")) == 22.0 + tune.FA4_COMPILE_SECONDS


def test_the_levers_that_won_their_screens_are_tried_together():
    gains = {("attention_backend", "fa4"): 1.035, ("compile_scope", "blocks"): 1.05, ("micro_batch_size", 16): 1.04,
             ("micro_batch_size", 64): 1.06, ("loss_impl", "full"): 1.01}
    bench = FakeBench(FakeClock(), GPU, gains=gains)
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    # each lever's best winner by more than the screen noise (3%); loss_impl=full won by 1% only
    combined = dict(GPU, attention_backend="fa4", compile_scope="blocks", micro_batch_size=64)
    assert sweep.trials[-1].lever == "combined" and sweep.trials[-1].candidate == combined
    assert selected.candidate == combined and tune.rate(selected.confirm) == pytest.approx(1000 * 1.035 * 1.05 * 1.06)


def test_a_refused_combination_is_not_run():
    gains = {("compile_scope", "blocks"): 1.05, ("micro_batch_size", 64): 1.06}
    bench = FakeBench(FakeClock(), GPU, gains=gains)
    sweep = sweep_of(bench, budget=36000, valid=lambda c: "no graphs of blocks at 64" if
                     c["compile_scope"] == "blocks" and c["micro_batch_size"] == 64 else None)
    sweep.run()
    assert all(t.lever != "combined" for t in sweep.trials) and sweep.refused[0][1] == "no graphs of blocks at 64"


def test_a_gain_within_noise_keeps_the_incumbent():
    bench = FakeBench(FakeClock(), GPU, gains={("compile_scope", "blocks"): 1.008})
    sweep = sweep_of(bench, budget=36000, noise=0.01)
    assert sweep.run() is sweep.incumbent
    assert tune.rate(sweep.trials[[t.candidate for t in sweep.trials].index(dict(GPU, compile_scope="blocks"))]
                     .confirm) > tune.rate(sweep.incumbent.confirm)  # faster, but by less than the noise


def test_a_failed_run_ends_only_that_candidate():
    oom = lambda c, rung: "torch.OutOfMemoryError: CUDA out of memory." if c["micro_batch_size"] == 64 else None
    bench = FakeBench(FakeClock(), GPU, gains={("micro_batch_size", 64): 2.0, ("loss_impl", "chunked"): 1.05},
                      fail=oom)
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    big = next(t for t in sweep.trials if t.candidate == dict(GPU, micro_batch_size=64))
    assert sweep.status(big, selected) == "screen: out of memory" and "confirm" not in big.results
    assert selected.candidate == dict(GPU, loss_impl="chunked")


def test_a_failed_incumbent_still_selects_a_confirmed_candidate():
    fail = lambda c, rung: "RuntimeError: boom" if c == GPU else None
    bench = FakeBench(FakeClock(), GPU, gains={("loss_impl", "chunked"): 0.9}, fail=fail)
    sweep = sweep_of(bench, budget=36000)
    selected = sweep.run()
    assert selected is not None and selected is not sweep.incumbent and tune.rate(selected.confirm)


@pytest.mark.parametrize("seed", range(40))
def test_random_sweeps_keep_every_rule(seed):
    """Whatever the speeds, compile times and budget: the sweep ends within its budget, selects only a
    candidate measured with the full protocol, never one the screens dropped, and never one slower than the
    incumbent beyond the noise."""
    rng = random.Random(seed)
    space = tune.search_space(GPU, CHOICES, cuda=True)
    gains = {(k, c[k]): rng.uniform(0.8, 1.15) for lever, c in space for k in changed(c, GPU)}
    screens = {key: g * rng.uniform(0.95, 1.05) for key, g in gains.items()}
    compile_of = {tune.candidate_name(c): rng.uniform(5, 300) for _, c in [(None, GPU)] + space}
    bench = FakeBench(FakeClock(), GPU, gains=gains, screen_gains=screens,
                      compile_s=lambda c: compile_of.get(tune.candidate_name(c), 30.0),
                      per_update_s=rng.uniform(0.05, 0.4))
    budget = rng.uniform(60, 2400)
    sweep = sweep_of(bench, budget=budget, candidate_timeout=600.0, noise=0.01)
    selected = sweep.run()
    assert sweep.elapsed() <= budget + 1e-6 and all(t <= 600.0 for t in bench.timeouts)
    assert bench.runs[:2] == [("screen", GPU), ("confirm", GPU)][:len(bench.runs)]
    if selected is None:
        assert not tune.rate(sweep.incumbent.confirm)
        return
    assert tune.rate(selected.confirm)
    assert selected is sweep.incumbent or selected in sweep.promoted()
    inc = tune.rate(sweep.incumbent.confirm)
    if inc:
        assert tune.rate(selected.confirm) >= inc
        assert selected is sweep.incumbent or tune.rate(selected.confirm) > inc * 1.01
    # the fastest confirmation wins, unless it beats the selection by no more than the noise
    best = max(tune.rate(t.confirm) or 0 for t in sweep.trials)
    assert tune.rate(selected.confirm) >= best / 1.01


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


def test_a_15_minute_gpu_sweep_screens_every_cheap_lever_and_confirms_the_best():
    """The H200 figures of docs/PERFORMANCE.md in fake time: a process takes 12 s to start, a whole-model
    compile 20 s (blocks 10 s, fa4's backward 4 s more, autotuning 170 s), an update of 32,768 tokens 16 ms."""
    def compile_s(c):
        if not c["compile"]:
            return 1.0
        seconds = 20.0 if c["compile_scope"] == "model" else 10.0
        return seconds * (8.5 if "max-autotune" in c["compile_mode"] else 1.0) + 4.0 * (c["attention_backend"] == "fa4")
    gains = {("attention_backend", "fa4"): 1.028, ("loss_impl", "full"): 0.92, ("loss_impl", "chunked"): 0.9,
             ("compile", False): 0.35, ("compile_mode", "default"): 0.99, ("compile_scope", "blocks"): 0.98,
             ("activation_memory_budget", 0.8): 0.965, ("micro_batch_size", 16): 0.97,
             ("attention_backend", "efficient"): 0.81, ("attention_backend", "math"): 0.5}
    bench = FakeBench(FakeClock(), GPU, gains=gains, compile_s=compile_s, per_update_s=0.016, outside_s=12.0)
    sweep = sweep_of(bench, budget=15 * 60)
    selected = sweep.run()
    screened = [t for t in sweep.trials[1:] if t.screen]
    assert len(screened) >= 12 and sweep.elapsed() <= 15 * 60
    changes = {tune.describe(t.candidate, GPU) for t in screened}
    assert {"attention_backend=fa4", "loss_impl=full", "loss_impl=chunked", "compile_scope=blocks"} <= changes
    assert selected.candidate == dict(GPU, attention_backend="fa4")  # +2.8%, beyond the 1% noise
