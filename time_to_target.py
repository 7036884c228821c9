"""compare.py's time-to-target mode (docs/TIME_TO_QUALITY.md): a recipe trained at several seeds reaches a
validation-subset loss when every seed ends below it and a one-sided one-sample t-test puts the mean below it at
p < 0.01; its time is the median of the seeds' training seconds, and beside a baseline recipe its speed-up is the
baseline's time to first reach the target over that median.

The verdict's arithmetic is pure functions of results entries and numbers, tested directly; the mode below trains
the runs (runs.py) and records the verdict in results["time-to-target"][name], with a plot of every run's
validation-subset loss against training seconds.
"""
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import env
import plots
import settings
from configurator import ConfigError, load_config
from plan import resolve_device
from results import read_results, record
from runs import TRAIN_DEFAULTS, CompareError, check_plot_path, run_folders, run_recipe, seed_run_name, train_all
from settings import setting


def at_least_two_seeds(seeds):
    return None if seeds >= 2 else (f"seeds {seeds} cannot pass: the t-test needs at least 2 runs (5 is the "
                                    f"default)")


@dataclasses.dataclass
class Target:
    """the time-to-target mode (--mode=time-to-target): the config's runs at several seeds, to target_loss"""
    seeds: int = setting(5, "runs of the config at seed, seed+1, ... (<name>-seed<N>), each to its end; the one-sided "
                            "t-test passes at p < 0.01, which needs a mean 3.7 standard errors below the target with 5 "
                            "runs, about 7 with 3, 32 with 2", rule=at_least_two_seeds)
    target_baseline: str = setting("", "the baseline recipe's config file (such as config/20m_gh200.py), run as it is "
                                       "with this eval_interval and target, stopping there: its time to the target "
                                       "over the config's median time is the speed-up (\"\": none)")
    target_baseline_seeds: int = setting(1, "runs of target_baseline at its seed, seed+1, ... "
                                            "(<name>-target-baseline-seed<N>)", bounds=">= 1")

ALPHA = 0.01  # the significance a record asks for: the mean lies below the target at p < 0.01


def run_outcome(entry):
    """What the verdict reads from a run's results entry: its status and seed, its final validation-subset loss
    (the last point of its validation curve; None without a finite one), its training seconds, where it first
    reached the target (train.py's target.reached, None when it never did), and the sessions that trained it (more
    than 1: resumed, each session's recompile in its time)."""
    curve = entry.get("validation_curve") or []
    last = curve[-1].get("loss") if curve else None
    reached = (entry.get("target") or {}).get("reached")
    return {"status": entry.get("status"), "seed": (entry.get("config") or {}).get("seed"),
            "final_loss": last if plots.finite_number(last) else None, "training_seconds": entry.get("training_seconds"),
            "updates": entry.get("step"), "reached": reached,
            "seconds_to_target": reached.get("training_seconds") if reached else None,
            "first_update_seconds": entry.get("first_update_seconds"), "start": start_regime(entry),
            "sessions": entry.get("sessions")}


def start_regime(entry):
    """How the run's first update compiled: "cold" (Inductor made every graph), "warm" (its cache held every one),
    "part-warm", "eager" (nothing compiled), or None for an entry that does not say."""
    graphs, config = entry.get("first_update_graphs"), entry.get("config")
    if not isinstance(config, dict):
        return None
    if not config.get("compile"):
        return "eager"
    if not isinstance(graphs, dict):
        return None
    compiled, cached = graphs.get("compiled", 0), graphs.get("from_cache", 0)
    return "cold" if compiled and not cached else "warm" if cached and not compiled else "part-warm"


def regime_note(section):
    """A sentence when the candidate's and the baseline's runs started differently (a warm run against a cold one
    counts compile seconds on one side only), else ""."""
    sides = {side: {o.get("start") for o in (section.get(f"{side}_runs") or {}).values()} - {None}
             for side in ("candidate", "baseline")}
    if not sides["baseline"] or sides["candidate"] == sides["baseline"]:
        return ""
    return (f"; the runs started differently: candidate {', '.join(sorted(sides['candidate'])) or 'unknown'}, "
            f"baseline {', '.join(sorted(sides['baseline']))} (compile seconds are in the training time)")


def failed_outcome(seed, error):
    """A run whose train.py exited with an error: no loss and no time (its entry, if any, may be an older run's)."""
    return {"status": "failed", "seed": seed, "final_loss": None, "training_seconds": None, "updates": None,
            "reached": None, "seconds_to_target": None, "sessions": None, "error": error}


