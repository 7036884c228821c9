"""compare.py's runs, for both its modes: each one's config, folders and recipe, checked before any trains; then
train.py subprocesses, one after the other, each trained, or reused when a complete run of the same config, recipe
and code is recorded from this machine, or resumed when it ended unfinished with its checkpoint in place; SIGINT and
SIGTERM pass on to the running train.py, which checkpoints and stops, and compare.py then stops too (Stopped)."""
import functools
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import checkpoint
import env
import plan as plan_lib
import plots
import settings
from configurator import ConfigError, load_config, write_config_file
from plan import EXIT_INTERRUPTED, run_dir
from results import lookup

TRAIN_DEFAULTS = settings.defaults(settings.TrainSettings)



class CompareError(ValueError):
    """A comparison that cannot be made as asked: a user mistake, reported in one line."""


# ---------------------------------------------------------------- the runs' configs, checked

def run_folders(cfg, side):
    """A run's own out_dir ("" for out/<its name>), so that no two runs share one, and compare's tensorboard_dir as
    given: train.py writes each run's events into <tensorboard_dir>/<run name> (dashboard.py), and the runs' names
    differ, so `tensorboard --logdir` on it shows each run once, not nested under its side as well."""
    return {"out_dir": str(Path(cfg.out_dir) / side) if cfg.out_dir else "",
            "tensorboard_dir": cfg.get("tensorboard_dir") or ""}


def seed_run_name(baseline_name, seed):
    return f"{baseline_name}-seed{seed}"


def run_plan(side, c, hint=""):
    """The plan train.py will make of run c (one process); what train.py would refuse is refused now, in one line
    (hint follows a refusal of the micro-batch)."""
    try:
        return plan_lib.resolve(c, world=(0, 0, 1))
    except ConfigError as exc:
        raise CompareError(f"{side} run: {exc}{hint if 'micro_batch_size' in str(exc) else ''}") from None


def run_recipe(side, c, hint=""):
    """The recipe train.py will record for run c, refused as run_plan refuses it."""
    return run_plan(side, c, hint).recipe


def check_plot_path(path):
    """Refuse a plot path matplotlib cannot write, before anything is trained or compared."""
    try:
        plots.check_path(path, "--plot")
    except plots.PlotError as exc:
        raise CompareError(str(exc)) from None


# ---------------------------------------------------------------- training them

class RunFailed(RuntimeError):
    """A training subprocess exited with an error (its own output says why)."""


class Stopped(Exception):
    """A run stopped checkpointed (a signal, or its stop_after_updates), so compare.py stops; the message says
    what was stopped and how to go on."""


class SignalForwarder:
    """While runs train, SIGINT and SIGTERM go to the running train.py, which checkpoints at its next update and
    exits (status interrupted) while its output is still read; compare.py stops after it (Stopped).

    Each child is started outside compare.py's process group, so a terminal's Ctrl-C reaches it once, through
    here: a second signal tells train.py to stop at once, without its checkpoint, as a second Ctrl-C does to
    train.py alone."""

    def __init__(self):
        self.signal, self.proc, self.previous = None, None, {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.signal = signum
        self.forward()

    def forward(self):
        if self.signal is not None and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.signal)

    def name(self):
        return signal.Signals(self.signal).name


def stream(side, cmd, signals):
    """Run cmd, printing its output line by line with a [side] prefix; returns its exit status. A signal to
    compare.py is passed on to it (signals: the SignalForwarder)."""
    child_env = dict(os.environ, PYTHONUNBUFFERED="1")  # progress lines as they happen, not at exit
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                            start_new_session=True)
    signals.proc = proc
    signals.forward()  # a signal that came while it was starting
    try:
        for line in proc.stdout:  # reading on through a signal: the child's last lines say where it stopped
            print(f"[{side}] {line}", end="", flush=True)
        return proc.wait()
    finally:
        signals.proc = None


def launch_free(config):
    return env.hash_json({k: v for k, v in config.items() if k not in settings.LAUNCH_KEYS})


def recorded_run(c, args, recipe_identity):
    """The results entry of this run when it ran this config and recipe on this code (else None); a complete one
    only when it ran on this machine too, since reusing it reuses its times (one line says when it did not)."""
    old = lookup(c.results_file, [c.name])
    # The config train.py will record: the same loader on the same arguments.
    expected = load_config(TRAIN_DEFAULTS, args)
    if not (isinstance(old, dict) and old.get("recipe_identity") == recipe_identity
                and launch_free(old.get("config") or {}) == launch_free(expected)
                and (old.get("environment") or {}).get("source_hash") == env.source_hash()):
        return None
    moved = other_machine(old) if old.get("status") == "complete" else ""
    if moved:
        print(f"not reusing {c.name}: {moved}; it trains again")
        return None
    return old


# What a run's times depend on besides its config and code, with the words that name each.
MACHINE_WORDS = {"gpu": "GPU", "cpu_model": "CPU", "torch": "torch"}


@functools.cache
def this_machine():
    """This machine's GPU model, CPU model and torch version, by the functions env.fingerprint records them with
    (the GPU and CPU as tune.py's BenchRunner.where keys its measurements)."""
    return {"gpu": env.gpu_model(), "cpu_model": env.cpu_model(), "torch": env.package_versions(("torch",))["torch"]}


def recorded_machine(entry):
    environment = entry.get("environment") if isinstance(entry.get("environment"), dict) else {}
    versions = environment.get("versions") if isinstance(environment.get("versions"), dict) else {}
    return {"gpu": environment.get("gpu"), "cpu_model": environment.get("cpu_model"), "torch": versions.get("torch")}


