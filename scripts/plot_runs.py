"""Plot the loss curves of training runs of a results file: training loss and validation-subset loss against
training tokens and against training seconds, one line per run (a dot for a run that logged once).

    python scripts/plot_runs.py RESULTS.json [RUN ...] [--out=out/runs.png] [--x=tokens|seconds|both]

Without RUN names, every training run in the file (its top-level entries with a recipe identity). Entries
written before train.py recorded the training curve are drawn in the validation panels only, and named in the
training panels' legend as having none; a run without a finite loss (diverged) is named so in the legend and
not drawn.
Exit status: 0 when the plot is written, 2 on a mistake (an unknown run, a bad --out, a broken results file,
no run with a point to draw).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules, run as a script too
import plots  # noqa: E402
from results import ResultsFileError, read_existing_results  # noqa: E402


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line of ours, not argparse's usage block
        raise plots.PlotError(f"{message} (see --help)")


def parse(argv):
    parser = Parser(prog="scripts/plot_runs.py", description=__doc__.splitlines()[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", metavar="RESULTS.json", help="the results file")
    parser.add_argument("runs", metavar="RUN", nargs="*", help="runs to plot (default: every training run)")
    parser.add_argument("--out", default="out/runs.png",
                        help="the plot file: .png, .pdf or .svg (default: %(default)s)")
    parser.add_argument("--x", default="both", choices=plots.X_CHOICES,
                        help="x axis: training tokens, training seconds, or both (default: %(default)s)")
    return parser.parse_args(argv)


def selected_runs(path, names):
    """[(name, entry)] of the named runs (default: all) of the results file at path."""
    results = read_existing_results(path)
    available = plots.training_runs(results)
    if not available:
        raise plots.PlotError(f"results file {path} holds no training runs (top-level entries with a recipe_identity)")
    unknown = [n for n in names if n not in available]
    if unknown:
        raise plots.PlotError(f"results file {path} has no run named {', '.join(map(repr, unknown))}; runs there: "
                              f"{', '.join(available)}")
    runs = [(n, results[n]) for n in dict.fromkeys(names or available)]
    for name, entry in runs:
        if curve := plots.bad_curve(entry):
            raise plots.PlotError(f"results file {path}: run {name}'s {curve} is not a list of points "
                                  f"(objects with a loss)")
    return runs


def main(argv):
    """Plot the runs; returns (exit status, the figure or None)."""
    try:
        args = parse(argv)
        plots.check_path(args.out)
        runs = selected_runs(args.results, args.runs)
        empty, drawn = plots.without_finite_losses(runs), plots.drawable(runs, args.x)
        if len(empty) == len(runs):
            raise plots.PlotError(f"results file {args.results}: no finite loss to draw in {', '.join(empty)} "
                                  f"(every loss NaN, infinite or null: diverged)")
        if not drawn:
            raise plots.PlotError(f"results file {args.results}: no point to draw against {args.x} in "
                                  f"{', '.join(name for name, _ in runs)} (no curve recorded, or only diverged losses)")
        title = f"{len(runs)} run{'s' if len(runs) > 1 else ''} of {args.results}"
        fig = plots.save_plot(args.out, runs, args.x, title)
    except (plots.PlotError, ResultsFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2, None
    except OSError as exc:  # the write itself: a full disk, say
        print(f"error: --out {args.out} could not be written ({exc.strerror or exc}); give another path",
              file=sys.stderr)
        return 2, None
    if empty:  # their panels say so too, but a figure is easy to misread as the run not being there
        print(f"note: no finite loss in {', '.join(empty)} (every loss NaN, infinite or null: diverged); "
              f"not drawn", file=sys.stderr)
    print(f"wrote {args.out}: {', '.join(drawn)}")
    return 0, fig


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:])[0])
