"""What the GPU microbenchmarks in scripts/ share: their pre-flight checks and their result table."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's modules, run as a script too
from results import ResultsFileError, read_results  # noqa: E402


def check_gpu_script(parser, results_file, what):
    """Before the GPU scripts' work: a CUDA GPU, and a results file that reads (not a broken one found after the
    work); each failure is argparse's one-line error."""
    import torch
    if not torch.cuda.is_available():
        parser.error(f"this times {what} on a GPU, and PyTorch sees no CUDA GPU here")
    try:
        read_results(results_file)
    except ResultsFileError as exc:
        parser.error(str(exc))


def positive_int(text):
    """argparse type of the GPU scripts' counts (--rows, --reps, ...): an integer of at least 1."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def print_variants(label, results, columns):
    """The GPU scripts' table of what they measured: a row per variant of results ({name: its fields, or
    {"error": text}}), a column per (header, field, format spec) of columns."""
    widths = [max(len(header), 9) + 2 for header, _, _ in columns]
    print(f"{label:<16}" + "".join(f"{header:>{w}}" for (header, _, _), w in zip(columns, widths)))
    for name, fields in results.items():
        if "error" in fields:
            print(f"{name:<16} error: {fields['error']}")
        else:
            print(f"{name:<16}" + "".join(f"{fields[key]:>{w}{spec}}" for (_, key, spec), w in zip(columns, widths)))
