"""Merge one results file into another (default results/h200.json), losing nothing.

    python scripts/merge_results.py FROM.json [INTO.json]

Sections of named entries (benchmarks, profiles, evaluations, time-to-target verdicts: results.NAMED_SECTIONS, and
any object of entries with a run_id, mlp_microbench.py's per preset) merge entry by entry, training runs by name, so
nothing already in INTO is lost (a replaced entry moves to its "history"); what FROM itself replaced (an entry run
twice there) joins INTO's history as it was, unless INTO still holds it (FROM a copy of INTO that ran it again). A
list (trained-parity) merges as a union: FROM's rows that INTO lacks are appended to INTO's.

FROM may have started as a copy of INTO (runs made elsewhere on top of it), so it can hold entries that INTO has
moved past since, and an entry of FROM replaces INTO's only if it is newer:
- an entry INTO keeps in its history is older (INTO replaced it); an identical one is already there;
- of two entries with a run_id, the later run is newer (a run_id starts with its start time, %Y%m%dT%H%M%S), and
  of two states of one run (which updates its entry in place, keeping no history) the one further along: more
  sessions, then more updates (step), then finished (a status other than "running");
- of two with a timestamp (evaluations), the later;
- an earlier run or evaluation of FROM than INTO's (another run_id or timestamp) joins INTO's history, as though INTO
  had replaced it; an older state of INTO's own run is dropped;
- other entries carry nothing that orders them: results.record moves each replaced one to the history, so one that
  is not there is FROM's own, and replaces INTO's (which then moves to the history).
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from results import NAMED_SECTIONS, ResultsFileError, locked_update, put, read_results  # noqa: E402


def canonical(path, value):
    return json.dumps([path, value], sort_keys=True, default=str)


def entries(source, data):
    """(keys, value) of each entry of a results file's data but its history: named sections entry by entry."""
    items = []
    for key, value in data.items():
        if key == "history":
            continue
        if not isinstance(value, (dict, list)):  # every entry is an object (a few sections lists): not a results file
            raise ResultsFileError(f"{source} is not a results file: its entry {key!r} is a {type(value).__name__}, "
                                   f"where results.py writes objects; nothing was merged")
        if (key in NAMED_SECTIONS and isinstance(value, dict)) or per_entry(value):
            items += [([key, name], entry) for name, entry in value.items()]
        else:
            items.append(([key], value))
    return items


def per_entry(value):
    """Whether an object holds entries of their own (each with a run_id, as mlp_microbench.py records one per
    preset under its --name), which merge one by one: merged whole, a rerun of one preset dropped the others."""
    return isinstance(value, dict) and "run_id" not in value and bool(value) and all(
        isinstance(v, dict) and isinstance(v.get("run_id"), str) for v in value.values())


def order(value):
    """What orders an entry against others at its place (see the module's docstring): a tuple, or None."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("run_id"), str):
        progress = (value.get("sessions") or 0, value.get("step") or 0, value.get("status") != "running")
        return ("run", value["run_id"], *progress)
    if isinstance(value.get("timestamp"), (int, float)):
        return ("time", value["timestamp"])
    return None


def older(value, current):
    """Whether `value` is not newer than `current` by what both carry; False when they carry nothing comparable."""
    mine, theirs = order(value), order(current)
    return mine is not None and theirs is not None and mine[0] == theirs[0] and mine <= theirs


def merge_entry(data, keys, value, replaced_here, path):
    """Merges one entry of FROM into INTO's data; returns "merged", "same" (already there) or "stale"."""
    node = data
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    current = node.get(keys[-1]) if isinstance(node, dict) else None
    if current == value:
        return "same"
    if isinstance(current, list) and isinstance(value, list):
        rows = [row for row in value if row not in current]
        current.extend(rows)  # appended rows are never replaced values, so nothing goes to the history
        return "merged" if rows else "same"
    if canonical(keys, value) in replaced_here:
        return "stale"
    if current is not None and older(value, current):
        if order(value)[1] != order(current)[1]:  # another run, earlier, under the name: kept in the history
            data.setdefault("history", []).append({"path": keys, "replaced_at": time.time(), "value": value})
            replaced_here.add(canonical(keys, value))
        return "stale"
    put(data, keys, value, path)
    return "merged"


def held(data, path, value):
    """Whether data holds value at path (a list of keys)."""
    for key in path if isinstance(path, list) else [None]:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return data == value


def merge(source, target):
    """Merges source's entries into target; returns how many were merged and how many skipped as no newer than
    target's (entries target already holds count as neither)."""
    data = read_results(source)
    items, counts = entries(source, data), {"merged": 0, "same": 0, "stale": 0}

    def change(into):
        replaced_here = {canonical(h.get("path"), h.get("value")) for h in into.get("history", [])}
        # what source replaced (an entry run twice there) joins target's history, once: not what target still holds
        # there (a copy of target run again), which the merge moves to the history itself if source's entry wins
        replaced = [h for h in data.get("history", []) if canonical(h.get("path"), h.get("value")) not in replaced_here
                    and not held(into, h.get("path"), h.get("value"))]
        if replaced:
            into.setdefault("history", []).extend(replaced)
        for keys, value in items:
            counts[merge_entry(into, keys, value, replaced_here, target)] += 1
    locked_update(Path(target), change)  # one lock and one write, decided on the file as it is then
    return counts["merged"], counts["stale"]


def not_a_file(path):
    return "is not a file" if Path(path).exists() else "does not exist"


def main(argv):
    if len(argv) not in (1, 2):
        print("usage: python scripts/merge_results.py FROM.json [INTO.json]", file=sys.stderr)
        return 2
    source, into = argv[0], argv[1] if len(argv) > 1 else "results/h200.json"
    try:
        if not Path(source).is_file():
            raise ResultsFileError(f"{source} {not_a_file(source)}; give the results file to merge from")
        if not Path(into).is_file():  # a mistyped INTO made a new file that held only FROM's entries
            raise ResultsFileError(f"{into} {not_a_file(into)}; give the results file to merge into (copy {source} "
                                   f"there to start one)")
        merged, stale = merge(source, into)
        print(f"merged {merged} entries of {source} into {into}"
              + (f"; skipped {stale} no newer than {into}'s own" if stale else ""))
    except ResultsFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
