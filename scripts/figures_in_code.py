"""List the measured figures in code comments and docstrings outside tests/ and scripts/.

    python scripts/figures_in_code.py [FILE ...]    # default: every tracked .py file outside tests/ and scripts/

A figure is a number with a unit of time, rate, size or percentage (3.4 ms, 2.1M tokens/s, 4.13 GiB, +1.3%, 2.01x),
a loss-like number of three or more decimals, or a measured p-value. Figures belong in docs/, beside their
results entry and command; code names the entry. One line per figure (path:line: the figure | the text around
it), then the count; exits 0 whether or not any is found (2 for a file that cannot be read as Python).
"""
import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = r"ms|us|µs|s|seconds|min|minutes|[KMB]? ?tok(?:en)?s/s|T?FLOP/s|[GMT]iB|[GMT]B(?:/s)?"
NUMBER = r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?[KM]?"
WITH_UNIT = rf"(?: (?:{UNIT})|%|x)(?![\w/])"
FIGURE = re.compile(
    rf"{NUMBER}{WITH_UNIT}"  # 3.4 ms, 2.1M tokens/s, +1.3%, 2.01x
    rf"|{NUMBER}(?=(?:(?: to | against | and | / |, ){NUMBER})+{WITH_UNIT})"  # the 0.93 of "0.93 to 0.70 ms"
    r"|(?<![\w.])\d+\.\d{3,}(?![\w.])"  # a loss or a standard deviation: 4.2472, 0.032
    r"|\bp = 0?\.\d+")  # a measured p-value (not the rule, p < 0.01)


def comments_and_docstrings(source):
    """(line, text) of each comment and each string that stands alone as a statement (docstrings among them)."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(found)


def figures(path):
    """(line, figure, text) of each measured figure in the file's comments and docstrings."""
    return [(n, m.group(0), text.strip()) for n, text in comments_and_docstrings(Path(path).read_text())
            for m in FIGURE.finditer(text)]


def code_files():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [f for f in tracked if not f.startswith(("tests/", "scripts/"))]


def main(argv):
    """Print the figures of argv's files (default: code_files()); 2 with one line for a file that cannot be read or
    parsed as Python, else 0."""
    paths = argv or [ROOT / f for f in code_files()]
    total = 0
    for path in paths:
        resolved = Path(path).resolve()
        shown = resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else path
        try:
            found = figures(path)
        except (OSError, UnicodeDecodeError, SyntaxError, tokenize.TokenError) as exc:
            print(f"error: {path} cannot be read as Python ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        for n, figure, text in found:
            print(f"{shown}:{n}: {figure}  | {text}")
            total += 1
    print(f"{total} measured figures")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
