"""The short table printed at the end of a GPU run: benchmark entries, kernel profiles (milliseconds per
update by category, and the slowest kernels) and training runs of a results file.

    python scripts/summarize.py RESULTS.json [PREFIX ...]    # only names starting with a PREFIX, if given
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plots import finite_number, fmt  # noqa: E402
from results import ResultsFileError, read_existing_results  # noqa: E402


def gib(n_bytes):
    """Bytes as GiB with two decimals, "-" when missing."""
    return fmt(n_bytes / 2**30 if finite_number(n_bytes) else None, "5.2f")


def benchmark_lines(name, e, width):
    tps = fmt(e.get("tokens_per_second"), ",.0f")
    windows = " / ".join(fmt(m.get("tokens_per_second"), ",.0f") for m in e.get("measurements", []))
    first = fmt(e.get("first_update_seconds"), "5.1f", "s")
    lines = [f"{name:<{width}}{e.get('status') or '-':>6}{tps:>12}  first {first:>6}"
             f"  peak {gib(e.get('peak_memory_bytes'))}  dev {gib(e.get('device_peak_used_bytes'))} GiB"
             f"  windows {windows or '-'}  eff {fmt(e.get('scaling_efficiency'), '.2f')}  {(e.get('error') or '')[:90]}"
             .rstrip()]
    if e.get("measurements"):  # the mean training loss of each window: bench trains the recipe from its first update
        losses = " / ".join(fmt(m.get("loss"), ".5f") for m in e["measurements"])
        lines.append(f"{'':<{width}}window losses {losses}")
    return lines


def profile_lines(name, p):
    n = p.get("profiled_updates")
    if not isinstance(n, int) or n < 1 or not isinstance(p.get("kernel_ms_by_category"), dict):
        return [f"{name}: a partial profile (no profiled_updates or kernel_ms_by_category), left out"]
    categories = ", ".join(f"{c} {fmt(ms / n, '.2f')}" for c, ms in p["kernel_ms_by_category"].items() if ms)
    kernel_ms = p.get("kernel_ms")
    lines = [f"{name}: {fmt(kernel_ms / n if finite_number(kernel_ms) else None, '.2f')} ms of kernels per update "
             f"({categories})"]
    for k in p.get("top_kernels", [])[:12]:
        lines.append(kernel_line(k, n))
    return lines


def kernel_line(k, n):
    """One of the slowest kernels, per update; "-" for a field a hand-cut entry lacks."""
    ms, count = k.get("ms"), k.get("count")
    times = f"x{count // n}" if isinstance(count, int) else "x-"
    return (f"  {fmt(ms / n if finite_number(ms) else None, '7.3f')} ms  {times:<5} {str(k.get('category', '-')):<14}"
            f"{str(k.get('name', '-'))[:100]}")


def run_line(name, run, width):
    validation = run.get("final_validation") or {}
    return (f"{name:<{width}}{run.get('status')}  validation loss {fmt(validation.get('loss'), '.4f')}"
            f"  validation tok/s {fmt(validation.get('tokens_per_second'), ',.0f')}"
            f"  median training tok/s {fmt(run.get('median_training_tokens_per_second'), ',.0f')}")


def main(path, prefixes):
    data = read_existing_results(path)
    wanted = lambda name: not prefixes or name.startswith(tuple(prefixes))
    benchmarks = {n: e for n, e in data.get("benchmarks", {}).items() if wanted(n)}
    runs = {n: r for n, r in data.items() if isinstance(r, dict) and "final_validation" in r and wanted(n)}
    width = max(map(len, [*benchmarks, *runs]), default=0) + 2  # a long name does not push its row out of line
    lines = [line for name, e in benchmarks.items() for line in benchmark_lines(name, e, max(width, 30))]
    lines += [line for name, p in data.get("profiles", {}).items() if wanted(name) for line in profile_lines(name, p)]
    lines += [run_line(name, run, max(width, 30)) for name, run in runs.items()]
    if lines:
        print("\n".join(lines))
    elif prefixes:
        print(f"no entry of {path} starts with {', '.join(prefixes)}", file=sys.stderr)

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/summarize.py RESULTS.json [PREFIX ...]")
    try:
        main(sys.argv[1], sys.argv[2:])
    except ResultsFileError as exc:
        sys.exit(f"error: {exc}")
