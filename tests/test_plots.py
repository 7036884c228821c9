"""plots.py and scripts/plot_runs.py: the loss curves of any runs of a results file, one line per run in each
panel, entries without a training curve in the validation panels only, and mistakes as one-line errors."""
import contextlib
import io

import pytest

import plots
import train
from results import read_results, record
from scripts import plot_runs
import settings

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_entry(shift, training=True):
    """A complete training entry as train.py records one: a validation point per epoch and, unless it predates
    them, a training point per log interval."""
    entry = {"status": "complete", "recipe_identity": f"recipe-{shift}", "run_id": f"id-{shift}",
             "final_validation": {"loss": 3.0 + shift},
             "validation_curve": [{"epoch": e, "tokens": 1000 * e, "loss": 5 - e + shift, "seconds": 0.1,
                                   "training_seconds": 2.0 * e} for e in (1, 2)]}
    if training:
        entry["training_curve"] = [{"update": u, "tokens": 250 * u, "training_seconds": 0.5 * u,
                                    "loss": 6 - u / 2 + shift, "lr": 1e-3, "grad_norm": 1.0} for u in range(1, 9)]
    return entry


@pytest.fixture
def results(tmp_path):
    """Two current runs, one entry from before training curves were recorded, and sections that are not runs."""
    path = tmp_path / "results.json"
    record(path, ["a"], run_entry(0.0))
    record(path, ["b"], run_entry(0.1))
    record(path, ["old"], run_entry(0.2, training=False))
    record(path, ["benchmarks", "bench-1"], {"tokens_per_second": 1.0, "status": "ok"})
    record(path, ["matched-comparison"], {"baseline": "a", "optimized": "b"})
    return path


def labels(ax):
    return [line.get_label() for line in ax.lines]


def legend(ax):
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_every_run_by_default_one_line_per_run_per_panel(results, tmp_path, capsys):
    out = tmp_path / "plots" / "runs.png"
    code, fig = plot_runs.main([str(results), f"--out={out}"])
    assert code == 0 and out.read_bytes().startswith(PNG_MAGIC)
    assert "wrote" in capsys.readouterr().out
    # rows: training loss, validation loss; columns: tokens, seconds
    train_tokens, train_seconds, val_tokens, val_seconds = fig.axes
    assert labels(train_tokens) == labels(train_seconds) == ["a", "b"]
    assert labels(val_tokens) == labels(val_seconds) == ["a", "b", "old"]
    assert legend(train_tokens) == ["a", "b", "old: no training curve"]  # said, not silently dropped
    assert list(train_tokens.lines[1].get_xdata()) == [250 * u for u in range(1, 9)]
    assert list(train_tokens.lines[1].get_ydata()) == pytest.approx([6 - u / 2 + 0.1 for u in range(1, 9)])
    assert list(train_seconds.lines[0].get_xdata()) == [0.5 * u for u in range(1, 9)]
    assert list(val_tokens.lines[2].get_xdata()) == [1000, 2000]
    assert list(val_seconds.lines[2].get_xdata()) == [2.0, 4.0]
    assert list(val_seconds.lines[2].get_ydata()) == pytest.approx([4.2, 3.2])
    # a run keeps its colour in every panel
    assert {val_tokens.lines[1].get_color(), train_seconds.lines[1].get_color()} == {train_tokens.lines[1].get_color()}
    assert "tokens" in train_tokens.get_xlabel() and "seconds" in val_seconds.get_xlabel()


def test_named_runs_against_one_axis(results, tmp_path):
    out = tmp_path / "runs.svg"
    code, fig = plot_runs.main([str(results), "old", "b", f"--out={out}", "--x=seconds"])
    assert code == 0 and b"<svg" in out.read_bytes()
    train_seconds, val_seconds = fig.axes
    assert labels(train_seconds) == ["b"] and labels(val_seconds) == ["old", "b"]
    assert "seconds" in train_seconds.get_xlabel()


