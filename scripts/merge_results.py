"""Merge a results file that came back from the device machine into results/h200.json.

    python scripts/merge_results.py RETURNED.json [INTO.json]

Benchmark, profile and other two-level sections merge entry by entry, training runs by name, all through
env.record_many, so nothing already in INTO is lost (a replaced entry moves to its "history").
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import env  # noqa: E402

NESTED = {"benchmarks", "profiles", "tuning-candidates"}


def merge(source, target):
    items = []
    for key, value in env.read_results(source).items():
        if key == "history":
            continue
        if key in NESTED and isinstance(value, dict):
            items += [([key, name], entry) for name, entry in value.items()]
        else:
            items.append(([key], value))
    env.record_many(target, items)  # one lock and one write for the whole merge
    return len(items)


def main(argv):
    if len(argv) not in (1, 2):
        print("usage: python scripts/merge_results.py RETURNED.json [INTO.json]", file=sys.stderr)
        return 2
    source, into = argv[0], argv[1] if len(argv) > 1 else "results/h200.json"
    try:
        if not Path(source).is_file():
            raise env.ResultsFileError(f"{source} does not exist; give the results file a device call returned")
        print(f"merged {merge(source, into)} entries of {source} into {into}")
    except env.ResultsFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
