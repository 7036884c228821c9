"""Loss curves of training runs, drawn from their results entries: compare.py's pair plot and
scripts/plot_runs.py's plot of any runs of a results file share them.

A run's entry holds `validation_curve` (the validation-subset loss at each epoch end) and `training_curve` (the
mean training loss of each log interval). Each panel draws one line per run that has points for it, in the run's
colour in every panel (a curve of one point, a run that logged once, is a dot), and its legend names every run: one
it cannot draw is listed with the reason (no such curve, or no finite loss). `training_curve` is optional, as
results files (results/h200.json among them) hold entries without it: such an entry is drawn in the validation
panels only, and a figure of such entries alone has no training row. Figures are matplotlib's Agg (no display),
written atomically.
"""
import math
import os
from pathlib import Path

from results import atomic_write

PLOT_SUFFIXES = (".png", ".pdf", ".svg")
# --x: the entry field each x axis reads, and its label
X_AXES = {"tokens": ("tokens", "training tokens"), "seconds": ("training_seconds", "training seconds")}
X_CHOICES = ("tokens", "seconds", "both")
# the curves, as (entry field, y label, marker): validation points are a few epochs, training points many
CURVES = (("training_curve", "training loss (mean of each log interval)", None),
          ("validation_curve", "validation-subset loss", "o"))


class PlotError(ValueError):
    """A plot that cannot be made as asked: a user mistake, reported in one line."""


def check_path(path, option="--out"):
    """Refuse a path matplotlib cannot write, before any work; `option` names the setting in the message."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise PlotError(f"{option} {path} must end in {', '.join(PLOT_SUFFIXES)}")
    try:
        if path.exists() and not path.is_file():  # a folder named runs.png: the rename over it fails after the work
            raise PlotError(f"{option} {path} exists and is not a file (a folder, say); give a file's path")
        folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
        longest = os.pathconf(folder, "PC_NAME_MAX") if folder.is_dir() else 255
    except OSError as exc:  # a name too long for the file system, say
        raise PlotError(f"{option} {path}: {exc.strerror}; give another path") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise PlotError(f"{option} {path}: cannot create or write into {folder}")
    if len(f".{path.name}.XXXXXXXX.tmp".encode()) > longest:  # atomic_write's temporary file beside it
        raise PlotError(f"{option} {path}: its name is too long for its file system (at most {longest - 14} bytes "
                        f"here); give a shorter one")


def training_runs(results):
    """The names of a results file's training runs: its top-level entries with a recipe identity."""
    return [name for name, entry in results.items() if isinstance(entry, dict) and "recipe_identity" in entry]


def fmt(value, spec, suffix=""):
    """A table cell: a number in format spec (and a suffix), or "-" for one that is missing, not finite or not a
    number at all (a results file edited by hand)."""
    return f"{value:{spec}}{suffix}" if finite_number(value) else "-"


def bad_curve(entry):
    """The first of a run entry's curves that is not a list of points (objects), or None: a results file edited by
    hand, or not written by results.py."""
    for curve, _, _ in CURVES:
        points = entry.get(curve)
        if points is not None and not (isinstance(points, list) and all(isinstance(p, dict) for p in points)):
            return curve
    return None


