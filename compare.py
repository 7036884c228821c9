"""Matched runs: prove that a faster execution of a recipe kept its math. Or (--mode=time-to-target) time a recipe
to a target loss, as a speed record is timed.

    python compare.py config/20m_gh200.py                  # train a plain baseline, its noise run and the config
    python compare.py config/20m_gh200.py --tuned=True      # the optimized side takes tune.py's selected config
    python compare.py config/tiny_cpu.py --full_validation=True --optimized_overrides="--loss_impl=fused"  # a lever
    python compare.py --baseline=NAME --optimized=NAME      # compare two finished runs of the results file
    python compare.py config/20m_gh200.py --optimizer=muon --name=20m-muon --mode=time-to-target --target_loss=L \\
        --eval_interval=50 --target_baseline=config/20m_gh200.py    # 5 seeds to L, and the speed-up to it

Matched (the default): the baseline runs the config plainly (eager, micro-batch `baseline_micro_batch_size`, SDPA's
attention, full loss), with `noise_seed_runs` runs of it at other seeds for the training noise; the optimized run is
the config as given. The pair is matched when both have the same recipe identity (train.recipe: every key that
changes the math) and their final validation losses agree within a tolerance of validation and training noise
(docs/MATCHED_RUNS.md: the rule and how far to trust it). The verdict goes to results["matched-comparison"], with a
plot of the runs' loss curves.

Time to target (docs/TIME_TO_QUALITY.md): the config trained at `seeds` seeds, each to its end, reaches the target
when every seed ends below it and a one-sided t-test puts their mean below it at p < 0.01; its time is their median
training seconds, and a baseline recipe's (--target_baseline) time to the target over it is the speed-up. The
verdict goes to results["time-to-target"][name], with a plot; exit status 0 when the target is reached, 1 when it is
missed.

Runs are train.py subprocesses (runs.py), one after the other (never at once: their speeds are part of the result).
An existing complete run with the same name, config and source hash (the same code) is reused unless
--rerun=True; a stopped one (status interrupted, its checkpoint in place) is resumed; any other is trained
afresh over its old checkpoint. SIGINT or SIGTERM is passed to the running train.py, which checkpoints and
stops (status interrupted); compare.py then stops with a line saying how to resume.
Exit status: 0 when the comparison is recorded and holds (or is an allowed recipe change), 1 when a matched
run's losses disagree or a training run failed, 2 on a user mistake, 3 when stopped by a signal (SIGINT too)
or by a run's stop_after_updates: train.py's status for a checkpointed stop (130: Ctrl-C while no run trains).
"""
import dataclasses
import math
import shlex
import statistics
import sys
from pathlib import Path

import env
import plots
import time_to_target
import train
from data.loader import CacheError
import settings
from configurator import ConfigError, load_config
from settings import TrainSettings, setting
from results import check_writable, lookup, read_results, record
from runs import RunFailed, Stopped, train_all

# ---------------------------------------------------------------- settings (train.py's keys are accepted too)

MODES = ("matched", "time-to-target")
# Each mode's own keys: the other mode refuses them off their defaults.
MATCHED_KEYS = ("baseline", "optimized", "tuned", "optimized_overrides", "allow_recipe_change",
                "baseline_micro_batch_size", "noise_seed_runs", "noise_runs")
TARGET_KEYS = ("seeds", "target_baseline", "target_baseline_seeds")


def at_least_two_seeds(seeds):
    return None if seeds >= 2 else (f"seeds {seeds} cannot pass: the t-test needs at least 2 runs (5 is the "
                                    f"default)")


