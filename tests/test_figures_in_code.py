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
