"""Matched runs: prove that a faster execution of a recipe kept its math.

    python compare.py config/20m_gh200.py                  # train a plain baseline and the config as given
    python compare.py config/20m_gh200.py --tuned=True      # the optimized side takes tune.py's selected config
    python compare.py config/tiny_cpu.py --full_validation=True --optimized_overrides="--loss_impl=fused"  # a lever
    python compare.py --baseline=NAME --optimized=NAME      # compare two finished runs of the results file

The baseline runs the same config plainly (eager, micro-batch `baseline_micro_batch_size`, SDPA auto, full
loss); the optimized run is the config as given. A speed-up kept the math when both runs have the same recipe
identity (train.recipe: every key that changes the math) and their final validation losses agree within the
tolerance below. The verdict goes to results["matched-comparison"], with a plot of both validation curves.

Runs are train.py subprocesses, one after the other (never at once: their speeds are part of the result).
An existing complete run with the same name, config identity and source hash (the same code) is reused
unless --rerun=True.
Exit status: 0 when the comparison is recorded and holds (or is an allowed recipe change), 1 when a matched
run's losses disagree or a training run failed, 2 on a user mistake.
"""
import math
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import env
import train
from data.loader import CacheError
from configurator import ConfigError, defaults_of, load_config, write_config_file
from results import atomic_write, lookup, read_results, record

# ---------------------------------------------------------------- defaults (train.py's keys are accepted too)
baseline = ""                    # with optimized: compare these two finished runs, train nothing
optimized = ""
tuned = False                    # layer results["tuning"]["selected"]["config_path"] on the optimized side
optimized_overrides = ""         # space-separated --key=value for the optimized run only (a lever to try)
allow_recipe_change = False      # compare runs whose recipes differ, labelled "recipe change"
baseline_micro_batch_size = 8
plot = ""                        # "" means out/<name>-comparison.png
rerun = False                    # train again even when a complete run of the same config exists
noise_runs = ""                  # comma-separated finished runs (repeats, other seeds) whose spread of final
                                 # validation loss measures training noise; widens the tolerance to cover it.
                                 # Each must be the baseline's recipe, its seed aside, and not a compared run

DEFAULTS = dict(train.DEFAULTS, **defaults_of(globals()))

# How the baseline executes: the plainest way, whatever the config asks for.
BASELINE_EXECUTION = {"compile": False, "attention_backend": "auto", "loss_impl": "full"}
# Bulky fields of a run's entry that the comparison leaves out (the run's own entry keeps them).
BULKY = ("environment", "config", "recipe")
TOLERANCE_RULE = ("|optimized - baseline| final validation loss <= 3 standard errors of the difference of the two "
                  "mean per-token losses, 3 * sqrt(se_baseline^2 + se_optimized^2) with se = loss_std / "
                  "sqrt(tokens) of each run's full validation; neighbouring tokens' losses are correlated, so "
                  "this standard error is a lower bound and the test is strict")


class CompareError(ValueError):
    """A comparison that cannot be made as asked: a user mistake, reported in one line."""


class RunFailed(RuntimeError):
    """A training subprocess exited with an error (its own output says why)."""


# ---------------------------------------------------------------- the two runs' configs

def side_configs(cfg):
    """(baseline, optimized) train.py configs of one recipe, named <name>-baseline and <name>-optimized."""
    given = {k: cfg[k] for k in train.DEFAULTS}
    base = dict(given, micro_batch_size=cfg.baseline_micro_batch_size, **BASELINE_EXECUTION)
    layers = []
    if cfg.tuned:
        path = lookup(cfg.results_file, ["tuning", "selected", "config_path"])
        if not path:
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
        c.update(name=f"{cfg.name}-{side}", out_dir=str(Path(cfg.out_dir) / side) if cfg.out_dir else "",
                 results_file=cfg.results_file)
        sides.append(train.Config(c))
    return sides