@dataclasses.dataclass
class CompareSettings(TrainSettings):
    mode: str = setting("matched", "matched: a baseline and an optimized run of one recipe, the same math (the keys "
                                   "below up to noise_runs); time-to-target: the config at several seeds against "
                                   "target_loss, beside a baseline recipe (seeds, target_baseline, "
                                   "target_baseline_seeds; docs/TIME_TO_QUALITY.md)", choices=MODES)
    baseline: str = setting("", "with optimized: compare these two finished runs, train nothing")
    optimized: str = setting("", "see baseline")
    tuned: bool = setting(False, 'layer results["tuning"]["selected"]["config_path"] on the optimized side')
    optimized_overrides: str = setting("", "space-separated --key=value for the optimized run only (a lever to try)")
    allow_recipe_change: bool = setting(False, 'compare runs whose recipes differ, labelled "recipe change"')
    baseline_micro_batch_size: int = setting(8, "the plain baseline's micro-batch", bounds=">= 1")
    plot: str = setting("", '"" means out/<name>-comparison.png (out/<name>-time-to-target.png in that mode)')
    rerun: bool = setting(False, "train again even when a complete run of the same config exists")
    noise_seed_runs: int = setting(1, "runs of the baseline at seeds seed+1, seed+2, ... (<name>-baseline-seed<N>) "
                                      "whose spread of final validation loss with the baseline's measures training "
                                      "noise; 0: none (then give --noise_runs, or only validation noise counts)",
                                   bounds=">= 0")
    noise_runs: str = setting("", "comma-separated finished runs (repeats, other seeds) that measure it too, beside "
                                  "the seed runs; each the baseline's recipe, its seed aside, and not a compared run")
    # time-to-target: the config's runs at several seeds, to train.py's target_loss
    seeds: int = setting(5, "time-to-target: runs of the config at seed, seed+1, ... (<name>-seed<N>), each to its "
                            "end; the one-sided t-test passes at p < 0.01, which needs a mean 3.7 standard errors "
                            "below the target with 5 runs, about 7 with 3, 32 with 2", rule=at_least_two_seeds)
    target_baseline: str = setting("", "time-to-target: the baseline recipe's config file (such as "
                                       "config/20m_gh200.py), run as it is with this eval_interval and target, "
                                       "stopping there: its time to the target over the config's median time is "
                                       "the speed-up (\"\": none)")
    target_baseline_seeds: int = setting(1, "time-to-target: runs of target_baseline at its seed, seed+1, ... "
                                            "(<name>-target-baseline-seed<N>)", bounds=">= 1")

    @staticmethod
    def rules(cfg):
        """Each mode refuses the other's keys (off their defaults), so that no key is silently ignored."""
        if cfg.mode == "matched":
            off = off_defaults(cfg, TARGET_KEYS)
            if off:
                raise ConfigError(f"{', '.join(off)} belong to --mode=time-to-target; add it, or drop them")
            return
        if not cfg.target_loss:
            raise ConfigError("--mode=time-to-target needs --target_loss=L > 0: the validation-subset loss the "
                              "config's seeds must end below")
        off = off_defaults(cfg, MATCHED_KEYS)
        if off:
            raise ConfigError(f"{', '.join(off)} belong to --mode=matched; drop them with --mode=time-to-target")
        if cfg.stop_at_target:
            raise ConfigError("stop_at_target is refused with --mode=time-to-target: a seed's time is its whole "
                              "recipe's training time, as a record's is (the baseline alone stops at the target)")


def off_defaults(cfg, keys):
    return [f"--{k}" for k in keys if cfg[k] != settings.field_of(CompareSettings, k).default]


DEFAULTS = settings.defaults(CompareSettings)

# How the baseline executes: the plainest way, whatever the config asks for ("auto" attention can be fa4).
BASELINE_EXECUTION = {"compile": False, "attention_backend": "sdpa", "loss_impl": "full"}
# Bulky fields of a run's entry that the comparison leaves out (the run's own entry keeps them).
BULKY = ("environment", "config", "recipe")
NOISE_SIGMAS = 3  # standard deviations of a difference of two runs that the training-noise tolerance allows
FIRM_NOISE_RUNS = 3  # noise runs under which a failed verdict suggests more: P(|t_3| > 3) = 0.06 at worst
TOLERANCE_RULE = ("|optimized - baseline| final validation loss <= the larger of the validation noise, 3 * "
                  "sqrt(se_baseline^2 + se_optimized^2) with se = loss_std / sqrt(tokens) of each run's full "
                  "validation (neighbouring tokens' losses are correlated, so this is a lower bound)")
