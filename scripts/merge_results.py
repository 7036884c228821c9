"""Merge one results file into another (default results/h200.json), losing nothing.

    python scripts/merge_results.py FROM.json [INTO.json]

Sections of named entries (benchmarks, profiles, evaluations, time-to-target verdicts: results.NAMED_SECTIONS) merge
entry by entry, training runs by name, all through record_many, so nothing already in INTO is lost (a replaced entry
moves to its "history"); what FROM itself replaced (an entry run twice there) joins INTO's history as it was.

FROM may have started as a copy of INTO (runs made elsewhere on top of it), so it can hold entries that INTO has
replaced since: an entry whose value INTO keeps in its history is skipped, not merged over the newer one.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import NAMED_SECTIONS, ResultsFileError, lookup, read_results, record_many  # noqa: E402


def canonical(path, value):
    return json.dumps([path, value], sort_keys=True, default=str)


def merge(source, target):
    """Merges source's entries into target; returns how many were merged and how many skipped as stale."""
    items, data = [], read_results(source)
    for key, value in data.items():
        if key == "history":
            continue
        if not isinstance(value, (dict, list)):  # every entry is an object (a few sections lists): not a results file
            raise ResultsFileError(f"{source} is not a results file: its entry {key!r} is a {type(value).__name__}, "
                                   f"where results.py writes objects; nothing was merged")
        if key in NAMED_SECTIONS and isinstance(value, dict):
            items += [([key, name], entry) for name, entry in value.items()]
        else:
            items.append(([key], value))
    replaced_here = {canonical(h.get("path"), h.get("value")) for h in lookup(target, ["history"], [])}
    fresh = [(keys, value) for keys, value in items if canonical(keys, value) not in replaced_here]
    # what source replaced (an entry run twice there) joins target's history, once
    replaced = [h for h in data.get("history", [])
                if canonical(h.get("path"), h.get("value")) not in replaced_here]
    record_many(target, fresh, replaced)  # one lock and one write for the whole merge
    return len(fresh), len(items) - len(fresh)


def main(argv):
    if len(argv) not in (1, 2):
        print("usage: python scripts/merge_results.py FROM.json [INTO.json]", file=sys.stderr)
        return 2
    source, into = argv[0], argv[1] if len(argv) > 1 else "results/h200.json"
    try:
        if not Path(source).is_file():
            raise ResultsFileError(f"{source} does not exist; give the results file to merge from")
        merged, stale = merge(source, into)
        print(f"merged {merged} entries of {source} into {into}"
              + (f"; skipped {stale} that {into} has replaced since" if stale else ""))
    except ResultsFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
