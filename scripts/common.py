"""What the GPU microbenchmarks in scripts/ share: their pre-flight checks, their timing and their result table."""
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


def entry_name(own):
    """argparse type of a GPU script's --name: its own section's name (the default), or any key that is no other
    section of the results file, whose entries it would replace whole (benchmarks), or its history."""
    import argparse
    from settings import run_name_problem

    def checked(text):
        problem = text != own and run_name_problem(text)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text
    return checked


def add_run_arguments(parser, name, reps):
    """The arguments of every GPU microbenchmark: its repetitions, and where its entry goes."""
    parser.add_argument("--reps", type=positive_int, default=reps)
    parser.add_argument("--name", default=name, type=entry_name(name), help="the results file key")
    parser.add_argument("--results_file", default="results.json")


def names_in(parser, flag, text, valid):
    """The comma-separated names of a flag's text, each one of `valid`; else argparse's one-line error naming the
    valid ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        parser.error(f"{flag}: {', '.join(unknown) or 'no name'} not among {', '.join(valid)}")
    return names


def timed(step, reps):
    """step() 3 times, then `reps` times between two CUDA events: (its last result, milliseconds per call, the
    bytes the calls held at their peak beyond what was allocated before them)."""
    import torch
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        result = step()
    end.record()
    torch.cuda.synchronize()
    return result, start.elapsed_time(end) / reps, torch.cuda.max_memory_allocated() - base


def kernel_ms(fn, reps):
    """GPU kernel milliseconds per call. Wall time would measure the host: flash-attn-4 and quack prepare each
    launch in Python, which CUDA graphs and a busy GPU hide in training but not in a loop of lone calls."""
    import torch
    from torch.profiler import ProfilerActivity

    from profiling import gpu_kernel_ms, quiet_profile
    for _ in range(3):
        fn()
    with quiet_profile([ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(gpu_kernel_ms(evt) for evt in prof.key_averages()) / reps


def relative_error(value, reference):
    return ((value - reference).norm() / reference.norm()).item()


def print_variants(label, results, columns):
    """The GPU scripts' table of what they measured: a row per variant of results ({name: its fields, or
    {"error": text}}), a column per (header, field, format spec) of columns; a field of None is "-"."""
    widths = [max(len(header), 9) + 2 for header, _, _ in columns]
    print(f"{label:<16}" + "".join(f"{header:>{w}}" for (header, _, _), w in zip(columns, widths)))
    for name, fields in results.items():
        if "error" in fields:
            print(f"{name:<16} error: {fields['error']}")
        else:
            print(f"{name:<16}" + "".join(f"{fields[key]:>{w}{spec}}" if fields[key] is not None else f"{'-':>{w}}"
                                          for (_, key, spec), w in zip(columns, widths)))