NOISE_RULE = ("; and the training noise, 3 * sqrt(2) * s with s the sample standard deviation of the final "
              "validation losses of the baseline and its noise runs (its recipe at other seeds, or repeats): "
              "3 * |d| for one noise run, d the difference of the two baseline runs. A single difference is a "
              "one-degree-of-freedom estimate (a same-math run whose execution noise is as large as a seed's "
              "exceeds it with probability 0.20; 0.06 with three noise runs), and the validation noise is the "
              "floor under one that happens to be small")
NO_NOISE_RULE = ("; no noise run was given (noise_seed_runs=0 and no --noise_runs), so training noise is not "
                 "counted, and two executions of one recipe can differ by more than this")


class CompareError(ValueError):
    """A comparison that cannot be made as asked: a user mistake, reported in one line."""


# ---------------------------------------------------------------- the runs' configs

def side_configs(cfg):
    """(baseline, optimized) train.py configs of one recipe, named <name>-baseline and <name>-optimized."""
    given = {k: cfg[k] for k in train.DEFAULTS}
    base = dict(given, micro_batch_size=cfg.baseline_micro_batch_size, **BASELINE_EXECUTION)
    layers = []
    if cfg.tuned:
        path = lookup(cfg.results_file, ["tuning", "selected", "config_path"])
        if not path or not isinstance(path, str):
            raise CompareError(f"--tuned=True but results file {cfg.results_file} has no tuning.selected.config_path; "
                               f"run tune.py first, or drop --tuned")
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
    opt = load_config(given, layers)
    sides = []
    for side, c in (("baseline", base), ("optimized", opt)):
        # Separate names and folders, or the two runs would overwrite each other's entry and checkpoint.
        c.update(name=f"{cfg.name}-{side}", results_file=cfg.results_file, **run_folders(cfg, side))
        sides.append(train.Config(c))
    return sides


def run_folders(cfg, side):
    """A run's own out_dir ("" for out/<its name>) and TensorBoard folder, so that no two runs share one."""
    return {"out_dir": str(Path(cfg.out_dir) / side) if cfg.out_dir else "",
            "tensorboard_dir": str(Path(cfg.tensorboard_dir) / side) if cfg.get("tensorboard_dir") else ""}


def seed_run_name(baseline_name, seed):
    return f"{baseline_name}-seed{seed}"


def noise_configs(cfg, base):
    """The noise runs to train: the baseline's config at seeds seed+1 .. seed+noise_seed_runs, each under its
    own name (<name>-baseline-seed<N>) and folder."""
    runs = []
    for seed in range(base.seed + 1, base.seed + 1 + cfg.noise_seed_runs):
        folders = run_folders(cfg, f"baseline-seed{seed}")
        runs.append(train.Config(dict(base, seed=seed, name=seed_run_name(base.name, seed), **folders)))
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
    recipes = [run_recipe(side, c, hint.get(side, "")) for side, c in zip(("baseline", "optimized"), sides)]
    differ = train.recipe_differences(*recipes)
    if differ and not cfg.allow_recipe_change:
        raise CompareError(refusal(sides[0].name, sides[1].name, differ))
    if differ:
        print(f"recipe change allowed: {', '.join(differ)} differ between the runs")
    return [env.hash_json(rec) for rec in recipes]


def run_recipe(side, c, hint=""):
    """The recipe train.py will record for run c; what train.py would refuse is refused now, in one line."""
    try:
        settings.resolve_device(c)  # a GPU config without a GPU: one line, before hours of CPU training
        try:
            train.check_execution(c)
        except ConfigError as exc:
            raise ConfigError(f"{exc}{hint}") from None
        return train.setup(c)[2]
    except (ConfigError, CacheError) as exc:
        raise CompareError(f"{side} run: {exc}") from None


def refusal(baseline_name, optimized_name, differ):
    fields = ", ".join(differ) if differ else "unknown (an entry has no recipe)"
    return (f"{baseline_name} and {optimized_name} have different recipes (fields that differ: {fields}); a matched "
            f"comparison changes only the execution. Pass --allow_recipe_change=True to compare them as a recipe change")


