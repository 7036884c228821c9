"""The short table printed at the end of a GPU run: benchmark entries, kernel profiles (milliseconds per
update by category, and the slowest kernels) and training runs of a results file.

    python scripts/summarize.py RESULTS.json [PREFIX ...]    # only names starting with a PREFIX, if given
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import ResultsFileError, read_results  # noqa: E402


def main(path, prefixes):
    if not Path(path).is_file():
        raise ResultsFileError(f"{path} does not exist")
    data = read_results(path)
    wanted = lambda name: not prefixes or name.startswith(tuple(prefixes))
    for name, e in data.get("benchmarks", {}).items():
        if not wanted(name):
            continue
        tps = e.get("tokens_per_second")
        windows = [round(m["tokens_per_second"]) for m in e.get("measurements", [])]
        print(f"{name:<30}{e['status']:>6}{(f'{tps:,.0f}' if tps else '-'):>12}"
              f"  first {e.get('first_update_seconds') or 0:5.1f}s  peak {(e.get('peak_memory_bytes') or 0) / 2**30:5.2f}"
              f"  dev {(e.get('device_peak_used_bytes') or 0) / 2**30:5.2f} GiB  windows {windows}"
              f"  eff {e.get('scaling_efficiency')}  {e.get('error', '')[:90]}")
        if windows:  # the mean training loss of each window: bench trains the recipe from its first update
            print(f"{'':<30}window losses {[round(m['loss'], 5) for m in e['measurements']]}")
    for name, p in data.get("profiles", {}).items():
        if not wanted(name):
            continue
        n = p["profiled_updates"]
        categories = {c: round(ms / n, 2) for c, ms in p["kernel_ms_by_category"].items() if ms}
        print(f"{name}: {p['kernel_ms'] / n:.2f} ms of kernels per update, {categories}")
        for k in p.get("top_kernels", [])[:12]:
            print(f"  {k['ms'] / n:7.3f} ms  x{k['count'] // n:<4} {k['category']:<14}{k['name'][:100]}")
    for name, run in data.items():
        if isinstance(run, dict) and "final_validation" in run and wanted(name):
            validation = run.get("final_validation") or {}
            print(f"{name:<30}{run.get('status')}  validation loss {validation.get('loss')}"
                  f"  validation tok/s {validation.get('tokens_per_second')}"
                  f"  median training tok/s {run.get('median_training_tokens_per_second')}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/summarize.py RESULTS.json [PREFIX ...]")
    try:
        main(sys.argv[1], sys.argv[2:])
    except ResultsFileError as exc:
        sys.exit(f"error: {exc}")
