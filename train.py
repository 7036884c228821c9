"""Train a tiny-llm model: python train.py config/20m_gh200.py [--key=value ...]   (--help lists the keys)

One process per GPU; `torchrun --nproc_per_node=N train.py ...` runs DistributedDataParallel.
plan.py checks the settings and resolves the run; trainer.py holds the update step (bench.py times the same one);
metrics.py keeps the run's state and accounting. This file is the run's lifecycle: start or resume, the loop with
its validations and checkpoints when they are due, and the end its stop reason calls for.
"""
import signal
import sys
import time

from model_kernels import first_calls

if __name__ == "__main__":  # before torch's import: a cold run's helpers import beside this process (start_early)
    first_calls.start_early(sys.argv[1:])

import torch

import checkpoint
import env
import model as model_lib
import optim
import plan as plan_lib
import process_guard
import settings
from configurator import ConfigError, load_config
from data.loader import Prefetcher, eval_batch_count, eval_batches
from distributed import all_reduce_sum, end_distributed
from metrics import RESUME_FIELDS, Metrics, final_validation_result
from plan import EXIT_DIVERGED, EXIT_INTERRUPTED, USER_ERRORS, run_dir, training_data
from trainer import Trainer

TrainSettings = settings.TrainSettings
DEFAULTS = settings.defaults(TrainSettings)
INTERRUPTING = ("signal", "stop_after_updates")  # stop reasons that leave the run to resume; "target" and "end" finish


# ---------------------------------------------------------------- signals

class StopRequest:
    """Turns SIGTERM/SIGINT/SIGHUP (a scheduler's time limit, Ctrl-C, a closed terminal) into a checkpoint at the
    next update. The first signal is acknowledged at once and stops a validation pass early; a second one (not the
    first arriving twice) ends the process without a checkpoint."""

    SAME_STOP_SECONDS = process_guard.SAME_STOP_SECONDS  # a scheduler may signal the process, and its parent too

    def __init__(self, when="at the next update"):
        self.signal, self.signalled_at, self.when = None, None, when
        self.previous = process_guard.install(self._handle)  # not a SIGHUP that nohup ignores

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now, unless it is the first one arriving twice
            if time.monotonic() - self.signalled_at < self.SAME_STOP_SECONDS:
                return
            signal.signal(signum, self.previous[signum])
            raise KeyboardInterrupt
        self.signal, self.signalled_at = signum, time.monotonic()
        process_guard.stop_requested(f"{signal.Signals(signum).name} received: stopping {self.when} with a "
                                     f"checkpoint (a second one stops at once, without one)\n")

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- the run's folder

def prepare_out_dir(cfg, main_process=True):
    """The run's checkpoint path, its folder made now and locked for this process (a second train.py of the same
    run is refused). A checkpoint already there is a run of this name: continued with resume, replaced with
    overwrite (removed now: a run that fails before its own first checkpoint must not leave the old one for a
    resume to continue), else refused. Returns (checkpoint path, the held lock or None)."""
    from filelock import FileLock, Timeout
    out = run_dir(cfg)
    ckpt = checkpoint.in_folder(out)
    if ckpt.exists() and not cfg.resume and not cfg.overwrite:
        raise ConfigError(f"{ckpt} exists: a run named {cfg.name!r} trained there; continue it with --resume=True, "
                          f"start it afresh with --overwrite=True, or choose another --name")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"out_dir {str(out)!r} cannot be made ({exc.strerror}); give a writable folder") from None
    if not main_process:
        return ckpt, None
    lock = FileLock(str(out / "run.lock"), timeout=0)
    try:
        lock.acquire()
        if cfg.overwrite:
            ckpt.unlink(missing_ok=True)
    except Timeout:
        raise ConfigError(f"another train.py is running {cfg.name!r} in {out} now; wait for it, or choose another "
                          f"--name") from None
    except OSError as exc:  # a folder of another user's, or read-only
        lock.release()
        raise ConfigError(f"out_dir {str(out)!r} cannot be written ({exc.strerror}); give a writable folder") from None
    return ckpt, lock


# ---------------------------------------------------------------- the training run

EVALUATION_SHAPES = 2  # the validation subset's batch and the full validation's, beside the training shapes