# ---------------------------------------------------------------- the comparison

def finished_run(results, name, results_file):
    entry = results.get(name)
    if name in settings.RESERVED_NAMES or not isinstance(entry, dict) or "recipe_identity" not in entry:
        runs = [k for k in plots.training_runs(results) if k not in settings.RESERVED_NAMES]
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
    """Three standard errors of the difference of two mean per-token validation losses.

    Neighbouring tokens' losses are correlated (same document, same context), so loss_std / sqrt(tokens)
    underestimates each run's standard error: this SE is a lower bound and the test is strict. (Both runs are
    scored on the same tokens, which correlates their errors and would make the true SE of the difference
    smaller again; the rule models neither effect.)
    """
    return 3 * math.sqrt(standard_error(fv_a) ** 2 + standard_error(fv_b) ** 2)


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
        differ = [k for k in train.recipe_differences(baseline, shape_free(entry.get("recipe") or {})) if k != "seed"]
        if differ:
            raise CompareError(f"noise run {n} is not the baseline's recipe (it differs in {', '.join(differ)}); "
                               f"give repeats or other seeds of {baseline_name}'s recipe")
        losses[n] = entry["final_validation"]["loss"]
    return losses, statistics.stdev([results[baseline_name]["final_validation"]["loss"], *losses.values()])


def shape_free(recipe):
    """A recipe without the config's model fields, which older runs recorded beside the resolved "model"
    (dim=0 and dim=320 are one model); the resolved model stays."""
    return {k: v for k, v in recipe.items() if k not in settings.keys_of_role(settings.MODEL)} if "model" in recipe else recipe


def verdict_tolerance(results, results_file, baseline_name, optimized_name, noise_names):
    """The tolerance, its two parts and the rule that made it, as the comparison records them."""
    validation = tolerance(results[baseline_name]["final_validation"], results[optimized_name]["final_validation"])
    fields = {"tolerance": validation, "validation_tolerance": validation,
              "tolerance_rule": TOLERANCE_RULE + NO_NOISE_RULE}
    if noise_names:
        losses, std = training_noise(results, noise_names, results_file, baseline_name, optimized_name)
        noise = NOISE_SIGMAS * math.sqrt(2) * std
        fields.update(tolerance=max(validation, noise), tolerance_rule=TOLERANCE_RULE + NOISE_RULE,
                      noise_runs=losses, training_noise_std=std, training_noise_tolerance=noise)
    return fields