@pytest.mark.parametrize("args, words", [
    (["{results}", "a", "nope"], ["no run named 'nope'", "runs there: a, b, old"]),
    (["{results}", "--out={tmp}/runs.txt"], ["--out", "must end in .png"]),
    (["{results}", "--out={tmp}/folder.png"], ["--out", "folder.png exists and is not a file"]),
    (["{results}", "--x=epochs"], ["--x", "invalid choice"]),
    (["{tmp}/missing.json"], ["missing.json does not exist"]),
    (["{tmp}/broken.json"], ["not valid JSON"]),
    (["{tmp}/empty.json"], ["holds no training runs"]),
    (["{tmp}/hand.json"], ["run x's training_curve is not a list of points"]),
    (["{tmp}"], ["is not a file"]),
    (["{results}", "--out={tmp}/" + "a" * 260 + ".png"], ["--out", "File name too long"]),  # a traceback, before
    (["{results}", "--out={tmp}/" + "a" * 246 + ".png"], ["--out", "its name is too long"]),  # failed after the work
])
def test_mistakes_are_one_line_errors(results, tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)  # where the default --out would go
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "broken.json").write_text('{"a": ')
    record(tmp_path / "empty.json", ["benchmarks", "x"], {"status": "ok"})
    record(tmp_path / "hand.json", ["x"], {"recipe_identity": "r", "training_curve": [1, 2]})
    assert plot_runs.main([a.format(results=results, tmp=tmp_path) for a in args]) == (2, None)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("runs.*"))


def test_a_real_run_plots_its_training_curve(text_cache, tmp_path, monkeypatch):
    """What train.py records (a training point per log interval, a validation point per epoch) is what
    plots.save_plot, which compare.py's pair plot is too, draws."""
    monkeypatch.chdir(tmp_path)
    cfg = settings.Config(dict(train.DEFAULTS, preset="20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, seq_len=64,
                            data_dir=str(text_cache), device="cpu", cpu_threads=1, epochs=2, train_subset_tokens=8192,
                            val_subset_tokens=2048, tokens_per_update=256, micro_batch_size=4, warmup_updates=5,
                            log_interval=8, full_validation=False, name="real",
                            results_file=str(tmp_path / "results.json")))
    with contextlib.redirect_stdout(io.StringIO()):
        train.train(cfg)
    entry = read_results(cfg.results_file)["real"]
    fig = plots.save_plot(tmp_path / "pair.png", [("real", entry), ("real again", entry)])
    train_tokens, _, val_tokens, _ = fig.axes
    assert labels(train_tokens) == ["real", "real again"] and labels(val_tokens) == ["real", "real again"]
    assert list(train_tokens.lines[0].get_xdata()) == [p["tokens"] for p in entry["training_curve"]]
    assert len(train_tokens.lines[0].get_xdata()) == 64 // 8 and len(val_tokens.lines[0].get_xdata()) == 2
    assert (tmp_path / "pair.png").read_bytes().startswith(PNG_MAGIC)


def test_runs_without_a_finite_loss_are_named_and_the_others_drawn(results, tmp_path, capsys):
    """A run whose losses were all NaN was drawn as empty axes, without a word."""
    diverged = run_entry(0.3)
    for curve in ("training_curve", "validation_curve"):
        for i, point in enumerate(diverged[curve]):
            point["loss"] = float("nan") if i % 2 else None  # NaN as older files hold it, null as results.py writes it
    assert plots.without_finite_losses([("a", run_entry(0.0)), ("diverged", diverged)]) == ["diverged"]
    assert plots.points(diverged, "training_curve", "tokens") == ([], [])
    record(results, ["diverged"], diverged)  # its NaNs become null there
    code, fig = plot_runs.main([str(results), "a", "diverged", f"--out={tmp_path / 'runs.png'}"])
    assert code == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("note: no finite loss in diverged") and "wrote" in out
    train_tokens, _, val_tokens, _ = fig.axes
    assert labels(train_tokens) == labels(val_tokens) == ["a"]
    assert legend(train_tokens) == legend(val_tokens) == ["a", "diverged: no finite loss"]
    # nothing but such runs: nothing to draw
    assert plot_runs.main([str(results), "diverged", f"--out={tmp_path / 'none.png'}"]) == (2, None)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no finite loss to draw in diverged" in err
    assert not (tmp_path / "none.png").exists()