def other_machine(entry):
    """Where the recorded run's machine differs from this one, in words ("" when it does not)."""
    recorded, here = recorded_machine(entry), this_machine()
    differ = [k for k in MACHINE_WORDS if recorded[k] != here[k]]
    words = lambda machine: ", ".join(f"{MACHINE_WORDS[k]} {machine[k] or 'none'}" for k in differ)
    return f"recorded on {words(recorded)}, this machine has {words(here)}" if differ else ""


def checkpoint_run_id(path):
    """The run_id a checkpoint continues (None when there is none, or it does not read)."""
    return checkpoint.peek(path, "run_id") if path.is_file() else None


def resumable(old, ckpt):
    """Whether the checkpoint ckpt continues the recorded run old, which did not complete: stopped (interrupted),
    killed (SIGKILL, out of memory: still running), or ended by a second signal or an error (aborted, failed). Not
    a diverged run: its outcome is final, and resumed from its last finite weights it could complete on a GPU (whose
    kernels are not deterministic) and drop the divergence from the verdict; it trains again as it first did."""
    return bool(old and old.get("status") not in ("complete", "diverged") and old.get("run_id")
                and checkpoint_run_id(ckpt) == old["run_id"])


def train_or_reuse(side, c, recipe_identity, rerun, signals):
    """Train the run with train.py, unless a complete run of the same config, recipe and code is recorded (on this
    machine); resume it when it ended unfinished with its checkpoint in place (killed or failed, not only stopped)."""
    out = run_dir(c)
    config_path = out / "compare_config.py"
    try:
        write_config_file(config_path, c, TRAIN_DEFAULTS,
                          header=f"The {side} run {c.name}, written by compare.py.\n"
                                 f"Rerun it with: python train.py {config_path}")
    except OSError as exc:  # out_dir names a file, say, or a folder this user cannot write
        raise ConfigError(f"the {side} run {c.name} cannot keep its files in {out} ({exc.strerror}); set out_dir "
                          f"to a folder that can hold them, or leave it empty for out/NAME") from None
    args = [str(config_path), f"--name={c.name}", f"--results_file={c.results_file}"]
    old = None if rerun else recorded_run(c, args, recipe_identity)
    # complete, with the full validation its config asked for (time-to-target runs need none)
    if old and old.get("status") == "complete" and (old.get("final_validation") or not c.full_validation):
        print(f"{side}: reusing the complete run {c.name} of the same config and code in {c.results_file} "
              f"(pass --rerun=True to train again)")
        return
    ckpt = checkpoint.in_folder(out)
    launch = []
    if resumable(old, ckpt):
        launch = ["--resume=True"]
        status = old["status"]
        why = "" if status == "interrupted" else f" (status {status}: it ended unfinished)"
        print(f"{side}: resuming the stopped run {c.name}{why} from {ckpt}")
    elif ckpt.exists():
        launch = ["--overwrite=True"]  # compare.py trains this side again: the old checkpoint is not its run
    cmd = [sys.executable, str(env.REPO / "train.py"), *args, *launch]
    print(f"{side}: {shlex.join(cmd)}", flush=True)
    code = stream(side, cmd, signals)
    signalled = signals.signal is not None
    if signalled or code == EXIT_INTERRUPTED:  # the second: stop_after_updates, or a signal sent to it alone
        by = f"by {signals.name()}" if signalled else "by train.py itself"
        raise Stopped(stopped_message(side, c.name, args, code, by, rerun))
    if code:
        raise RunFailed(f"the {side} run {c.name} exited with status {code}; its output is above")


def go_on(rerun):
    # with --rerun=True the same command would train every run afresh instead of going on
    return "run this compare.py command again" + (" without --rerun=True" if rerun else "")


def stopped_message(side, name, args, code, by, rerun):
    """One line: what stopped ("by SIGTERM", say), and how to go on."""
    again = go_on(rerun)
    if code == EXIT_INTERRUPTED:
        script = os.path.relpath(env.REPO / "train.py")
        script = str(env.REPO / "train.py") if script.startswith("..") else script
        resume = shlex.join(["python", script, *args, "--resume=True"])
        return (f"stopped {by}: the {side} run {name} is checkpointed (status interrupted); {again} to resume it "
                f"and go on, or resume it alone with: {resume}")
    if code == 0:
        return f"stopped {by} after the {side} run {name} finished; {again} to go on (it is reused)"
    return (f"stopped {by}: the {side} run {name} ended with status {code} (stopped at once by a second signal, "
            f"or failed); {again} to go on (it resumes from the run's last checkpoint, if there is one)")


def train_all(cfg, runs, keep_going=False):
    """Train (or reuse, or resume) each (side, config, recipe identity) in turn, passing signals on. With
    keep_going a failed run is reported and the next one trains (a seed that fails is part of a time-to-target
    verdict, not the end of it): returns {name: error} of the failed runs."""
    failed = {}
    with SignalForwarder() as signals:
        for side, c, identity in runs:
            if signals.signal is not None:
                raise Stopped(f"stopped by {signals.name()} before the {side} run {c.name} began; "
                              f"{go_on(cfg.rerun)} to go on (finished runs are reused)")
            try:
                train_or_reuse(side, c, identity, cfg.rerun, signals)
            except RunFailed as exc:
                if not keep_going:
                    raise
                print(f"{side}: {exc}; going on with the next run", flush=True)
                failed[c.name] = str(exc)
    return failed