def check_before_training(cfg, sides):
    """Refuse what would fail or mean nothing after hours of training, before starting either run.

    Returns the two recipe identities that train.py will record.
    """
    if not all(c.full_validation for c in sides):
        raise CompareError("the verdict compares the full validation losses; set full_validation=True "
                           "(in the config and in any --optimized_overrides)")
    check_plot_path(plot_file(cfg))
    recipes = []
    for side, c in zip(("baseline", "optimized"), sides):
        try:
            train.check_execution(c)
            rec = train.setup(c)[2]
        except (ConfigError, CacheError) as exc:
            hint = " (the baseline's micro-batch is --baseline_micro_batch_size)" if side == "baseline" else ""
            raise CompareError(f"{side} run: {exc}{hint}") from None
        recipes.append(rec)
    differ = train.recipe_differences(*recipes)
    if differ and not cfg.allow_recipe_change:
        raise CompareError(refusal(sides[0].name, sides[1].name, differ))
    if differ:
        print(f"recipe change allowed: {', '.join(differ)} differ between the runs")
    return [env.hash_json(rec) for rec in recipes]


def refusal(baseline_name, optimized_name, differ):
    fields = ", ".join(differ) if differ else "unknown (an entry has no recipe)"
    return (f"{baseline_name} and {optimized_name} have different recipes (fields that differ: {fields}); a matched "
            f"comparison changes only the execution. Pass --allow_recipe_change=True to compare them as a recipe change")


# ---------------------------------------------------------------- training (or reusing) one run

def stream(side, cmd):
    """Run cmd, printing its output line by line with a [side] prefix; returns its exit status."""
    child_env = dict(os.environ, PYTHONUNBUFFERED="1")  # progress lines as they happen, not at exit
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
    try:
        for line in proc.stdout:
            print(f"[{side}] {line}", end="", flush=True)
    except KeyboardInterrupt:
        # Ctrl-C reached the run too (same process group): it checkpoints and exits; show that, then stop.
        for line in proc.stdout:
            print(f"[{side}] {line}", end="", flush=True)
        proc.wait()
        raise
    return proc.wait()


def train_or_reuse(side, c, recipe_identity, rerun):
    """Train the run with train.py, unless a complete run of the same config, recipe and code is recorded."""
    out = train.run_dir(c)
    config_path = out / "compare_config.py"
    write_config_file(config_path, c, train.DEFAULTS,
                          header=f"The {side} run of a matched comparison, written by compare.py.\n"
                                 f"Rerun it with: python train.py {config_path}")
    args = [str(config_path), f"--name={c.name}", f"--results_file={c.results_file}"]
    # The identity train.py will record: the same loader on the same arguments.
    identity = env.config_identity(load_config(train.DEFAULTS, args))
    old = lookup(c.results_file, [c.name])
    if (not rerun and isinstance(old, dict) and old.get("status") == "complete" and old.get("final_validation")
            and old.get("config_identity") == identity and old.get("recipe_identity") == recipe_identity
            and (old.get("environment") or {}).get("source_hash") == env.source_hash()):
        print(f"{side}: reusing the complete run {c.name} of the same config and code in {c.results_file} "
              f"(pass --rerun=True to train again)")
        return
    cmd = [sys.executable, str(env.REPO / "train.py"), *args]
    print(f"{side}: {shlex.join(cmd)}", flush=True)
    code = stream(side, cmd)
    if code:
        raise RunFailed(f"the {side} run {c.name} exited with status {code}; its output is above")


# ---------------------------------------------------------------- the comparison

def finished_run(results, name, results_file):
    entry = results.get(name)
    if name in train.RESERVED_NAMES or not isinstance(entry, dict) or "recipe_identity" not in entry:
        runs = [k for k, v in results.items() if isinstance(v, dict) and "recipe_identity" in v
                and k not in train.RESERVED_NAMES]
        raise CompareError(f"results file {results_file} has no run named {name!r}; runs there: "
                           f"{', '.join(runs) or 'none'}")
    if entry.get("status") != "complete" or not entry.get("final_validation"):
        what = "" if entry.get("final_validation") else ", without a final validation"
        raise CompareError(f"run {name} is not complete (status {entry.get('status')!r}{what}); finish it "
                           f"(train.py --resume=True --name={name}) or compare another run")
    if entry["final_validation"].get("loss_std") is None:
        raise CompareError(f"run {name}'s final validation has no loss_std, so no tolerance can be computed; "
                           f"train it again with this train.py")
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


NOISE_RULE = ("; or, when larger, 3 * sqrt(2) * the sample standard deviation of the final validation losses "
              "of the noise runs (repeats and other seeds of the recipe: training itself is not deterministic "
              "on a GPU, and that spread is a difference two matched runs can show without any change of math)")


