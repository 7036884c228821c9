"""scripts/figures_in_code.py finds a measured figure in a comment or a docstring, and none in code or in a rule."""
from scripts import figures_in_code

SOURCE = '''"""A step takes 3.4 ms (0.93 to 0.70 ms on the GPU), +1.3% at 2.1M tokens/s."""
TIMEOUT_MS = 250.5  # 4.13 GiB at its peak, a loss of 4.2472 (p = 0.00028)
LIMIT = "12 ms"
def f():
    """Passes at p < 0.01 in 3 x 100 updates."""
'''


def test_it_finds_the_figures_of_comments_and_docstrings_only(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(SOURCE)
    found = [(line, figure) for line, figure, _ in figures_in_code.figures(path)]
    assert found == [(1, "3.4 ms"), (1, "0.93"), (1, "0.70 ms"), (1, "+1.3%"), (1, "2.1M tokens/s"),
                     (2, "4.13 GiB"), (2, "4.2472"), (2, "p = 0.00028")]


def test_a_file_outside_the_repository_is_listed_and_a_missing_one_is_one_line(tmp_path, capsys):
    """Both were tracebacks (relative_to the repository; the missing file's FileNotFoundError)."""
    outside = tmp_path / "fig.py"
    outside.write_text("# takes 3.4 ms\nx = 1\n")
    assert figures_in_code.main([str(outside)]) == 0
    assert f"{outside}:1: 3.4 ms" in capsys.readouterr().out
    assert figures_in_code.main([str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "missing.py cannot be read" in err