def allow_recompiles(training_shapes):
    """torch.compile (dynamic=False) compiles each input shape once, and past torch._dynamo.config.recompile_limit
    runs further shapes uncompiled: room for the run's training shapes (one per seq_len_schedule context) and
    evaluation's."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, training_shapes + EVALUATION_SHAPES)


class Run:
    """One training run of a plan: its data, trainer and accounting, and the steps train() takes."""

    def __init__(self, plan):
        self.plan, self.cfg = plan, plan.cfg
        self.main_process, self.world_size = plan.main_process, plan.world_size
        self.stop = None  # the StopRequest, from the loop's start
        self.data = training_data(plan)
        self.total_updates = self.data.updates_per_epoch * self.cfg.epochs
        for line in settings.doubtful_values(self.cfg, self.total_updates) if self.main_process else ():
            print(f"warning: {line}")
        # after every check, so that a refused run leaves no folder
        self.ckpt_path, self.lock = prepare_out_dir(self.cfg, self.main_process)
        try:
            if self.cfg.compile:
                allow_recompiles(len(self.data.contexts()))
            self.trainer = Trainer.from_plan(plan, self.total_updates)
            if plan.initial and self.main_process:
                print(f"initial weights from {self.cfg.init_from} ({plan.initial.source}, "
                      f"{plan.initial.sha256[:12]})")
            self.metrics = Metrics(self.cfg, self.trainer, self.facts())
            self.session_updates, self.last_checkpoint_time, self.time_due = 0, time.time(), False
        except BaseException:  # out of memory, say: no run of this process holds the folder any more
            self.release()
            raise

    def facts(self):
        """What the entry reports that does not change while the run trains."""
        plan = self.plan
        gpu = torch.cuda.get_device_name(plan.device) if plan.device.startswith("cuda") else None
        return {"main_process": self.main_process, "world_size": self.world_size, "device": plan.device,
                "flops": model_lib.flops_per_token(plan.model, self.cfg.seq_len,
                                                   settings.schedule_steps(self.cfg.seq_len_schedule)), "gpu_name": gpu,
                "parameters": sum(p.numel() for p in self.trainer.raw_model.parameters()),
                "total_updates": self.total_updates, "total_tokens": self.data.tokens_per_epoch * self.cfg.epochs,
                "recipe": plan.recipe, "recipe_id": plan.recipe_id,
                "fingerprint": env.fingerprint(plan.cache.identity) if self.main_process else None}

    @property
    def state(self):
        return self.metrics.state

    # -- resume or start

    def resume_or_start(self):
        """Continue from the checkpoint when resume is set and one exists (refused if its recipe differs)."""
        cfg, path = self.cfg, self.ckpt_path
        if cfg.resume and path.exists():
            try:
                self.load(checkpoint.to_resume(path, self.plan.device, self.plan.recipe, RESUME_FIELDS))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif cfg.resume:
            print(f"no checkpoint at {path}: starting from scratch")
        self.metrics.start_session()
        self.metrics.open_dashboards(path.parent)

    def load(self, ckpt):
        self.trainer.raw_model.load_state_dict(ckpt["model"])
        optim.load_state(self.trainer.optimizer, ckpt["optimizer"])
        self.trainer.load_checkpoint_state(ckpt)  # the weights' average, with ema
        self.trainer.step = ckpt["step"]
        checkpoint.set_rng_state(ckpt["rng"], self.plan.device)
        self.metrics.restore(ckpt)
        print(f"resumed {self.ckpt_path} at update {self.trainer.step} (epoch {self.state.epoch + 1}, "
              f"update {self.state.update_in_epoch} of {self.data.updates_per_epoch})")

    def announce(self):
        if not self.main_process:
            return
        cfg, data, facts, plan = self.cfg, self.data, self.metrics.facts, self.plan
        compiles = cfg.compile and self.state.first_update_seconds is None
        contexts = (f", contexts {data.contexts()} (seq_len_schedule {cfg.seq_len_schedule}"
                    + ("; in whole rows, one shape: context_windows)" if data.context_windows else ")")
                    if plan.context_steps else "")
        print(f"{cfg.name}: {facts['parameters']:,} parameters, {data.n_sequences:,} sequences of {cfg.seq_len} per "
              f"epoch, {data.updates_per_epoch} updates per epoch x {cfg.epochs} epochs, micro-batch "
              f"{cfg.micro_batch_size} x {plan.micro_steps} accumulation x {self.world_size} process(es), "
              f"{plan.device}, attention {plan.attention} ({plan.attention_reason}), optimizer {cfg.optimizer}, "
              f"recipe {plan.recipe_id[:12]}{contexts}" + ("; the first update compiles the model" if compiles else ""),
              flush=True)

    # -- the updates

    def updates(self):
        """(micro-batches of this rank, target tokens) of every update left, epoch after epoch, from where the run
        stands; an epoch's batches start once the previous epoch's validation has counted it."""
        cfg = self.cfg
        while self.state.epoch < cfg.epochs:
            epoch, start = self.state.epoch, self.state.update_in_epoch
            make = lambda u: self.data.micro_batches(epoch, u, cfg.micro_batch_size, self.plan.rank, self.world_size)
            for _, micro_batches, n_tokens in Prefetcher(make, range(start, self.data.updates_per_epoch),
                                                         self.plan.device):
                yield micro_batches, n_tokens
            if self.state.epoch == epoch:  # the epoch's validation did not end (a stop): nothing follows
                return

    def update(self, micro_batches, n_tokens):
        """One optimizer update, counted; the log line every log_interval updates and at an epoch's end."""
        loss_sum, grad_norm = self.trainer.update(micro_batches, n_tokens)
        self.metrics.count(loss_sum, n_tokens)
        if self.trainer.compile_cache_due():
            with self.metrics.paused():  # writing the file is no training
                self.trainer.save_compile_cache()
        self.session_updates += 1
        if self.trainer.step % self.cfg.log_interval == 0 or self.epoch_done():
            self.metrics.log(grad_norm)

    def epoch_done(self):
        """The epoch's updates are done and its validation has not yet counted it."""
        return self.state.update_in_epoch == self.data.updates_per_epoch

    # -- what is due

    def validation_due(self, epoch_end):
        """At an epoch's end, and every eval_interval updates (torchtitan's should_validate), once: a validation that
        a stop cut short is due again when the run resumes."""
        interval, step, curve = self.cfg.eval_interval, self.trainer.step, self.state.validation_curve
        done = bool(curve) and curve[-1]["update"] == step
        return epoch_end or bool(interval and step and step % interval == 0 and not done)

    def checkpoint_due(self, epoch_end, reason):
        """At an epoch's end, at a stop, and every checkpoint_minutes (by rank 0's clock: signalled() sets time_due)."""
        return epoch_end or reason is not None or self.time_due

    def stop_reason(self):
        """Why the loop ends now, or None: a loss that is not finite (first: its weights must not be checkpointed as
        a stop's would be); a signal (on any rank) or stop_after_updates, every rank at the same update; the target
        reached (with stop_at_target); the last epoch done."""
        if self.metrics.diverged:
            return "diverged"
        if self.signalled():
            return "signal"
        if self.cfg.stop_at_target and self.state.target_reached:
            return "target"
        if self.state.epoch >= self.cfg.epochs:  # before the limit: a run with every epoch done finishes
            return "end"
        limit = self.cfg.stop_after_updates
        return "stop_after_updates" if limit and self.session_updates >= limit else None

    def signalled(self):
        """Whether a signal came (on any rank); time_due: whether checkpoint_minutes have passed by rank 0's clock
        (ranks' own may disagree, and a checkpoint one rank takes alone leaves the others in an all-reduce). Ranks
        agree on both only where the log line syncs anyway, never with a host sync per update."""
        minutes = self.cfg.checkpoint_minutes
        self.time_due = self.main_process and bool(minutes) and time.time() - self.last_checkpoint_time > 60 * minutes
        if self.world_size == 1:
            return self.stop.signal is not None
        due, self.time_due = self.time_due, False
        if self.trainer.step % self.cfg.log_interval and not self.epoch_done():
            return False
        flags = torch.tensor([self.stop.signal is not None, due], dtype=torch.float32, device=self.plan.device)
        signal_flag, self.time_due = (all_reduce_sum(flags, self.world_size) > 0).tolist()
        return signal_flag

    # -- validation and checkpoints, out of the training clock

    def validate(self, epoch_end):
        """The validation-subset loss; an epoch's end counts only once its validation is done (a signal stops it
        early, and the resumed run validates that epoch first)."""
        with self.metrics.paused() as start:
            result = self.evaluate(self.cfg.val_subset_tokens)
            if result is not None:
                self.metrics.add_validation(result, time.time() - start, epoch_end)

    def evaluate(self, max_tokens):
        """Mean validation loss over the first max_tokens tokens (0: all), split among the ranks; None when a
        signal stopped it (one process only: ranks must agree on their batches)."""
        from tqdm import tqdm
        cfg, val = self.cfg, self.plan.cache.val
        scored = min(max_tokens or len(val), len(val))
        batch_size = min(cfg.eval_batch_size, max(1, -(-(scored - 1) // cfg.seq_len)))  # no rows of padding only
        batches = eval_batches(val, cfg.seq_len, batch_size, max_tokens)
        if self.world_size > 1:
            batches = (b for i, b in enumerate(batches) if i % self.world_size == self.plan.rank)
        total = -(-eval_batch_count(len(val), cfg.seq_len, batch_size, max_tokens) // self.world_size)
        # a full pass over a large validation split takes minutes; the bar goes when it ends
        batches = tqdm(batches, total=total, desc="full validation" if not max_tokens else "validation subset",
                       unit="batch", leave=False, disable=not self.main_process)
        stop = self.stop if self.world_size == 1 else None
        stopped = (lambda: stop.signal is not None) if stop else None
        return self.trainer.evaluate(batches, stopped)

    def checkpoint(self, reason):
        """The checkpoint and the entry (interrupted at a stop that leaves the run to resume, else running); none
        of a diverged run, whose last finite weights stay the checkpoint. The loss is seen at log lines only, so the
        weights are checked here: where one is not finite the run diverged since. Returns the stop reason."""
        if reason == "diverged":
            self.metrics.stop_clock()  # the updates since the last pause count, as a stop's checkpoint counts them
            return reason
        with self.metrics.paused() as start:  # the check too: a pause of the training clock, as the checkpoint is
            if not self.metrics.weights_finite(self.trainer.raw_model):
                return "diverged"
            if reason in INTERRUPTING:
                self.say_stopped(reason)
            self.metrics.keep_open_interval(start)  # the log interval so far: a resume goes on with it
            self.save_checkpoint()
            self.last_checkpoint_time = time.time()
            self.metrics.record("interrupted" if reason in INTERRUPTING else "running")
        return reason

    def say_stopped(self, reason):
        if self.main_process:
            signum = self.stop.signal
            why = (f"stop_after_updates={self.cfg.stop_after_updates}" if reason == "stop_after_updates"
                   else f"signal {signal.Signals(signum).name}" if signum is not None else "stop on another process")
            print(f"{why}: checkpointed at update {self.trainer.step}; resume with --resume=True", flush=True)

    def save_checkpoint(self):
        if self.main_process:
            trainer = self.trainer
            checkpoint.save(self.ckpt_path, trainer.raw_model, trainer.optimizer, trainer.step,
                            dict(self.metrics.state_dict(), recipe=self.plan.recipe, config=dict(self.cfg),
                                 model_config=self.plan.model.to_dict(), **trainer.checkpoint_state()))

    # -- the end

    def finish(self, reason):
        """The run's status for its stop reason: interrupted (checkpointed), diverged, or, after the full validation
        (when configured) and the final checkpoint, complete. A signal during that pass stops it and checkpoints
        the run as interrupted (the resumed run validates again)."""
        if reason in INTERRUPTING:
            return "interrupted"
        if reason == "diverged":
            if self.main_process:
                kept = ("the checkpoint holds the last finite weights" if self.ckpt_path.exists()
                        else "no checkpoint was written")
                print(f"diverged: {self.metrics.diverged}; {kept}", file=sys.stderr, flush=True)
            return "diverged"
        if self.cfg.full_validation:
            start = time.time()
            result = self.evaluate(0)
            if result is None:
                self.say_stopped("signal")
                self.save_checkpoint()
                return "interrupted"
            self.metrics.add_final_validation(final_validation_result(result, time.time() - start))
        self.save_checkpoint()
        return "complete"

    def fail(self, exc):
        """Record the run as aborted (a second signal: no checkpoint of this point) or failed, with the error."""
        aborted = isinstance(exc, KeyboardInterrupt)
        error = (f"a second signal ended it before its checkpoint; --resume=True continues from "
                 f"{'the last checkpoint' if self.ckpt_path.exists() else 'the start (no checkpoint was written)'}"
                 if aborted else f"{type(exc).__name__}: {exc}")
        self.metrics.stop_clock(quiet=True)
        self.metrics.record("aborted" if aborted else "failed", error=error)
        self.metrics.close_dashboards()

    def release(self):
        if getattr(self, "lock", None):
            self.lock.release()


def train(cfg):
    """Run (or resume) the configured training; returns the results entry."""
    # every check, the data, the model and the optimizer: no work done yet
    run = Run(plan_lib.resolve(cfg, prestart=True))
    try:
        run.resume_or_start()
        run.announce()
        run.stop = StopRequest("at the next update" if run.world_size == 1 else  # before the "running" entry
                               f"at the next log line (every {cfg.log_interval} updates, where the ranks agree)")
        run.metrics.record("running")
        try:
            status = run.finish(loop(run))
        except BaseException as exc:
            run.fail(exc)
            raise
        finally:
            run.stop.restore()
        return run.metrics.close(status, **({"error": run.metrics.diverged} if status == "diverged" else {}))
    finally:
        run.release()


def loop(run):
    """Updates until a stop reason; the validation and the checkpoint when each is due. Returns the reason."""
    run.metrics.start_clock()
    updates = run.updates()
    reason = run.stop_reason()         # a resumed run may have nothing left to train
    if reason in INTERRUPTING:         # a signal before the first update: interrupted means checkpointed
        reason = run.checkpoint(reason)
    while reason is None:
        if not run.validation_due(run.epoch_done()):  # else resumed where a stop cut its validation short
            run.update(*next(updates))
        epoch_end = run.epoch_done()
        if run.validation_due(epoch_end):
            run.validate(epoch_end)
        reason = run.stop_reason()
        if run.checkpoint_due(epoch_end, reason):
            reason = run.checkpoint(reason)
    return reason


EXIT_STATUS = {"interrupted": EXIT_INTERRUPTED, "diverged": EXIT_DIVERGED}


def resumed_settings(cfg, argv):
    """With resume and a checkpoint: the settings its run was trained with, under the config files and overrides
    given now (so that `--name=NAME --resume=True` alone resumes it); a recipe key they change is refused, naming
    each with both values. Without a checkpoint, cfg as given."""
    path = checkpoint.in_folder(run_dir(cfg))
    if not (cfg.resume and path.is_file()):
        return cfg
    stored = checkpoint.peek(path, "config")  # mapped: resume_or_start reads the whole file once
    if not isinstance(stored, dict):
        return cfg  # not a checkpoint train.py wrote: resume_or_start says so
    base = {k: stored.get(k, v) if k not in settings.LAUNCH_KEYS else v for k, v in DEFAULTS.items()}
    given = settings.Config(load_config(base, argv))
    changed = [f"{k} {stored[k]!r} (the checkpoint's) against {given[k]!r}" for k in sorted(stored)
               if k in given and k not in settings.LAUNCH_KEYS and stored[k] != given[k]
               and settings.field_of(TrainSettings, k).metadata["role"] in (settings.RECIPE, settings.MODEL,
                                                                             settings.WEIGHTS)]
    if changed:
        raise ConfigError(f"--resume=True continues {path}, whose recipe the settings given change: "
                          f"{'; '.join(changed)}; resume with the run's own settings (--name and --resume=True are "
                          f"enough), or start a new --name")
    return given


def main(argv):
    with process_guard.guarded():  # a closed output, a hang-up or a late signal never costs the run its updates
        try:
            cfg = resumed_settings(settings.load(TrainSettings, argv), argv)  # plan.resolve checks every rule, once
            entry = train(cfg)
            end_distributed()
        except USER_ERRORS as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    # A stopped run checkpointed cleanly but is not finished: say so to whatever runs this next.
    return EXIT_STATUS.get(entry["status"], 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
