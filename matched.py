"""compare.py's matched mode: a baseline and an optimized run of one recipe (and the baseline at other seeds, for the
training noise), trained or reused, and the verdict that the faster execution kept the math: the same recipe
identity, and final validation losses that agree within the larger of the validation noise and the training noise
(docs/MATCHED_RUNS.md says how far to trust it); and whether it is faster: a speed ratio outside the speed's noise,
between two different executions. The verdict goes to results["matched-comparison"], with a plot of both runs' loss
curves."""
import dataclasses
import math
import shlex
import statistics
from pathlib import Path

import env
import plots
import settings
from configurator import RENAMED_KEYS, load_config
from results import SECTIONS, lookup, read_results, record
from runs import (TRAIN_DEFAULTS, CompareError, check_plot_path, run_folders, run_plan, run_recipe,
                  seed_run_name, train_all)
from settings import setting


@dataclasses.dataclass
class Matched:
    """the matched mode (--mode=matched)"""
    baseline: str = setting("", "with optimized: compare these two finished runs, train nothing")
    optimized: str = setting("", "see baseline")
    tuned: bool = setting(False, 'layer results["tuning"]["selected"]["config_path"] on the optimized side')
    optimized_overrides: str = setting("", "space-separated --key=value for the optimized run only (a lever to try)")
    allow_recipe_change: bool = setting(False, 'compare runs whose recipes differ, labelled "recipe change"')
    baseline_micro_batch_size: int = setting(8, "the plain baseline's micro-batch", bounds=">= 1")
    noise_seed_runs: int = setting(1, "runs of the baseline at seeds seed+1, seed+2, ... (<name>-baseline-seed<N>) "
                                      "whose spread of final validation loss with the baseline's measures training "
                                      "noise; 0: none (then give --noise_runs, or only validation noise counts)",
                                   bounds=">= 0")
    noise_runs: str = setting("", "comma-separated finished runs (repeats, other seeds) that measure it too, beside "
                                  "the seed runs; each the baseline's recipe, its seed aside, and not a compared run")


# How the baseline executes: the plainest way, whatever the config asks for ("auto" attention can be fa4).
BASELINE_EXECUTION = {"compile": False, "attention_backend": "sdpa", "loss_impl": "full", "mlp_impl": "torch",
                      "update_graph": False, "compile_cache": ""}  # the last two need compile
# Bulky fields of a run's entry that the comparison leaves out (the run's own entry keeps them).
BULKY = ("environment", "config", "recipe")
NOISE_SIGMAS = 3  # standard deviations of a difference of two runs' losses that the tolerance allows (either noise)
FIRM_NOISE_RUNS = 3  # noise runs under which a failed verdict suggests more (NOISE_RULE says how often one fails)