def training_noise(results, names, results_file, baseline_name, optimized_name):
    """{name: final validation loss} of the noise runs and their sample standard deviation.

    A noise run must be the baseline's recipe, its seed aside, and neither of the two runs compared: any other
    run's loss would widen the tolerance with a difference of math (the compared pair as its own noise passes
    whatever their difference)."""
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
    if len(losses) < 2:
        raise CompareError(f"--noise_runs needs at least two finished runs to measure a spread, got {len(losses)}")
    return losses, statistics.stdev(losses.values())


def shape_free(recipe):
    """A recipe without the config's model fields, which older runs recorded beside the resolved "model"
    (dim=0 and dim=320 are one model); the resolved model stays."""
    return {k: v for k, v in recipe.items() if k not in train.MODEL_KEYS} if "model" in recipe else recipe


def run_summary(entry):
    curve = [{k: p.get(k) for k in ("epoch", "tokens", "loss", "seconds", "training_seconds")}
             for p in entry.get("validation_curve") or []]
    return {"median_training_tokens_per_second": entry.get("median_training_tokens_per_second"),
            "validation_curve": curve, "final_validation": entry["final_validation"],
            "result": {k: v for k, v in entry.items() if k not in BULKY}}


def compare_runs(results_file, baseline_name, optimized_name, allow_recipe_change, plot_path, noise_runs=""):
    """Compare two finished runs, record results["matched-comparison"], print the table; returns the entry."""
    if baseline_name == optimized_name:
        raise CompareError(f"--baseline and --optimized both name {baseline_name!r}; compare two different runs")
    results = read_results(results_file)
    b = finished_run(results, baseline_name, results_file)
    o = finished_run(results, optimized_name, results_file)
    identity_equal = b["recipe_identity"] == o["recipe_identity"]
    differ = train.recipe_differences(b.get("recipe") or {}, o.get("recipe") or {})
    if not identity_equal and not allow_recipe_change:
        raise CompareError(refusal(baseline_name, optimized_name, differ))
    fb, fo = b["final_validation"], o["final_validation"]
    tol = tolerance(fb, fo)
    rule = TOLERANCE_RULE
    noise = {}
    names = [n.strip() for n in noise_runs.split(",") if n.strip()]
    if names:
        losses, std = training_noise(results, names, results_file, baseline_name, optimized_name)
        noise = {"noise_runs": losses, "training_noise_std": std}
        tol, rule = max(tol, 3 * math.sqrt(2) * std), TOLERANCE_RULE + NOISE_RULE
    difference = fo["loss"] - fb["loss"]
    agree = abs(difference) <= tol
    rb, ro = b.get("median_training_tokens_per_second"), o.get("median_training_tokens_per_second")
    comparison = {
        baseline_name: run_summary(b),
        optimized_name: run_summary(o),
        "speed_ratio": ro / rb if rb and ro else None,
        "loss_difference": difference,
        "tolerance": tol,
        "tolerance_rule": rule,
        "recipe_identity_equal": identity_equal,
        "recipe_differences": differ,
        "losses_agree": agree,
        "recipe_equal_except_execution": identity_equal and agree,
        "label": "matched run" if identity_equal else "recipe change",
        "plot": str(plot_path),
        "baseline": baseline_name,
        "optimized": optimized_name,
        "run_id": env.new_run_id(),
        **noise,
    }
    record(results_file, ["matched-comparison"], comparison)
    print_table(comparison, b, o)
    save_plot(plot_path, [(baseline_name, b), (optimized_name, o)])
    print(f"recorded matched-comparison in {results_file}; plot {plot_path}")
    return comparison


# ---------------------------------------------------------------- the table and the plot

def _fmt(value, spec, suffix=""):
    return "-" if value is None else f"{value:{spec}}{suffix}"


# Execution keys that say how the update ran (the others name files, logging and stopping).
SHOWN_EXECUTION = ("compile_mode", "compile_scope", "attention_backend", "loss_impl", "loss_chunk_tokens",
                   "activation_memory_budget", "cpu_threads")


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
        ("tokens", _fmt(entry.get("tokens"), ",")),
        ("final validation loss", f"{fv['loss']:.4f} ± {standard_error(fv):.4f}"),
        ("best subset loss", f"{best:.4f} (epoch {entry.get('best_epoch')})" if best is not None else "-"),
        ("median training tok/s", _fmt(entry.get("median_training_tokens_per_second"), ",.0f")),
        ("training seconds", _fmt(entry.get("training_seconds"), ".1f")),
        ("elapsed seconds", _fmt(entry.get("training_elapsed_seconds"), ".1f")),
        ("peak memory", _fmt(peak / 2**30 if peak is not None else None, ".2f", " GiB")),
    ]