def failed_runs(section):
    """The names of the section's runs, candidate and baseline, whose train.py exited with an error."""
    runs = {**section["candidate_runs"], **(section.get("baseline_runs") or {})}
    return [name for name, o in runs.items() if o["status"] == "failed"]


def verdict_losses(outcomes):
    """{name: final loss} for the t-test; None for a run that did not complete (failed, or stopped on an error),
    whose last validation point is not the recipe's result."""
    return {name: o["final_loss"] if o["status"] == "complete" else None for name, o in outcomes.items()}


def one_sided_t(losses, target):
    """(t, p) of scipy's one-sample t-test that the mean of losses lies below target. Identical losses have no
    spread, where scipy warns and gives nan: the mean is then below the target with certainty, or not at all."""
    from scipy import stats  # imported here: the matched mode never needs it
    if statistics.stdev(losses) == 0:
        mean = losses[0]
        return (-math.inf, 0.0) if mean < target else (math.inf if mean > target else None, 1.0)
    result = stats.ttest_1samp(losses, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def target_verdict(losses, target, alpha=ALPHA):
    """Whether runs {name: final loss, or None when the run gave none} reach target: at least 2 final losses,
    every one of them below the target, and the one-sided t-test's p below alpha. The reasons say what failed."""
    finite = {name: loss for name, loss in losses.items() if plots.finite_number(loss)}
    values = list(finite.values())
    reasons = []
    missing = [name for name in losses if name not in finite]
    if missing:
        reasons.append(f"no final loss from {', '.join(missing)} (the run failed, or its loss is not finite)")
    above = [f"{name} {loss:.4f}" for name, loss in finite.items() if loss >= target]
    if above:
        reasons.append(f"not below the target {target:g}: {', '.join(above)}")
    t, p = one_sided_t(values, target) if len(values) >= 2 else (None, None)
    if len(values) < 2:
        reasons.append(f"a t-test needs at least 2 final losses, got {len(values)}")
    elif not p < alpha:
        reasons.append(f"the mean {statistics.mean(values):.4f} is not below {target:g} at p < {alpha:g} "
                       f"(p = {p:.3g})")
    return {"n_runs": len(losses), "mean_loss": statistics.mean(values) if values else None,
            "loss_std": statistics.stdev(values) if len(values) >= 2 else None, "t_statistic": t, "p_value": p,
            "alpha": alpha, "reaches_target": not reasons, "reasons": reasons}


def median_seconds(outcomes):
    """The median training seconds of the runs that completed (None when none did)."""
    times = [o["training_seconds"] for o in outcomes.values() if o["status"] == "complete"
             and plots.finite_number(o["training_seconds"])]
    return statistics.median(times) if times else None


def unfinished_baseline_runs(baseline_status):
    """Each baseline run that did not complete, in words: failed (its train.py exited with an error), or its
    status."""
    return [f"the baseline run {name} " + ("failed" if s == "failed" else f"did not complete (status {s})")
            for name, s in baseline_status.items() if s != "complete"]


def speedup(baseline_times, candidate_times, baseline_trained=None, baseline_status=None):
    """The baseline's time to the target over the candidate's training time, from {name: seconds} of each (a
    baseline's None: it never reached the target, or it did not complete, as baseline_status {name: status} says).
    The speed-up divides the medians; its spread divides the baseline's median by each candidate seed's time, and
    each baseline seed's time by the candidate's median.

    When a complete baseline run never reached the target there is no speed-up, but where every such run trained its
    whole recipe (baseline_trained: {name: training seconds of a completed run}) its training time is a lower bound
    on its time to the target, so the median of those bounds over the candidate's median is a lower bound on the
    speed-up: `at_least`."""
    status = baseline_status or {}
    unfinished = unfinished_baseline_runs(status)
    never = [name for name, t in baseline_times.items() if not plots.finite_number(t)
             and status.get(name, "complete") == "complete"]
    bad = [name for name, t in candidate_times.items() if not (plots.finite_number(t) and t > 0)]
    missed = unfinished + ([f"the baseline never reached the target in {', '.join(never)}"] if never else [])
    reason = ("no baseline run" if not baseline_times else "no completed candidate run" if not candidate_times
              else "; ".join(missed) if missed else f"no training time from {', '.join(bad)}" if bad else None)
    if reason:
        bounds = [t if plots.finite_number(t) else (baseline_trained or {}).get(name)
                  for name, t in baseline_times.items()]
        at_least = (statistics.median(bounds) / statistics.median(candidate_times.values())
                    if never and not unfinished and candidate_times and not bad
                    and all(plots.finite_number(t) for t in bounds) else None)
        return {"speedup": None, "baseline_seconds_to_target": None, "candidate_median_seconds": None,
                "over_candidate_seeds": None, "over_baseline_seeds": None, "reason": reason, "at_least": at_least}
    base, cand = list(baseline_times.values()), list(candidate_times.values())
    b, c = statistics.median(base), statistics.median(cand)
    return {"speedup": b / c, "baseline_seconds_to_target": b, "candidate_median_seconds": c,
            "over_candidate_seeds": [b / max(cand), b / min(cand)],
            "over_baseline_seeds": [min(base) / c, max(base) / c] if len(base) > 1 else None, "reason": None,
            "at_least": None}


# ---------------------------------------------------------------- the words and the figure

def verdict_line(section):
    """One line: whether the recipe reaches the target, and why not."""
    target = section["target_loss"]
    if not section["reaches_target"]:
        return f"misses the target {target:g}: " + "; ".join(section["reasons"])
    text = (f"reaches the target {target:g}: every seed ends below it, mean {section['mean_loss']:.4f} at "
            f"p = {section['p_value']:.2g} < {section['alpha']:g} over {section['n_runs']} seeds")
    up = (section.get("speedup") or {}).get("speedup")
    return text + (f"; {up:.2f}x faster than the baseline to it" if up else "") + regime_note(section)


def run_rows(section):
    """(name, status, final loss, training s, first reached at training s, start) of every run, candidate first."""
    runs = {**section["candidate_runs"], **(section.get("baseline_runs") or {})}
    return [(name, str(o["status"]), plots.fmt(o["final_loss"], ".4f"), plots.fmt(o["training_seconds"], ".1f"),
             plots.fmt(o["seconds_to_target"], ".1f"), first_update(o))
            for name, o in runs.items()]


def first_update(o):
    """How the run's first update started and its seconds; and the sessions of a run resumed over several, whose
    training seconds hold each session's recompile: not an uninterrupted run's time."""
    sessions = o.get("sessions")
    resumed = f", {sessions} sessions" if isinstance(sessions, int) and sessions > 1 else ""
    return f"{o.get('start') or '?'} {plots.fmt(o.get('first_update_seconds'), '.1f')} s{resumed}"


def speedup_line(up):
    if up["speedup"] is None:
        bound = (f"; at least {up['at_least']:.2f}x, the baseline's whole training time without reaching it over "
                 f"the candidate's median" if up.get("at_least") else "")
        return f"none: {up['reason']}{bound}"
    lo, hi = up["over_candidate_seeds"]
    text = (f"{up['speedup']:.2f}x: the baseline's {up['baseline_seconds_to_target']:.1f} s to the target / the "
            f"candidate's median {up['candidate_median_seconds']:.1f} s ({lo:.2f}x to {hi:.2f}x over its seeds")
    if up["over_baseline_seeds"]:
        text += ", {:.2f}x to {:.2f}x over the baseline's".format(*up["over_baseline_seeds"])
    return text + ")"


def table(section):
    """The runs, then the mean and its test, the median time, the speed-up and the verdict, as printed lines."""
    head = ("run", "status", "final loss", "training s", "reached at s", "first update")
    rows = [head, *run_rows(section)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    mean, std, p = section["mean_loss"], section["loss_std"], section["p_value"]
    losses = sum(loss is not None for loss in verdict_losses(section["candidate_runs"]).values())
    runs = f"{losses} of {section['n_runs']}" if losses < section["n_runs"] else section["n_runs"]
    lines += [f"{'target':>18}  validation-subset loss {section['target_loss']:g} (eval_interval "
              f"{section['eval_interval']})",
              f"{'mean final loss':>18}  {plots.fmt(mean, '.4f')} (sd {plots.fmt(std, '.4f')} over {runs} runs), "
              f"one-sided p = {plots.fmt(p, '.3g')}, pass at p < {section['alpha']:g}",
              f"{'median training s':>18}  {plots.fmt(section['median_training_seconds'], '.1f')}"]
    if section.get("speedup"):
        miss = "" if section["reaches_target"] else "; it does not count: the candidate misses the target"
        lines.append(f"{'speed-up':>18}  {speedup_line(section['speedup'])}{miss}")
    lines.append(f"{'verdict':>18}  {verdict_line(section)}")
    return lines


def save_figure(path, runs, target, title):
    """Validation-subset loss against training seconds, one line per run [(name, entry)], the target a dashed
    horizontal line; written to path."""
    curves = [(name, {"validation_curve": entry.get("validation_curve") or []}) for name, entry in runs]
    fig = plots.runs_figure(curves, x="seconds", title=title)  # validation curves only: one panel
    ax = fig.axes[0]
    plots.extend_legend(ax, ax.axhline(target, linestyle="--", color="0.3", linewidth=1, label=f"target {target:g}"))
    plots.save_figure(fig, path)
    return fig


# ---------------------------------------------------------------- the mode: its runs and its record

# What decides the tokens a validation-subset loss averages (the cache aside): a target is one loss on one set.
MEASUREMENT_KEYS = ("val_subset_tokens", "seq_len")


def target_configs(cfg):
    """The config's runs at seeds seed .. seed+seeds-1, each under its own name (<name>-seed<N>) and folder, trained
    to their end with this eval_interval and target_loss: a seed's time is the whole recipe's, as a record's is."""
    given = {k: cfg[k] for k in TRAIN_DEFAULTS}
    return [settings.Config(dict(given, seed=s, name=seed_run_name(cfg.name, s), results_file=cfg.results_file,
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
        base = load_config(TRAIN_DEFAULTS, [cfg.target_baseline])
    except ConfigError as exc:
        raise CompareError(f"--target_baseline: {exc}") from None
    runs = []
    for s in range(base["seed"], base["seed"] + cfg.target_baseline_seeds):
        side = f"target-baseline-seed{s}"
        runs.append(settings.Config(dict(base, seed=s, name=f"{cfg.name}-{side}", results_file=cfg.results_file,
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
        devices = [resolve_device(x) for x in (c, b)]
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
    return {c.name: failed_outcome(c.seed, failed[c.name]) if c.name in failed
            else run_outcome(results.get(c.name) or {}) for c in configs}


def target_section(cfg, results, candidates, baselines, failed, plot):
    """results["time-to-target"][name]: the seeds' outcomes, the t-test verdict, the median time, the baseline's
    runs and the speed-up."""
    runs, base_runs = target_outcomes(results, candidates, failed), target_outcomes(results, baselines, failed)
    verdict = target_verdict(verdict_losses(runs), cfg.target_loss)
    section = {"target_loss": cfg.target_loss, "eval_interval": cfg.eval_interval, **verdict,
               "median_training_seconds": median_seconds(runs), "candidate_runs": runs,
               "baseline_config": cfg.target_baseline or None, "baseline_runs": base_runs, "speedup": None,
               "recipe_differences": None, "plot": str(plot), "run_id": env.new_run_id()}
    if baselines:
        times = {n: o["training_seconds"] for n, o in runs.items() if o["status"] == "complete"}
        to_target = {n: o["seconds_to_target"] if o["status"] == "complete" else None for n, o in base_runs.items()}
        trained = {n: o["training_seconds"] for n, o in base_runs.items() if o["status"] == "complete"}
        section["speedup"] = speedup(to_target, times, trained, {n: o["status"] for n, o in base_runs.items()})
        # each side's first finished run (a failed run's entry may be an older run's)
        recipes = [next(((results.get(n) or {}).get("recipe") for n, o in outcomes.items()
                         if o["status"] == "complete"), None) for outcomes in (runs, base_runs)]
        if all(recipes):  # what makes the candidate another recipe than the baseline (the seed aside)
            section["recipe_differences"] = [k for k in settings.recipe_differences(*recipes) if k != "seed"]
    section["verdict"] = verdict_line(section)
    return section


def time_to_target_mode(cfg):
    """--mode=time-to-target: train the config's seeds, then the baseline's runs, one after the other; record
    results["time-to-target"][name], print the table and draw the plot; returns the recorded section."""
    plot = plot_file(cfg)
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
    print("\n".join(table(section)))
    runs = [(c.name, {} if c.name in failed else results.get(c.name) or {}) for c in candidates + baselines]
    try:
        save_figure(plot, runs, cfg.target_loss,
                    f"{cfg.name}: validation-subset loss against training time, target {cfg.target_loss:g}")
    except OSError as exc:  # after every run: the verdict stands recorded, only its figure is missing
        print(f"recorded time-to-target.{cfg.name} in {cfg.results_file}; the plot {plot} could not be written "
              f"({exc.strerror or exc})", file=sys.stderr)
        return section
    print(f"recorded time-to-target.{cfg.name} in {cfg.results_file}; plot {plot}")
    return section




def plot_file(cfg):
    return cfg.plot or f"out/{cfg.name}-time-to-target.png"
