"""The docs cite their figures by results entry: each cited entry must exist in the results file the document
names (results/h200.json, or for quack-kernels, update_graph and the cold start results/h200-levers.json and
results/h200-cold-start.json, or for an H100's runs results/h100.json), so that a figure in a document can always be traced to the measurement behind it;
and the GPU smoke runs every GPU command the README gives."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY = re.compile(r"`((?:20m|50m|90m|lever|matched|noise|loss-microbench|ddp2|cold|warm)-[A-Za-z0-9.-]+|tuning|"
                   r"accumulation-check|trained-parity|mlp-microbench)`")
NESTED = ("benchmarks", "profiles")


def cited_entries(text):
    """Entry names in backticks, outside the section of what is still to be measured (not yet recorded)."""
    text = re.sub(r"### Still to be measured.*?(?=\n## )", "", text, flags=re.S)
    return set(ENTRY.findall(text))


def recorded_entries(results):
    names = set(results)
    for section in NESTED:
        names |= set(results.get(section, {}))
    return names


def test_every_entry_the_performance_doc_cites_is_in_the_results_file():
    cited = cited_entries((ROOT / "docs" / "PERFORMANCE.md").read_text())
    recorded = set()
    for name in ("h200.json", "h200-levers.json", "h200-cold-start.json", "h200-shuffled-gutenberg.json",
                 "h100.json"):
        recorded |= recorded_entries(json.loads((ROOT / "results" / name).read_text()))
    assert len(cited) > 20  # the pattern still finds the document's entries
    assert sorted(cited - recorded) == []


def test_every_entry_the_matched_runs_doc_cites_is_in_the_results_file():
    cited = cited_entries((ROOT / "docs" / "MATCHED_RUNS.md").read_text())
    recorded = recorded_entries(json.loads((ROOT / "results" / "h200.json").read_text()))
    assert len(cited) >= 6 and sorted(cited - recorded) == []


def test_a_pending_measurement_is_not_taken_for_a_cited_one():
    text = "a `20m-default` row\n### Still to be measured\n| `matched-new` |\n## Next\n`lever-x`"
    assert cited_entries(text) == {"20m-default", "lever-x"}


def test_every_entry_the_time_to_quality_doc_cites_is_in_a_results_file():
    """TIME_TO_QUALITY.md cites runs by name (``20m-reference-curve``, ``muon-wsd-...``) and benchmarks as
    ``benchmarks.NAME``; each is in results/h200-time-to-quality.json or, where it says so, results/h200.json or
    results/h200-shuffled-gutenberg.json or results/h100.json."""
    text = (ROOT / "docs" / "TIME_TO_QUALITY.md").read_text()
    recorded = set()
    for name in ("h200-time-to-quality.json", "h200-shuffled-gutenberg.json", "h200.json", "h100.json"):
        results = json.loads((ROOT / "results" / name).read_text())
        recorded |= recorded_entries(results) | {f"{s}.{n}" for s in NESTED for n in results.get(s, {})}
    cited = set(re.findall(r"`((?:benchmarks\.)?(?:20m|muon|quality|reference)-[A-Za-z0-9.-]+)`", text))
    assert len(cited) >= 4 and sorted(cited - recorded) == []


def test_every_entry_the_cold_start_doc_cites_is_in_a_results_file():
    """COLD_START.md cites its runs by name; each is in results/h200-cold-start.json or, where it says so,
    results/h200-levers.json or results/h100.json."""
    text = (ROOT / "docs" / "COLD_START.md").read_text()
    cited = set(re.findall(r"`((?:cold|warm|empty-cache|short-train|cache-load|load)-[A-Za-z0-9.-]+)`", text))
    recorded = set()
    for name in ("h200-cold-start.json", "h200-levers.json", "h100.json"):
        recorded |= recorded_entries(json.loads((ROOT / "results" / name).read_text()))
    assert len(cited) >= 15 and sorted(cited - recorded) == []


def commands(lines, ref=""):
    """Each command in lines of shell (python SCRIPT ... or torchrun ... SCRIPT ...) as "SCRIPT CONFIG", CONFIG its
    first argument under config/ (none: "SCRIPT"), torchrun's prefixed "torchrun "; $REF read as ref."""
    found = set()
    for line in lines:
        words = line.replace("$REF", ref).split()
        scripts = [i for i, w in enumerate(words) if w.endswith(".py") and not w.startswith("config/")]
        if not words or words[0] not in ("python", "torchrun") or not scripts:
            continue
        script = words[scripts[0]]
        config = next((w for w in words[scripts[0] + 1:] if w.startswith("config/")), None)
        found.add(("torchrun " if "torchrun" in words else "") + script + (f" {config}" if config else ""))
    return found


def test_the_gpu_smoke_runs_every_gpu_command_of_the_readme():
    """scripts/gpu_smoke.sh is the README's GPU commands with short settings: a command added to the README's GPU
    block (a script, or a script on another config) has its step there too. prepare.py makes the cache it needs."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## On a GPU", 1)[1].split("```", 2)[1]
    smoke = (ROOT / "scripts" / "gpu_smoke.sh").read_text()
    ref = re.search(r"^REF=(\S+)", smoke, flags=re.M).group(1)
    steps = [re.sub(r'^run "[^"]*" ', "", line.strip()) for line in smoke.splitlines()]
    wanted = commands(block.splitlines()) - {"data/prepare.py"}
    assert len(wanted) >= 8 and sorted(wanted - commands(steps, ref)) == []