def t_tail(x, df):
    """P(|T| > x) for Student's t with a whole number df of degrees of freedom, in closed form (Abramowitz and
    Stegun 26.7.3 and 26.7.4), so that the rule states its odds without importing scipy."""
    theta = math.atan(x / math.sqrt(df))
    sin, cos, odd = math.sin(theta), math.cos(theta), df % 2
    term, series = 1.0, 0.0  # 1 + a_1 cos^2 + a_2 cos^4 + ..., (df - odd) // 2 terms
    for k in range(1, (df - odd) // 2 + 1):
        series += term
        term *= (2 * k - 1 + odd) / (2 * k + odd) * cos ** 2
    return 1 - (2 / math.pi * (theta + sin * cos * series) if odd else sin * series)


TOLERANCE_RULE = ("|optimized - baseline| final validation loss <= the larger of the validation noise, "
                  f"{NOISE_SIGMAS} * sqrt(se_baseline^2 + se_optimized^2) with se = loss_std / sqrt(tokens) of each "
                  "run's full validation (neighbouring tokens' losses are correlated, so this is a lower bound)")
NOISE_RULE = (f"; and the training noise, {NOISE_SIGMAS} * sqrt(2) * s with s the sample standard deviation of the "
              "final validation losses of the baseline and its noise runs (its recipe at other seeds, or repeats): "
              f"{NOISE_SIGMAS} * |d| for one noise run, d the difference of the two baseline runs. A single difference "
              "is a one-degree-of-freedom estimate (a same-math run whose execution noise is as large as a seed's "
              f"exceeds it with probability at most {t_tail(NOISE_SIGMAS, 1):.2f}; "
              f"{t_tail(NOISE_SIGMAS, FIRM_NOISE_RUNS):.2f} with {FIRM_NOISE_RUNS} noise runs: the baseline is in "
              "both the difference and the noise estimate, which makes a false alarm rarer than the t-distribution "
              "says), and the validation noise is the floor under one that happens to be small")
NO_NOISE_RULE = ("; no noise run was given ({why}), so training noise is not counted, and two executions of one "
                 "recipe can differ by more than this")
SPEED_SIGMAS = 3  # as for the loss: standard deviations of a difference of two runs' (log) median rates
MIN_INTERVALS = 4  # log intervals a run needs for the quartiles of its interval rates to be a spread
# The execution keys that leave the training rate alone: validation's batch (validation is not training time).
UNTIMED_KEYS = ("eval_batch_size",)
SPEED_RULE = ("a speed-up (slow-down) is called when the whole noise band of optimized / baseline median training "
              "tok/s lies above (below) 1, and never when the two sides run the same execution (the execution keys "
              "and process count, with auto attention and device as each run resolved them); the band is the wider "
              f"of ratio * exp(+-{SPEED_SIGMAS} * sqrt(2) * s), s the sample standard deviation of the log median "
              "tok/s of the baseline and its noise runs of the baseline's execution, and [optimized q1 / baseline q3, "
              "optimized q3 / baseline q1] of the two runs' interval rates (each with at least "
              f"{MIN_INTERVALS} log intervals); with neither, the speed's noise is not measured and nothing is called")


# ---------------------------------------------------------------- the runs' configs

def side_configs(cfg):
    """(baseline, optimized) train.py configs of one recipe, named <name>-baseline and <name>-optimized."""
    given = {k: cfg[k] for k in TRAIN_DEFAULTS}
    base = dict(given, micro_batch_size=cfg.baseline_micro_batch_size, **BASELINE_EXECUTION)
    layers = []
    if cfg.tuned:
        path = lookup(cfg.results_file, ["tuning", "selected", "config_path"])
        if not path or not isinstance(path, str):
            last = "its last tune.py sweep was interrupted before it selected" if lookup(
                cfg.results_file, ["tuning", "interrupted"]) else "it has no tuning.selected.config_path"
            raise CompareError(f"--tuned=True but in results file {cfg.results_file} {last}; run tune.py (again: it "
                               f"reuses what it measured), or drop --tuned")
        if not Path(path).is_file():
            raise CompareError(f"the tuned config {path} (tuning.selected.config_path in {cfg.results_file}) "
                               f"does not exist; run tune.py again, or drop --tuned")
        layers.append(str(path))
    try:
        layers += shlex.split(cfg.optimized_overrides)
    except ValueError as exc:
        raise CompareError(f"--optimized_overrides={cfg.optimized_overrides!r} does not parse ({exc}); give "
                           f"space-separated --key=value, quoted as a whole") from None
    # The given config's train keys act as the defaults, so a layer can only set train.py's keys.
    tuned = load_config(given, layers[:1] if cfg.tuned else [])
    opt = load_config(tuned, layers[1:] if cfg.tuned else layers)
    managed = [k for k in ("name", "out_dir", "results_file", "resume", "overwrite") if opt[k] != tuned[k]]
    if managed:
        raise CompareError(f"--optimized_overrides sets {', '.join(managed)}, which compare.py sets for each run; give "
                           f"compare.py's own --name, --out_dir or --results_file")
    sides = []
    for side, c in (("baseline", base), ("optimized", opt)):
        # Separate names and folders, or the two runs would overwrite each other's entry and checkpoint.
        c.update(name=f"{cfg.name}-{side}", results_file=cfg.results_file, **run_folders(cfg, side))
        sides.append(settings.Config(c))
    return sides


def noise_configs(cfg, base):
    """The noise runs to train: the baseline's config at seeds seed+1 .. seed+noise_seed_runs, each under its
    own name (<name>-baseline-seed<N>) and folder."""
    runs = []
    for seed in range(base.seed + 1, base.seed + 1 + cfg.noise_seed_runs):
        folders = run_folders(cfg, f"baseline-seed{seed}")
        runs.append(settings.Config(dict(base, seed=seed, name=seed_run_name(base.name, seed), **folders)))
    return runs


def check_before_training(cfg, sides):
    """Refuse what would fail or mean nothing after hours of training, before starting either run.

    Returns the two recipe identities that train.py will record.
    """
    if not all(c.full_validation for c in sides):
        raise CompareError("the verdict compares the full validation losses; set full_validation=True "
                           "(in the config and in any --optimized_overrides)")
    check_plot_path(plot_file(cfg))
    # micro-batch, mode and scope: the baseline's come from its own keys
    hint = {"baseline": " (the baseline's micro-batch is --baseline_micro_batch_size)"}
    plans = [run_plan(side, c, hint.get(side, "")) for side, c in zip(("baseline", "optimized"), sides)]
    recipes = [p.recipe for p in plans]
    executions = [timed_execution(p.cfg, p.attention, p.device, p.world_size) for p in plans]
    if executions[0] == executions[1]:
        print(f"note: the baseline and the optimized run resolve to the same execution ({execution_summary(sides[1])}"
              f", attention {plans[1].attention} on {plans[1].device}), so the comparison will call no speed-up; "
              f"give the optimized side another execution (--optimized_overrides, --tuned) to measure one")
    differ = settings.recipe_differences(*recipes)
    if differ and not cfg.allow_recipe_change:
        raise CompareError(refusal(sides[0].name, sides[1].name, differ))
    if differ:
        print(f"recipe change allowed: {', '.join(differ)} differ between the runs")
    return [env.hash_json(rec) for rec in recipes]


def refusal(baseline_name, optimized_name, differ):
    fields = ", ".join(differ) if differ else "unknown (an entry has no recipe)"
    return (f"{baseline_name} and {optimized_name} have different recipes (fields that differ: {fields}); a matched "
            f"comparison changes only the execution. Pass --allow_recipe_change=True to compare them as a recipe change")


# ---------------------------------------------------------------- the comparison

def finished_run(results, name, results_file):
    entry = results.get(name)
    if name in SECTIONS or not isinstance(entry, dict) or "recipe_identity" not in entry:
        runs = [k for k in plots.training_runs(results) if k not in SECTIONS]
        raise CompareError(f"results file {results_file} has no run named {name!r}; runs there: "
                           f"{', '.join(runs) or 'none'}")
    fv = entry.get("final_validation")
    if entry.get("status") != "complete":
        raise CompareError(f"run {name} is not complete (status {entry.get('status')!r}); finish it "
                           f"(train.py --resume=True --name={name}) or compare another run")
    if not fv:
        raise CompareError(f"run {name} is complete without a final validation (full_validation was off); train "
                           f"it again with full_validation=True, or compare another run")
    if not isinstance(fv, dict):  # a file edited by hand, or not written by train.py
        raise CompareError(f"run {name}'s final_validation is a {type(fv).__name__}, not train.py's record of it")
    if not plots.finite_number(fv.get("loss")):  # results.py writes a diverged run's NaN as null
        raise CompareError(f"run {name} diverged: its final validation loss is not a finite number, so it matches "
                           f"nothing; lower its learning rate, or compare another run")
    if curve := plots.bad_curve(entry):
        raise CompareError(f"run {name}'s {curve} is not a list of points (objects with a loss), as train.py "
                           f"records it; compare another run")
    missing = [k for k in ("loss_std", "tokens") if not plots.finite_number(fv.get(k))]
    missing += ["tokens"] if not missing and fv["tokens"] <= 0 else []  # a count that divides the error
    if missing:
        raise CompareError(f"run {name}'s final validation has no {' or '.join(missing)}, so no tolerance can be "
                           f"computed; train it again with this train.py")
    return entry


def standard_error(final_validation):
    return final_validation["loss_std"] / math.sqrt(final_validation["tokens"])


def tolerance(fv_a, fv_b):
    """NOISE_SIGMAS standard errors of the difference of two mean per-token validation losses.

    Neighbouring tokens' losses are correlated (same document, same context), so loss_std / sqrt(tokens)
    underestimates each run's standard error: this SE is a lower bound and the test is strict. (Both runs are
    scored on the same tokens, which correlates their errors and would make the true SE of the difference
    smaller again; the rule models neither effect.)
    """
    return NOISE_SIGMAS * math.sqrt(standard_error(fv_a) ** 2 + standard_error(fv_b) ** 2)


def training_noise(results, names, results_file, baseline_name, optimized_name):
    """{name: final validation loss} of the noise runs, and the sample standard deviation of those losses and
    the baseline's.

    A noise run must be the baseline's recipe, its seed aside, and neither of the two runs compared: any other
    run's loss would widen the tolerance with a difference of math (the compared pair as its own noise passes
    whatever their difference; the baseline counts already)."""
    compared = {baseline_name, optimized_name} & set(names)
    if compared:
        raise CompareError(f"--noise_runs names {', '.join(sorted(compared))}, a run being compared; give other "
                           f"runs of the baseline's recipe (repeats, other seeds)")
    baseline = shape_free(results[baseline_name].get("recipe") or {})
    losses = {}
    for n in names:
        entry = finished_run(results, n, results_file)
        differ = [k for k in settings.recipe_differences(baseline, shape_free(entry.get("recipe") or {})) if k != "seed"]
        if differ:
            raise CompareError(f"noise run {n} is not the baseline's recipe (it differs in {', '.join(differ)}); "
                               f"give repeats or other seeds of {baseline_name}'s recipe")
        losses[n] = entry["final_validation"]["loss"]
    return losses, statistics.stdev([results[baseline_name]["final_validation"]["loss"], *losses.values()])


def shape_free(recipe):
    """A recipe without the config's model fields, which older runs recorded beside the resolved "model"
    (dim=0 and dim=320 are one model); the resolved model stays."""
    return {k: v for k, v in recipe.items() if k not in settings.keys_of_role(settings.MODEL)} if "model" in recipe else recipe


def no_noise_reason(noise_seed_runs, baseline_name):
    """Why no training noise is counted, in words: no seed run asked for, or none of them found complete."""
    if not noise_seed_runs:
        return "noise_seed_runs=0 and no --noise_runs"
    return (f"noise_seed_runs={noise_seed_runs}, but no complete {seed_run_name(baseline_name, '<N>')} run was found, "
            f"and no --noise_runs")


def verdict_tolerance(results, results_file, baseline_name, optimized_name, noise_names, noise_seed_runs):
    """The tolerance, its two parts and the rule that made it, as the comparison records them."""
    validation = tolerance(results[baseline_name]["final_validation"], results[optimized_name]["final_validation"])
    why = no_noise_reason(noise_seed_runs, baseline_name)
    fields = {"tolerance": validation, "validation_tolerance": validation, "noise_seed_runs": noise_seed_runs,
              "tolerance_rule": TOLERANCE_RULE + NO_NOISE_RULE.format(why=why)}
    if noise_names:
        losses, std = training_noise(results, noise_names, results_file, baseline_name, optimized_name)
        noise = NOISE_SIGMAS * math.sqrt(2) * std
        fields.update(tolerance=max(validation, noise), tolerance_rule=TOLERANCE_RULE + NOISE_RULE,
                      noise_runs=losses, training_noise_std=std, training_noise_tolerance=noise)
    return fields


def recorded_seed_runs(results, baseline_name, count):
    """The noise seed runs of a finished baseline that the results file holds complete: <baseline>-seed<N> for
    N = its seed + 1 .. its seed + count, as compare.py trains them, with their final validation (time-to-target's
    seed runs have the same names and may have none)."""
    seed = (results[baseline_name].get("config") or {}).get("seed")
    if not isinstance(seed, int):
        return []
    names = [seed_run_name(baseline_name, seed + i) for i in range(1, count + 1)]
    return [n for n in names if isinstance(results.get(n), dict) and results[n].get("status") == "complete"
            and isinstance(results[n].get("final_validation"), dict)]


# ---------------------------------------------------------------- the speed

def timed_execution(cfg, attention, device, world_size):
    """How a run executes, as far as its training rate can tell: its execution keys (validation's aside), with the
    attention backend and device that ran ("auto" resolved), and its process count."""
    ran = {k: cfg.get(k) for k in sorted(settings.execution_keys()) if k not in UNTIMED_KEYS}
    return dict(ran, attention_backend=attention, device=device, world_size=world_size)


def recorded_execution(entry):
    """timed_execution of a finished run, from what its entry records; None when it records no config."""
    cfg = entry.get("config")
    if not isinstance(cfg, dict):
        return None
    cfg = {RENAMED_KEYS.get(k, k): v for k, v in cfg.items()}  # an older entry's keys by their names now
    device, environment = cfg.get("device"), entry.get("environment")
    if device == "auto" and isinstance(environment, dict):  # "auto" ran on the GPU exactly when there was one
        device = "cuda" if environment.get("gpu") else "cpu"
    return timed_execution(cfg, entry.get("attention") or cfg.get("attention_backend"), device,
                           entry.get("world_size", 1))


def training_rate(entry):
    rate = entry.get("median_training_tokens_per_second")
    return rate if plots.finite_number(rate) and rate > 0 else None  # a rate, or none to compare


def interval_quartiles(entry):
    """[q1, q3] of a run's interval rates (tok/s of each log interval); None under MIN_INTERVALS of them."""
    listed = entry.get("interval_tokens_per_second")
    rates = [r for r in listed if plots.finite_number(r) and r > 0] if isinstance(listed, list) else []
    if len(rates) < MIN_INTERVALS:
        return None
    q1, _, q3 = statistics.quantiles(rates, n=4, method="inclusive")
    return [q1, q3]


def speed_band(ratio, between, quartiles):
    """(low, high) of the ratio: the wider of ratio * exp(+-between) and the quartiles' [o_q1 / b_q3, o_q3 / b_q1];
    (None, None) when neither is measured."""
    lows, highs = [], []
    if between is not None:
        lows.append(ratio * math.exp(-between))
        highs.append(ratio * math.exp(between))
    if quartiles["baseline"] and quartiles["optimized"]:
        (b1, b3), (o1, o3) = quartiles["baseline"], quartiles["optimized"]
        lows.append(o1 / b3)
        highs.append(o3 / b1)
    return (min(lows + [ratio]), max(highs + [ratio])) if lows else (None, None)


def speed_call(ratio, low, high, differences):
    if ratio is None:
        return "no rate"
    if differences == []:
        return "same execution"
    if low is None:
        return "noise not measured"
    return "faster" if low > 1 else "slower" if high < 1 else "within noise"


def speed_comparison(results, baseline_name, optimized_name, noise_names):
    """The comparison's speed fields: the ratio of median training tok/s, its noise band (the rates of the baseline
    and its noise runs of the same execution, and each run's interval rates), whether the two sides run the same
    execution, and the verdict on it."""
    b, o = results[baseline_name], results[optimized_name]
    rb, ro = training_rate(b), training_rate(o)
    ratio = ro / rb if rb and ro else None
    eb, eo = recorded_execution(b), recorded_execution(o)
    differences = None if eb is None or eo is None else [k for k in eb if eb[k] != eo.get(k)]
    # only noise runs of the baseline's execution: a repeat under another execution times that execution
    rates = {n: training_rate(results[n]) for n in noise_names if eb and recorded_execution(results[n]) == eb}
    rates = {baseline_name: rb, **{n: r for n, r in rates.items() if r}} if rb else {}
    logs = [math.log(r) for r in rates.values()]
    between = SPEED_SIGMAS * math.sqrt(2) * statistics.stdev(logs) if len(logs) > 1 else None
    quartiles = {"baseline": interval_quartiles(b), "optimized": interval_quartiles(o)}
    low, high = speed_band(ratio, between, quartiles) if ratio else (None, None)
    return {"speed_ratio": ratio, "speed_ratio_low": low, "speed_ratio_high": high,
            "speed_noise": {"between_runs": between, "rates": rates, "interval_quartiles": quartiles},
            "same_execution": None if differences is None else not differences,
            "execution_differences": differences, "speed_verdict": speed_call(ratio, low, high, differences),
            "speed_rule": SPEED_RULE}


def run_summary(entry):
    curve = [{k: p.get(k) for k in ("epoch", "tokens", "loss", "seconds", "training_seconds")}
             for p in entry.get("validation_curve") or []]
    return {"median_training_tokens_per_second": entry.get("median_training_tokens_per_second"),
            "validation_curve": curve, "final_validation": entry["final_validation"],
            "result": {k: v for k, v in entry.items() if k not in BULKY}}


def compare_runs(results_file, baseline_name, optimized_name, allow_recipe_change, plot_path, noise_runs="",
                 seed_runs=None, noise_seed_runs=1):
    """Compare two finished runs, record results["matched-comparison"], print the table; returns the entry.

    The noise runs are seed_runs (those just trained; None: the baseline's seed runs the results file holds, up
    to noise_seed_runs) and the comma-separated noise_runs."""
    if baseline_name == optimized_name:
        raise CompareError(f"--baseline and --optimized both name {baseline_name!r}; compare two different runs")
    results = read_results(results_file)
    b = finished_run(results, baseline_name, results_file)
    o = finished_run(results, optimized_name, results_file)
    identity_equal = b["recipe_identity"] == o["recipe_identity"]
    differ = settings.recipe_differences(b.get("recipe") or {}, o.get("recipe") or {})
    if not identity_equal and not allow_recipe_change:
        raise CompareError(refusal(baseline_name, optimized_name, differ))
    if seed_runs is None:
        seed_runs = recorded_seed_runs(results, baseline_name, noise_seed_runs)
    names = list(dict.fromkeys([*seed_runs, *(n.strip() for n in noise_runs.split(",") if n.strip())]))
    tol = verdict_tolerance(results, results_file, baseline_name, optimized_name, names, noise_seed_runs)
    difference = o["final_validation"]["loss"] - b["final_validation"]["loss"]
    agree = abs(difference) <= tol["tolerance"]
    comparison = {
        # under "runs": a run named like a field of the comparison ("baseline", "plot") would overwrite it
        "runs": {baseline_name: run_summary(b), optimized_name: run_summary(o)},
        **speed_comparison(results, baseline_name, optimized_name, names),
        "loss_difference": difference,
        **tol,
        "recipe_identity_equal": identity_equal,
        "recipe_differences": differ,
        "losses_agree": agree,
        "recipe_equal_except_execution": identity_equal and agree,
        "label": "matched run" if identity_equal else "recipe change",
        "plot": str(plot_path),
        "baseline": baseline_name,
        "optimized": optimized_name,
        "run_id": env.new_run_id(),
    }
    record(results_file, ["matched-comparison"], comparison)
    print_table(comparison, b, o)
    plots.save_plot(plot_path, [(baseline_name, b), (optimized_name, o)])
    print(f"recorded matched-comparison in {results_file}; plot {plot_path}")
    return comparison


# ---------------------------------------------------------------- the table

# Execution keys that say how the update ran (the others name files, logging and stopping).
SHOWN_EXECUTION = ("compile_mode", "compile_scope", "attention_backend", "loss_impl", "loss_chunk_tokens",
                   "mlp_impl", "update_graph", "activation_memory_budget", "cpu_threads")


def execution_summary(cfg):
    """'mb 32, compile True, loss_impl fused, ...': the micro-batch, compile, and every shown key off its default."""
    changed = [f"{k} {cfg[k]}" for k in SHOWN_EXECUTION if k in cfg and cfg[k] != TRAIN_DEFAULTS[k]]
    return ", ".join([f"mb {cfg.get('micro_batch_size', '?')}", f"compile {cfg.get('compile', '?')}"] + changed)


def table_rows(entry):
    fv = entry["final_validation"]
    cfg = entry.get("config") or {}
    best = entry.get("best_subset_loss")
    peak = entry.get("peak_memory_bytes")
    return [
        ("status", entry.get("status")),
        ("execution", execution_summary(cfg)),
        ("recipe identity", entry["recipe_identity"][:12]),
        ("updates", f"{entry.get('step')}/{entry.get('total_updates')}"),
        ("tokens", plots.fmt(entry.get("tokens"), ",")),
        ("final validation loss", f"{fv['loss']:.4f} ± {standard_error(fv):.4f}"),
        ("best subset loss", f"{best:.4f} (epoch {entry.get('best_epoch')})" if best is not None else "-"),
        ("median training tok/s", plots.fmt(entry.get("median_training_tokens_per_second"), ",.0f")),
        ("training seconds", plots.fmt(entry.get("training_seconds"), ".1f")),
        ("elapsed seconds", plots.fmt(entry.get("training_elapsed_seconds"), ".1f")),
        ("peak memory", plots.fmt(peak / 2**30 if plots.finite_number(peak) else None, ".2f", " GiB")),
    ]


def verdict(comparison):
    if comparison["label"] == "recipe change":
        differ = ", ".join(comparison["recipe_differences"]) or "recipe identity"
        return (f"recipe change ({differ}): not a matched run; "
                f"losses {'agree within' if comparison['losses_agree'] else 'differ beyond'} the tolerance")
    if comparison["losses_agree"]:
        if comparison["speed_verdict"] == "faster":
            return (f"matched run: same recipe, losses agree; the {comparison['speed_ratio']:.2f}x speed-up "
                    f"({speed_band_text(comparison)}) kept the math")
        return f"matched run: same recipe, losses agree; the execution kept the math; {speed_words(comparison)}"
    text = "matched run, but the losses differ beyond the tolerance: not shown to keep the math"
    runs = len(comparison.get("noise_runs") or {})
    if not runs:
        return text + " (training noise not counted: no noise run)"
    if runs < FIRM_NOISE_RUNS:  # with execution noise as large as a seed's, at most 1 in 5 (1 run) or 10 (2) fails
        text += (f" (with {runs} noise run{'' if runs == 1 else 's'} the training noise is a rough estimate: "
                 f"--noise_seed_runs={FIRM_NOISE_RUNS} would firm the verdict up)")
    return text


def tolerance_sources(comparison):
    """The tolerance's parts in words: the validation noise, and the training noise with its standard deviation
    and the runs behind it."""
    text = f"validation noise ±{comparison['validation_tolerance']:.5f}"
    if "noise_runs" not in comparison:
        why = no_noise_reason(comparison["noise_seed_runs"], comparison["baseline"])
        return text + f"; training noise not measured ({why})"
    runs = comparison["noise_runs"]
    noise, std = comparison["training_noise_tolerance"], comparison["training_noise_std"]
    return (text + f", training noise ±{noise:.5f} (s {std:.5f} over the baseline and {len(runs)} noise "
            f"run{'s' if len(runs) > 1 else ''}: {', '.join(runs)})")


def speed_band_text(comparison):
    low, high = comparison["speed_ratio_low"], comparison["speed_ratio_high"]
    return f"noise band {low:.2f}x to {high:.2f}x" if low else "noise not measured"


def speed_words(comparison):
    """The speed verdict in words."""
    call, ratio = comparison["speed_verdict"], comparison["speed_ratio"]
    if call == "no rate":
        return "no speed ratio: a run records no training rate"
    if call == "same execution":
        return f"the two sides run the same execution: no speed-up (their {ratio:.2f}x is noise)"
    if call == "noise not measured":
        return (f"{ratio:.2f}x, but the speed's noise is not measured (no noise run of the baseline's execution, and "
                f"under {MIN_INTERVALS} log intervals in a run): no speed-up called")
    if call == "within noise":
        return f"no speed difference outside the noise ({ratio:.2f}x, {speed_band_text(comparison)})"
    return f"{ratio:.2f}x, {call} outside the noise ({speed_band_text(comparison)})"


def speed_sources(comparison):
    """The speed's noise band from: the runs of the baseline's execution, and each run's interval rates."""
    noise = comparison["speed_noise"]
    runs = [n for n in noise["rates"] if n != comparison["baseline"]]
    between = (f"between runs a factor {math.exp(noise['between_runs']):.3f} (the baseline and {', '.join(runs)})"
               if noise["between_runs"] is not None else "between runs not measured (no noise run of its execution)")
    quartiles = noise["interval_quartiles"]
    within = ("within runs: interval tok/s quartiles " + " | ".join(
        f"{q[0]:,.0f} to {q[1]:,.0f}" if q else f"under {MIN_INTERVALS} intervals"
        for q in (quartiles["baseline"], quartiles["optimized"])))
    same = {True: "same execution", False: f"executions differ in {', '.join(comparison['execution_differences'] or [])}",
            None: "execution unknown (an entry records no config)"}[comparison["same_execution"]]
    return f"{between}; {within}; {same}"


def print_table(comparison, baseline, optimized):
    """The two runs side by side, then the speed ratio, the loss difference, the tolerance and the verdict."""
    rows_b, rows_o = table_rows(baseline), table_rows(optimized)
    width = max(len(str(v)) for _, v in rows_b + [("", comparison["baseline"])])
    lines = [f"{'':>22}  {comparison['baseline']:<{width}}  {comparison['optimized']}"]
    lines += [f"{k:>22}  {str(vb):<{width}}  {vo}" for (k, vb), (_, vo) in zip(rows_b, rows_o)]
    ratio, within = plots.fmt(comparison["speed_ratio"], ".2f", "x"), "within" if comparison["losses_agree"] else "OUTSIDE"
    lines += [f"{'speed ratio':>22}  {ratio} (optimized / baseline median training tok/s; "
              f"{speed_band_text(comparison)})",
              f"{'speed noise from':>22}  {speed_sources(comparison)}",
              f"{'speed verdict':>22}  {speed_words(comparison)}",
              f"{'loss difference':>22}  {comparison['loss_difference']:+.5f} (tolerance ±{comparison['tolerance']:.5f}: "
              f"{within})",
              f"{'tolerance from':>22}  {tolerance_sources(comparison)}",
              f"{'verdict':>22}  {verdict(comparison)}"]
    print("\n".join(lines))


# ---------------------------------------------------------------- the mode

def plot_file(cfg):
    return cfg.plot or f"out/{cfg.name}-comparison.png"


# The matched mode's keys that only shape the runs to train, and train.py's keys that comparing two finished runs
# reads (the default plot's name, the results file).
TRAINING_MATCHED_KEYS = ("tuned", "optimized_overrides", "baseline_micro_batch_size")
READ_ONLY_TRAIN_KEYS = ("name", "results_file")


def training_keys_given(cfg):
    """The keys off their defaults that only shape runs to train: compare.py's --rerun (off by default), the
    matched mode's, and train.py's but those the read-only comparison reads."""
    matched = {f.name: f.default for f in dataclasses.fields(Matched) if f.name in TRAINING_MATCHED_KEYS}
    train = {k: v for k, v in TRAIN_DEFAULTS.items() if k not in READ_ONLY_TRAIN_KEYS}
    return (["--rerun"] if cfg.rerun else []) + [f"--{k}" for k, v in {**matched, **train}.items() if cfg[k] != v]


def matched_mode(cfg):
    """Train (or reuse) the baseline, the optimized run and the noise runs, or take two finished runs; record the
    comparison, print the table and draw the plot; returns the comparison."""
    plot = plot_file(cfg)
    if cfg.baseline or cfg.optimized:
        if not (cfg.baseline and cfg.optimized):
            raise CompareError("give both --baseline=NAME and --optimized=NAME to compare finished runs, or neither "
                               "to train them")
        if given := training_keys_given(cfg):
            raise CompareError(f"with --baseline and --optimized nothing is trained, so drop what only shapes a "
                               f"training run: {', '.join(given)} (on the command line or in a config file)")
        check_plot_path(plot)
        return compare_runs(cfg.results_file, cfg.baseline, cfg.optimized, cfg.allow_recipe_change, plot,
                            cfg.noise_runs, noise_seed_runs=cfg.noise_seed_runs)
    sides = side_configs(cfg)
    noise = noise_configs(cfg, sides[0])
    identities = check_before_training(cfg, sides)
    # The noise runs last: a stop or a failure then leaves the compared pair done first.
    identities += [env.hash_json(run_recipe("noise", c)) for c in noise]
    train_all(cfg, zip(["baseline", "optimized"] + ["noise"] * len(noise), sides + noise, identities))
    return compare_runs(cfg.results_file, sides[0].name, sides[1].name, cfg.allow_recipe_change, plot,
                        cfg.noise_runs, seed_runs=[c.name for c in noise], noise_seed_runs=cfg.noise_seed_runs)