def verdict(c):
    if c["label"] == "recipe change":
        return (f"recipe change ({', '.join(c['recipe_differences']) or 'recipe identity'}): not a matched run; "
                f"losses {'agree within' if c['losses_agree'] else 'differ beyond'} the tolerance")
    if c["losses_agree"]:
        speed = f"the {c['speed_ratio']:.2f}x speed" if c["speed_ratio"] else "the execution"
        return f"matched run: same recipe, losses agree; {speed} kept the math"
    return "matched run, but the losses differ beyond the tolerance: not shown to keep the math"


def print_table(c, b, o):
    rows_b, rows_o = table_rows(b), table_rows(o)
    width = max(len(str(v)) for _, v in rows_b + [("", c["baseline"])])
    lines = [f"{'':>22}  {c['baseline']:<{width}}  {c['optimized']}"]
    lines += [f"{k:>22}  {str(vb):<{width}}  {vo}" for (k, vb), (_, vo) in zip(rows_b, rows_o)]
    lines += [f"{'speed ratio':>22}  {_fmt(c['speed_ratio'], '.2f', 'x')} (optimized / baseline median training tok/s)",
              f"{'loss difference':>22}  {c['loss_difference']:+.5f} (tolerance ±{c['tolerance']:.5f}: "
              f"{'within' if c['losses_agree'] else 'OUTSIDE'})",
              f"{'verdict':>22}  {verdict(c)}"]
    print("\n".join(lines))


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot_path(path):
    """Refuse a plot path matplotlib cannot write, before anything is trained or compared."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise CompareError(f"--plot {path} must end in {', '.join(PLOT_SUFFIXES)}")
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise CompareError(f"--plot {path}: cannot create or write into {folder}")


def save_plot(path, runs):
    """Validation loss against tokens and against training seconds, one line per run (Agg: no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    by_tokens, by_seconds = fig.subplots(1, 2)
    for name, entry in runs:
        curve = entry.get("validation_curve") or []
        loss = [p["loss"] for p in curve]
        by_tokens.plot([p["tokens"] for p in curve], loss, marker="o", label=name)
        timed = [(p["training_seconds"], p["loss"]) for p in curve if p.get("training_seconds") is not None]
        by_seconds.plot([t for t, _ in timed], [l for _, l in timed], marker="o", label=name)
    by_tokens.set_xlabel("training tokens")
    by_seconds.set_xlabel("training seconds")
    for ax in (by_tokens, by_seconds):
        ax.set_ylabel("validation-subset loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(" vs ".join(name for name, _ in runs))
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format=Path(path).suffix[1:].lower(), dpi=100))


# ---------------------------------------------------------------- main

def plot_file(cfg):
    return cfg.plot or f"out/{cfg.name}-comparison.png"


def compare(cfg):
    plot = plot_file(cfg)
    if cfg.baseline or cfg.optimized:
        if not (cfg.baseline and cfg.optimized):
            raise CompareError("give both --baseline=NAME and --optimized=NAME to compare finished runs, or neither "
                               "to train them")
        if cfg.tuned or cfg.optimized_overrides:
            raise CompareError("--tuned and --optimized_overrides shape runs to train; with --baseline and "
                               "--optimized nothing is trained, so drop them")
        check_plot_path(plot)
        return compare_runs(cfg.results_file, cfg.baseline, cfg.optimized, cfg.allow_recipe_change, plot,
                            cfg.noise_runs)
    sides = side_configs(cfg)
    recipe_identities = check_before_training(cfg, sides)
    for side, c, identity in zip(("baseline", "optimized"), sides, recipe_identities):
        train_or_reuse(side, c, identity, cfg.rerun)
    return compare_runs(cfg.results_file, sides[0].name, sides[1].name, cfg.allow_recipe_change, plot,
                        cfg.noise_runs)


def main(argv):
    try:
        cfg = train.Config(load_config(DEFAULTS, argv))
        comparison = compare(cfg)
    except (*train.USER_ERRORS, CompareError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0 if comparison["label"] == "recipe change" or comparison["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
