"""Merge a results file that came back from the device machine into results/h200.json.

    python scripts/merge_results.py RETURNED.json [INTO.json]

Benchmark, profile and other two-level sections merge entry by entry, training runs by name, all through
env.record, so nothing already in INTO is lost (a replaced entry moves to its "history").
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402

NESTED = {"benchmarks", "profiles", "tuning-candidates"}


def merge(source, target):
    data = env.read_results(source)
    count = 0
    for key, value in data.items():
        if key == "history":
            continue
        if key in NESTED and isinstance(value, dict):
            for name, entry in value.items():
                env.record(target, [key, name], entry)
                count += 1
        else:
            env.record(target, [key], value)
            count += 1
    return count


if __name__ == "__main__":
    into = sys.argv[2] if len(sys.argv) > 2 else "results/h200.json"
    print(f"merged {merge(sys.argv[1], into)} entries of {sys.argv[1]} into {into}")