def finite_number(value):
    """A number that is neither NaN nor infinite (nor a bool, nor the null results.py writes for those)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def points(entry, curve, x_field):
    """(xs, losses) of one curve of a run, leaving out points without that x (a results file may hold curves
    recorded without it) and points without a finite loss (a diverged run's NaN, or the null results.py writes)."""
    pairs = [(p[x_field], p["loss"]) for p in entry.get(curve) or []
             if p.get(x_field) is not None and finite_number(p.get("loss"))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def without_finite_losses(runs):
    """The names of runs [(name, entry)] that recorded curve points but no finite loss in any of them: nothing of
    theirs can be drawn (a run that diverged at once), which is not the same as a run without curves."""
    def losses(entry):
        return [p.get("loss") for curve, _, _ in CURVES for p in entry.get(curve) or [] if isinstance(p, dict)]
    return [name for name, entry in runs if (ys := losses(entry)) and not any(map(finite_number, ys))]


def drawable(runs, x="both"):
    """The names of runs [(name, entry)] with a point to draw on x's axes (a failed or running run may have none)."""
    axes = list(X_AXES) if x == "both" else [x]
    return [name for name, entry in runs
            if any(points(entry, curve, X_AXES[a][0])[0] for curve, _, _ in CURVES for a in axes)]


def runs_figure(runs, x="both", title=None):
    """A figure of runs [(name, entry), ...]: a row per curve (training loss, validation loss), a column per x
    axis (tokens, seconds or both), one line per run in each panel where the run has points, and every run in each
    panel's legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    if x not in X_CHOICES:
        raise PlotError(f"--x={x!r} is not one of {', '.join(X_CHOICES)}")
    axes_x = list(X_AXES) if x == "both" else [x]
    # a curve that no run has gets no row (entries without a training curve, as the module docstring says)
    curves = [c for c in CURVES if any(entry.get(c[0]) for _, entry in runs)] or list(CURVES[1:])
    fig = Figure(figsize=(5.5 * len(axes_x), 3.8 * len(curves)), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(len(curves), len(axes_x), squeeze=False)
    for row, (curve, ylabel, marker) in enumerate(curves):
        for col, axis in enumerate(axes_x):
            field, xlabel = X_AXES[axis]
            ax = grid[row][col]
            absent = []  # legend handles of the runs this panel cannot draw, each saying why
            for i, (name, entry) in enumerate(runs):
                xs, ys = points(entry, curve, field)
                if xs:
                    # a curve of one point is a line of no length: drawn without a marker it is not there at all
                    ax.plot(xs, ys, marker=marker or ("o" if len(xs) == 1 else None), label=name,
                            **line_style(i, len(runs)))
                    continue
                if any(p.get(field) is not None for p in entry.get(curve) or []):
                    why = "no finite loss"  # points on this axis, none with a finite loss: diverged
                else:
                    # an entry without the curve, or a run stopped before its first log line or epoch end
                    why = f"no {curve.replace('_', ' ')}"
                absent.append(Line2D([], [], linestyle="none", label=f"{name}: {why}"))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines or absent:  # every run is in every panel's legend: drawn, or named with the reason it is not
                ax.legend(handles=ax.lines + absent, fontsize=8)
    fig.suptitle(title or " vs ".join(name for name, _ in runs))
    return fig


def line_style(i, n):
    """The ith of n runs' colour and line: matplotlib's ten colours for up to ten runs, else n colours of a colour
    map with the line style cycling, so that no two runs of a figure look alike (C0 was run 1's and run 11's)."""
    if n <= 10:
        return {"color": f"C{i}"}
    import matplotlib  # here, as runs_figure's: importing plots imports no matplotlib
    return {"color": matplotlib.colormaps["turbo"](i / (n - 1)), "linestyle": ("-", "--", ":", "-.")[i % 4]}


def extend_legend(ax, *artists):
    """Add artists drawn on a runs_figure panel afterwards (a target line) to its legend, which keeps naming the runs
    it could not draw (ax.legend() alone would rebuild it from the drawn lines only)."""
    old = ax.get_legend()
    handles, labels = (list(old.legend_handles), [t.get_text() for t in old.get_texts()]) if old else ([], [])
    ax.legend(handles + list(artists), labels + [a.get_label() for a in artists], fontsize=8)


def save_figure(fig, path):
    """Write the figure atomically, in the format its suffix names."""
    atomic_write(path, lambda f: fig.savefig(f, format=Path(path).suffix[1:].lower(), dpi=100))


def save_plot(path, runs, x="both", title=None):
    """runs_figure of runs, written to path; returns the figure."""
    fig = runs_figure(runs, x, title)
    save_figure(fig, path)
    return fig