def recorded_seed_runs(results, baseline_name, count):
    """The noise seed runs of a finished baseline that the results file holds complete: <baseline>-seed<N> for
    N = its seed + 1 .. its seed + count, as compare.py trains them."""
    seed = (results[baseline_name].get("config") or {}).get("seed")
    if not isinstance(seed, int):
        return []
    names = [seed_run_name(baseline_name, seed + i) for i in range(1, count + 1)]
    return [n for n in names if isinstance(results.get(n), dict) and results[n].get("status") == "complete"]


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
    differ = train.recipe_differences(b.get("recipe") or {}, o.get("recipe") or {})
    if not identity_equal and not allow_recipe_change:
        raise CompareError(refusal(baseline_name, optimized_name, differ))
    if seed_runs is None:
        seed_runs = recorded_seed_runs(results, baseline_name, noise_seed_runs)
    names = list(dict.fromkeys([*seed_runs, *(n.strip() for n in noise_runs.split(",") if n.strip())]))
    tol = verdict_tolerance(results, results_file, baseline_name, optimized_name, names)
    difference = o["final_validation"]["loss"] - b["final_validation"]["loss"]
    agree = abs(difference) <= tol["tolerance"]
    rb, ro = (e.get("median_training_tokens_per_second") for e in (b, o))
    rb, ro = (r if plots.finite_number(r) and r > 0 else None for r in (rb, ro))  # a rate, or none to compare
    comparison = {
        baseline_name: run_summary(b),
        optimized_name: run_summary(o),
        "speed_ratio": ro / rb if rb and ro else None,
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
    changed = [f"{k} {cfg[k]}" for k in SHOWN_EXECUTION if k in cfg and cfg[k] != train.DEFAULTS[k]]
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
        speed = f"the {comparison['speed_ratio']:.2f}x speed" if comparison["speed_ratio"] else "the execution"
        return f"matched run: same recipe, losses agree; {speed} kept the math"
    text = "matched run, but the losses differ beyond the tolerance: not shown to keep the math"
    runs = len(comparison.get("noise_runs") or {})
    if not runs:
        return text + " (training noise not counted: no noise run)"
    if runs < FIRM_NOISE_RUNS:  # with execution noise as large as a seed's, 1 in 5 (1 run) or 10 (2) fails
        text += (f" (with {runs} noise run{'' if runs == 1 else 's'} the training noise is a rough estimate: "
                 f"--noise_seed_runs={FIRM_NOISE_RUNS} would firm the verdict up)")
    return text


def tolerance_sources(comparison):
    """'validation noise ±0.012, training noise ±0.034 (s 0.008 over the baseline and 1 noise run: ...)'."""
    text = f"validation noise ±{comparison['validation_tolerance']:.5f}"
    if "noise_runs" not in comparison:
        return text + "; training noise not measured (noise_seed_runs=0, no --noise_runs)"
    runs = comparison["noise_runs"]
    noise, std = comparison["training_noise_tolerance"], comparison["training_noise_std"]
    return (text + f", training noise ±{noise:.5f} (s {std:.5f} over the baseline and {len(runs)} noise "
            f"run{'s' if len(runs) > 1 else ''}: {', '.join(runs)})")


def print_table(comparison, baseline, optimized):
    """The two runs side by side, then the speed ratio, the loss difference, the tolerance and the verdict."""
    rows_b, rows_o = table_rows(baseline), table_rows(optimized)
    width = max(len(str(v)) for _, v in rows_b + [("", comparison["baseline"])])
    lines = [f"{'':>22}  {comparison['baseline']:<{width}}  {comparison['optimized']}"]
    lines += [f"{k:>22}  {str(vb):<{width}}  {vo}" for (k, vb), (_, vo) in zip(rows_b, rows_o)]
    ratio, within = plots.fmt(comparison["speed_ratio"], ".2f", "x"), "within" if comparison["losses_agree"] else "OUTSIDE"
    lines += [f"{'speed ratio':>22}  {ratio} (optimized / baseline median training tok/s)",
              f"{'loss difference':>22}  {comparison['loss_difference']:+.5f} (tolerance ±{comparison['tolerance']:.5f}: "
              f"{within})",
              f"{'tolerance from':>22}  {tolerance_sources(comparison)}",
              f"{'verdict':>22}  {verdict(comparison)}"]
    print("\n".join(lines))


def check_plot_path(path):
    """Refuse a plot path matplotlib cannot write, before anything is trained or compared."""
    try:
        plots.check_path(path, "--plot")
    except plots.PlotError as exc:
        raise CompareError(str(exc)) from None


# ---------------------------------------------------------------- time to a target (--mode=time-to-target)

# What decides the tokens a validation-subset loss averages (the cache aside): a target is one loss on one set.
MEASUREMENT_KEYS = ("val_subset_tokens", "seq_len")


def target_configs(cfg):
    """The config's runs at seeds seed .. seed+seeds-1, each under its own name (<name>-seed<N>) and folder, trained
    to their end with this eval_interval and target_loss: a seed's time is the whole recipe's, as a record's is."""
    given = {k: cfg[k] for k in train.DEFAULTS}
    return [train.Config(dict(given, seed=s, name=seed_run_name(cfg.name, s), results_file=cfg.results_file,
                              **run_folders(cfg, f"seed{s}")))
            for s in range(cfg.seed, cfg.seed + cfg.seeds)]


def target_baseline_configs(cfg):
    """The baseline recipe's runs: its config file as it is (its execution too), at its seed .. seed +
    target_baseline_seeds - 1 (<name>-target-baseline-seed<N>), with this eval_interval and target_loss, stopping at
    the target: its time to first reach it is all that is measured, and the updates after it would not change it."""
    if not cfg.target_baseline:
        return []
    if not Path(cfg.target_baseline).is_file():
        raise CompareError(f"--target_baseline {cfg.target_baseline} is not a file; give the baseline recipe's "
                           f"config file, such as config/20m_gh200.py")
    try:
        base = load_config(train.DEFAULTS, [cfg.target_baseline])
    except ConfigError as exc:
        raise CompareError(f"--target_baseline: {exc}") from None
    runs = []
    for s in range(base["seed"], base["seed"] + cfg.target_baseline_seeds):
        side = f"target-baseline-seed{s}"
        runs.append(train.Config(dict(base, seed=s, name=f"{cfg.name}-{side}", results_file=cfg.results_file,
                                      eval_interval=cfg.eval_interval, target_loss=cfg.target_loss,
                                      stop_at_target=True, **run_folders(cfg, side))))
    return runs


def check_target_runs(cfg, candidates, baselines):
    """Every run's checks before any trains; returns their recipe identities. A baseline whose validation-subset
    loss averages other tokens (another cache, subset or context) is refused: its loss is another quantity."""
    # the baseline's keys are its file's alone: an error about them is fixed there, not on this command line
    side = f"target baseline (as {cfg.target_baseline} sets it)"
    recipes = [run_recipe("candidate", c) for c in candidates] + [run_recipe(side, c) for c in baselines]
    if baselines:
        c, b = candidates[0], baselines[0]
        devices = [settings.resolve_device(x) for x in (c, b)]
        if devices[0] != devices[1]:
            raise CompareError(f"the config trains on {devices[0]} and --target_baseline {cfg.target_baseline} on "
                               f"{devices[1]}: times on two devices say nothing of the recipes; set one device")
        differ = [f"{k} {c[k]} against {b[k]}" for k in MEASUREMENT_KEYS if c[k] != b[k]]
        if recipes[0]["cache_identity"] != recipes[len(candidates)]["cache_identity"]:
            differ.insert(0, f"data_dir {c.data_dir} against {b.data_dir} (another cache)")
        if differ:
            raise CompareError(f"--target_baseline {cfg.target_baseline} measures the validation-subset loss on "
                               f"other tokens than the config ({'; '.join(differ)}); give both the same data, "
                               f"val_subset_tokens and seq_len")
    return [env.hash_json(rec) for rec in recipes]


def target_outcomes(results, configs, failed):
    """{name: run outcome} of runs just trained or reused; a failed run's entry may be an older run's, so unread."""
    return {c.name: time_to_target.failed_outcome(c.seed, failed[c.name]) if c.name in failed
            else time_to_target.run_outcome(results.get(c.name) or {}) for c in configs}


def target_section(cfg, results, candidates, baselines, failed, plot):
    """results["time-to-target"][name]: the seeds' outcomes, the t-test verdict, the median time, the baseline's
    runs and the speed-up."""
    runs, base_runs = target_outcomes(results, candidates, failed), target_outcomes(results, baselines, failed)
    verdict = time_to_target.target_verdict(time_to_target.verdict_losses(runs), cfg.target_loss)
    section = {"target_loss": cfg.target_loss, "eval_interval": cfg.eval_interval, **verdict,
               "median_training_seconds": time_to_target.median_seconds(runs), "candidate_runs": runs,
               "baseline_config": cfg.target_baseline or None, "baseline_runs": base_runs, "speedup": None,
               "recipe_differences": None, "plot": str(plot), "run_id": env.new_run_id()}
    if baselines:
        times = {n: o["training_seconds"] for n, o in runs.items() if o["status"] == "complete"}
        to_target = {n: o["seconds_to_target"] if o["status"] == "complete" else None for n, o in base_runs.items()}
        trained = {n: o["training_seconds"] for n, o in base_runs.items() if o["status"] == "complete"}
        section["speedup"] = time_to_target.speedup(to_target, times, trained)
        recipes = [(results.get(c.name) or {}).get("recipe") for c in (candidates[0], baselines[0])]
        if all(recipes):  # what makes the candidate another recipe than the baseline (the seed aside)
            section["recipe_differences"] = [k for k in train.recipe_differences(*recipes) if k != "seed"]
    section["verdict"] = time_to_target.verdict_line(section)
    return section


def time_to_target_mode(cfg):
    """--mode=time-to-target: train the config's seeds, then the baseline's runs, one after the other; record
    results["time-to-target"][name], print the table and draw the plot; returns the recorded section."""
    plot = plot_file(cfg)
    check_writable(cfg.results_file)
    check_plot_path(plot)
    candidates, baselines = target_configs(cfg), target_baseline_configs(cfg)
    identities = check_target_runs(cfg, candidates, baselines)
    if baselines and not cfg.eval_interval:
        print("note: eval_interval is 0, so the baseline's time to the target is measured at epoch ends only (an "
              "upper bound); --eval_interval=N measures it every N updates")
    sides = ["candidate"] * len(candidates) + ["target baseline"] * len(baselines)
    failed = train_all(cfg, zip(sides, candidates + baselines, identities), keep_going=True)
    results = read_results(cfg.results_file)
    section = target_section(cfg, results, candidates, baselines, failed, plot)
    record(cfg.results_file, ["time-to-target", cfg.name], section)
    print("\n".join(time_to_target.table(section)))
    runs = [(c.name, {} if c.name in failed else results.get(c.name) or {}) for c in candidates + baselines]
    time_to_target.save_figure(plot, runs, cfg.target_loss,
                               f"{cfg.name}: validation-subset loss against training time, target {cfg.target_loss:g}")
    print(f"recorded time-to-target.{cfg.name} in {cfg.results_file}; plot {plot}")
    return section


# ---------------------------------------------------------------- main

def plot_file(cfg):
    return cfg.plot or f"out/{cfg.name}-{'time-to-target' if cfg.mode == 'time-to-target' else 'comparison'}.png"


def compare(cfg):
    if cfg.mode == "time-to-target":
        return time_to_target_mode(cfg)
    plot = plot_file(cfg)
    check_writable(cfg.results_file)
    if cfg.baseline or cfg.optimized:
        if not (cfg.baseline and cfg.optimized):
            raise CompareError("give both --baseline=NAME and --optimized=NAME to compare finished runs, or neither "
                               "to train them")
        if cfg.tuned or cfg.optimized_overrides:
            raise CompareError("--tuned and --optimized_overrides shape runs to train; with --baseline and "
                               "--optimized nothing is trained, so drop them")
        check_plot_path(plot)
        return compare_runs(cfg.results_file, cfg.baseline, cfg.optimized, cfg.allow_recipe_change, plot,
                            cfg.noise_runs, noise_seed_runs=cfg.noise_seed_runs)
    sides = side_configs(cfg)
    noise = noise_configs(cfg, sides[0])
    identities = check_before_training(cfg, sides)
    # The noise runs last: a stop or a failure then leaves the compared pair done first.
    identities += [env.hash_json(train.setup(c)[2]) for c in noise]
    train_all(cfg, zip(["baseline", "optimized"] + ["noise"] * len(noise), sides + noise, identities))
    return compare_runs(cfg.results_file, sides[0].name, sides[1].name, cfg.allow_recipe_change, plot,
                        cfg.noise_runs, seed_runs=[c.name for c in noise])


def main(argv):
    try:
        cfg = settings.resolve(CompareSettings, argv)
        comparison = compare(cfg)
    except (*train.USER_ERRORS, CompareError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        print(exc, file=sys.stderr)
        return train.EXIT_INTERRUPTED
    except KeyboardInterrupt:
        return 130
    if "reaches_target" in comparison:  # time-to-target: a miss, whatever its mean, is a failed verdict
        return 0 if comparison["reaches_target"] else 1
    return 0 if comparison["label"] == "recipe change" or comparison["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
