"""scripts/gpu_smoke.sh's running of its steps, with a stand-in `python` that logs each command and sleeps: the
steps run in their order, at most JOBS at a time, a step that needs an earlier one's run starts after it ended, and
a failure names its step and exits non-zero. (That the commands run on a GPU is what the script itself checks.)"""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "scripts" / "gpu_smoke.sh"

# The stand-in: one GPU; --stop_after_updates exits 3 as train.py does; a command matching $FAIL exits 1 at once, one
# matching $LONG runs 30 s (until it is stopped). Each command's start and end are appended to $CALLS (a line each,
# short enough to be written whole).
STAND_IN = r"""#!/usr/bin/env bash
if [ "$1" = "-c" ]; then echo 1; exit 0; fi
echo "start $$ $*" >> "$CALLS"
echo "the output of $*"
if [ -n "${FAIL:-}" ] && [[ "$*" == *"$FAIL"* ]]; then echo "the last words of a failing step"; exit 1; fi
if [ -n "${LONG:-}" ] && [[ "$*" == *"$LONG"* ]]; then sleep 30; else sleep "${PAUSE:-0.2}"; fi
echo "end $$ $*" >> "$CALLS"
case "$*" in *--stop_after_updates*) exit 3 ;; esac
exit 0
"""


def smoke(tmp_path, *args, **env):
    """Runs the smoke with the stand-in first on PATH; returns (exit status, output, the calls' events in order)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    full_env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls),
                    **{k: str(v) for k, v in env.items()})
    done = subprocess.run(["bash", str(SMOKE), str(tmp_path / "smoke" / "results.json"), *map(str, args)],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=120)
    events = [line.split(" ", 2) for line in calls.read_text().splitlines()]
    return done.returncode, done.stdout + done.stderr, events


def script_of(command):
    """The script a command runs, its --name (the step's run), and "export" for the export."""
    name = re.search(r"--name=(\S+)", command)
    return command.split()[0] + (f" {name.group(1)}" if name else "") + (" export" if "--export_hf" in command else "")


def spans(events):
    """{script and name: (index of its first start, index of its last end)} over the event list."""
    found = {}
    for at, (kind, _, command) in enumerate(events):
        key = script_of(command)
        first, last = found.get(key, (at, at))
        found[key] = (min(first, at), at if kind == "end" else last)
    return found


def most_at_once(events):
    running = most = 0
    for kind, _, _ in events:
        running += 1 if kind == "start" else -1
        most = max(most, running)
    return most


@pytest.mark.parametrize("jobs", [1, 3])
def test_every_step_runs_and_a_step_that_needs_an_earlier_run_waits_for_it(tmp_path, jobs):
    status, out, events = smoke(tmp_path, JOBS=jobs)
    assert status == 0, out
    assert "=== gpu smoke passed: 20 commands" in out and out.count("=== ok:") == 20
    at = spans(events)
    first_train, export = at["train.py smoke-train"], at["sample.py smoke-train export"]
    assert most_at_once(events) == jobs  # three at a time did overlap, and never more
    # the first train runs alone (it fills the compiler caches; sample, export and evaluate read its checkpoint);
    # tune writes the config the tuned compare reads
    assert at["tune.py smoke-tune"][1] < at["compare.py smoke-compare"][0]
    assert all(first_train[1] < first for key, (first, _) in at.items() if key != "train.py smoke-train")
    for after_export in ("evaluate.py smoke-eval-export", "train.py smoke-init"):
        assert export[1] < at[after_export][0]
    assert [(kind, command.split()[0]) for kind, _, command in events[-2:]] == [("start", "scripts/plot_runs.py"),
                                                                                ("end", "scripts/plot_runs.py")]
    # the resume step: the stopped run, then its resume, one after the other
    resume = [(kind, command) for kind, _, command in events if "smoke-resume" in command]
    assert [kind for kind, _ in resume] == ["start", "end", "start", "end"] and "--resume=True" in resume[2][1]
    if jobs > 1:
        assert (tmp_path / "smoke" / "logs" / "1.log").read_text().startswith("the output of train.py")


def test_a_failing_step_is_named_with_its_last_lines_and_nothing_after_it_starts(tmp_path):
    # the two benches before it are still running when it fails, however slowly this machine reports their ends
    status, out, events = smoke(tmp_path, JOBS=3, FAIL="--presets", LONG="--name=smoke-bench")
    assert status == 1
    assert "=== FAILED: step 11, bench, presets (exit 1): python bench.py" in out
    assert "the last words of a failing step" in out and "gpu smoke passed" not in out
    started = {script_of(command) for kind, _, command in events if kind == "start"}
    assert "sample.py smoke-train" not in started and "evaluate.py smoke-eval" not in started
    # the steps in flight then were stopped, each named: a command that started and never ended is one of them
    ended = {pid for kind, pid, _ in events if kind == "end"}
    cut = [script_of(command) for kind, pid, command in events if kind == "start" and pid not in ended]
    assert len(cut) == 3 and "bench.py smoke-presets" in cut  # the failing one and the two beside it
    assert len(re.findall(r"^=== stopped: step \d+, ", out, flags=re.M)) == 2


def test_a_step_past_its_limit_is_stopped_and_named(tmp_path):
    status, out, _ = smoke(tmp_path, 1, 1, JOBS=2, STEP_LIMIT=1, PAUSE=5)
    assert status == 1 and "=== FAILED: step 1, train, the reference recipe (stopped after its 1 s limit)" in out


def test_first_and_last_choose_the_steps(tmp_path):
    status, out, events = smoke(tmp_path, 15, 16, JOBS=3)
    assert status == 0, out
    assert sorted(script_of(command) for kind, _, command in events if kind == "start") == [
        "sample.py smoke-train", "sample.py smoke-train export"]  # at once: both read the first train's checkpoint
    assert "=== gpu smoke passed: 2 commands (steps 15 to 16)" in out


@pytest.mark.parametrize("name, value", [("JOBS", "0"), ("JOBS", "two"), ("STEP_LIMIT", "-5"), ("FIRST", "abc"),
                                         ("LAST", "1.5")])
def test_a_bad_setting_is_refused_in_one_line(tmp_path, name, value):
    args = {"FIRST": (value, 20), "LAST": (1, value)}.get(name, ())
    status, out, events = smoke(tmp_path, *args, **({} if args else {name: value}))
    assert status == 2 and events == []
    assert out.strip().count("\n") == 0 and out.startswith(f"{name} must be a whole number") and f"'{value}'" in out


def test_it_runs_from_the_repository_root_wherever_it_is_started(tmp_path):
    """The steps name the scripts by their paths in the repository (train.py, scripts/plot_runs.py): started from
    another folder, it goes to the root, and a results file given relative to where it was started stays there."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "bin").mkdir()
    where = '#!/usr/bin/env bash\n[ "$1" = -c ] && { echo 1; exit; }\npwd >> "$CALLS"\n'  # where each command ran
    (tmp_path / "bin" / "python").write_text(where)
    (tmp_path / "bin" / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    done = subprocess.run(["bash", str(SMOKE), "mine/results.json", "15", "15"], cwd=tmp_path / "elsewhere",
                          env=dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                                   CALLS=str(calls)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert calls.read_text().splitlines() == [str(ROOT)]  # the sample step ran at the root
    assert (tmp_path / "elsewhere" / "mine").is_dir()


def test_first_above_last_is_refused_in_one_line(tmp_path):
    status, out, events = smoke(tmp_path, 5, 2)
    assert status == 2 and events == []
    assert out.strip().count("\n") == 0 and out.startswith("FIRST (5) must not be above LAST (2)"), out


def test_steps_that_select_no_command_fail(tmp_path):
    """FIRST past the last step runs nothing, which must not read as a passed smoke."""
    status, out, events = smoke(tmp_path, 25, 30)
    assert status == 2 and events == []
    assert "gpu smoke passed" not in out and "=== gpu smoke ran no command: steps 25 to 30" in out


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_a_signal_stops_the_steps_in_flight_and_the_script(tmp_path, jobs, sig):
    """timeout keeps a step out of the terminal's signals: Ctrl-C let step 1 run to its end and went on to step 2
    (JOBS=1), or killed the script and left its steps running (JOBS=2)."""
    import signal
    import time
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(STAND_IN)
    (bin_dir / "python").chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls), LONG="--name=smoke",
               JOBS=str(jobs))
    # as from a terminal: SIGINT at its default (pytest-xdist's workers ignore it, and a shell cannot trap a signal
    # ignored when it started)
    proc = subprocess.Popen(["bash", str(SMOKE), str(tmp_path / "smoke" / "results.json")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 30
    while "start" not in calls.read_text() and time.time() < deadline:
        time.sleep(0.05)
    begin = time.time()
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.time() - begin < 20, out
    assert "=== stopped by a signal at step 1" in out and "step 2" not in out
    started = [line.split()[1] for line in calls.read_text().splitlines() if line.startswith("start")]
    time.sleep(0.5)
    assert started and not [pid for pid in started if os.path.exists(f"/proc/{pid}")]  # no step left running
