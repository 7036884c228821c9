"""The time-to-target verdict of `compare.py --mode=time-to-target` (docs/TIME_TO_QUALITY.md): a recipe trained at
several seeds reaches a validation-subset loss when every seed ends below it and a one-sided one-sample t-test
puts the mean below it at p < 0.01; its time is the median of the seeds' training seconds, and beside a baseline
recipe its speed-up is the baseline's time to first reach the target over that median.

Pure functions of results entries and numbers (compare.py trains the runs and records the verdict), so that the
arithmetic is tested directly; the figure is drawn with plots.py's helpers.
"""
import math
import statistics

import plots

ALPHA = 0.01  # the significance a record asks for: the mean lies below the target at p < 0.01


def run_outcome(entry):
    """What the verdict reads from a run's results entry: its status and seed, its final validation-subset loss
    (the last point of its validation curve; None without a finite one), its training seconds, and where it first
    reached the target (train.py's target.reached, None when it never did)."""
    curve = entry.get("validation_curve") or []
    last = curve[-1].get("loss") if curve else None
    reached = (entry.get("target") or {}).get("reached")
    return {"status": entry.get("status"), "seed": (entry.get("config") or {}).get("seed"),
            "final_loss": last if plots.finite_number(last) else None, "training_seconds": entry.get("training_seconds"),
            "updates": entry.get("step"), "reached": reached,
            "seconds_to_target": reached.get("training_seconds") if reached else None}


def failed_outcome(seed, error):
    """A run whose train.py exited with an error: no loss and no time (its entry, if any, may be an older run's)."""
    return {"status": "failed", "seed": seed, "final_loss": None, "training_seconds": None, "updates": None,
            "reached": None, "seconds_to_target": None, "error": error}


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


def speedup(baseline_times, candidate_times, baseline_trained=None):
    """The baseline's time to the target over the candidate's training time, from {name: seconds} of each (a
    baseline's None: it never reached the target). The speed-up divides the medians; its spread divides the
    baseline's median by each candidate seed's time, and each baseline seed's time by the candidate's median.

    When a baseline run never reached the target there is no speed-up, but where every such run trained its whole
    recipe (baseline_trained: {name: training seconds of a completed run}) its training time is a lower bound on
    its time to the target, so the median of those bounds over the candidate's median is a lower bound on the
    speed-up: `at_least`."""
    never = [name for name, t in baseline_times.items() if not plots.finite_number(t)]
    bad = [name for name, t in candidate_times.items() if not (plots.finite_number(t) and t > 0)]
    reason = ("no baseline run" if not baseline_times else "no completed candidate run" if not candidate_times
              else f"the baseline never reached the target in {', '.join(never)}" if never
              else f"no training time from {', '.join(bad)}" if bad else None)
    if reason:
        bounds = [t if plots.finite_number(t) else (baseline_trained or {}).get(name)
                  for name, t in baseline_times.items()]
        at_least = (statistics.median(bounds) / statistics.median(candidate_times.values())
                    if never and candidate_times and not bad and all(plots.finite_number(t) for t in bounds)
                    else None)
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
    return text + (f"; {up:.2f}x faster than the baseline to it" if up else "")


def run_rows(section):
    """(name, status, final loss, training s, first reached at training s) of every run, candidate first."""
    runs = {**section["candidate_runs"], **(section.get("baseline_runs") or {})}
    return [(name, str(o["status"]), plots.fmt(o["final_loss"], ".4f"), plots.fmt(o["training_seconds"], ".1f"),
             plots.fmt(o["seconds_to_target"], ".1f")) for name, o in runs.items()]


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
    head = ("run", "status", "final loss", "training s", "reached at s")
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
    ax.axhline(target, linestyle="--", color="0.3", linewidth=1, label=f"target {target:g}")
    ax.legend(fontsize=8)
    plots.save_figure(fig, path)
    return fig