def colour_pixels_near(png, fig, ax, x, y, colour, radius=4):
    """How many pixels of the written PNG within `radius` of data point (x, y) of panel ax are `colour`: what a
    reader of the file sees there, not what the figure object holds."""
    from matplotlib.colors import to_rgb
    import matplotlib.image
    import numpy as np
    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape[0] == round(fig.get_figheight() * fig.dpi)  # written at the figure's own dpi
    px, py = ax.transData.transform((x, y))  # display coordinates of the last draw (the save), from the bottom
    row, col = image.shape[0] - round(py), round(px)
    window = image[row - radius:row + radius + 1, col - radius:col + radius + 1]
    return int((np.abs(window - np.array(to_rgb(colour))).max(axis=-1) < 0.1).sum())


def test_a_curve_of_one_point_is_drawn_and_a_run_without_a_curve_is_named_in_the_legend(tmp_path):
    """A one-point training curve was a line of no length, drawn as nothing: compare's PNG showed empty panels whose
    legend listed both runs, and plot_runs.py lost every run that had logged once. The PNG is read back for the
    run's colour at its point, away from the legend's own sample of that colour."""
    one = run_entry(0.1)
    one["training_curve"] = one["training_curve"][:1]
    runs = [("many", run_entry(0.0)), ("one", one), ("old", run_entry(0.2, training=False))]
    png = tmp_path / "runs.png"
    fig = plots.save_plot(png, runs)
    train_tokens, train_seconds, val_tokens, _ = fig.axes
    assert legend(train_tokens) == legend(train_seconds) == ["many", "one", "old: no training curve"]
    assert legend(val_tokens) == ["many", "one", "old"]
    drawn = train_tokens.lines[1]
    assert drawn.get_marker() == "o" and train_tokens.lines[0].get_marker() == "None"  # many points: a line
    point = one["training_curve"][0]
    for ax, x in ((train_tokens, point["tokens"]), (train_seconds, point["training_seconds"])):
        legend_box = ax.get_legend().get_window_extent()
        assert not legend_box.contains(*ax.transData.transform((x, point["loss"])))
        assert colour_pixels_near(png, fig, ax, x, point["loss"], drawn.get_color()) >= 9
    # compare's pair: both sides logged once, both are dots
    pair = tmp_path / "pair.png"
    fig = plots.save_plot(pair, [("t-baseline", one), ("t-optimized", run_entry(0.3) | {"training_curve": [
        dict(point, loss=point["loss"] + 0.5)]})])
    train_tokens = fig.axes[0]
    for line in train_tokens.lines:
        (x,), (y,) = line.get_xdata(), line.get_ydata()
        assert colour_pixels_near(pair, fig, train_tokens, x, y, line.get_color()) >= 9


def test_runs_with_nothing_to_draw_are_a_mistake_and_wrote_names_only_the_drawn(results, tmp_path, capsys):
    """A failed run (no curve) beside a diverged one: the figure was written with empty panels, exit 0, and "wrote"
    named the failed run as drawn."""
    diverged = run_entry(0.3)
    for curve in ("training_curve", "validation_curve"):
        for point in diverged[curve]:
            point["loss"] = None
    record(results, ["diverged"], diverged)
    record(results, ["failed"], {"status": "failed", "recipe_identity": "recipe-f", "run_id": "id-f"})
    assert plot_runs.main([str(results), "diverged", "failed", f"--out={tmp_path / 'none.png'}"]) == (2, None)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "no point to draw against both in diverged, failed" in err
    assert not (tmp_path / "none.png").exists()
    assert plot_runs.main([str(results), "a", "failed", f"--out={tmp_path / 'a.png'}"])[0] == 0
    assert capsys.readouterr().out.strip().endswith("a.png: a")


def test_eleven_runs_are_eleven_lines_that_look_unlike():
    """Colours were C0 to C9 by the run's index: the 11th run (a time-to-target verdict's baseline beside ten seeds)
    was drawn as the first."""
    runs = [(f"run{i}", run_entry(i / 10)) for i in range(11)]
    ax = plots.runs_figure(runs, x="tokens").axes[0]
    looks = [(str(line.get_color()), line.get_linestyle()) for line in ax.lines]
    assert len(looks) == 11 and len(set(looks)) == 11
