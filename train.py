"""Train a tiny-llm model: python train.py config/20m_gh200.py [--key=value ...]   (--help lists the keys)

One process per GPU; `torchrun --nproc_per_node=N train.py ...` runs DistributedDataParallel.
settings.py declares the keys and checks them; trainer.py holds the update step (bench.py times the same one);
metrics.py keeps the run's accounting. This file is the run's lifecycle: start or resume, the loop, the pauses
(validation, checkpoint, record) and the end.
"""
import dataclasses
import signal
import sys
import time
from pathlib import Path

import torch

import checkpoint
import env
import model as model_lib
import optim
import process_guard
import settings
from configurator import ConfigError, load_config
from data.loader import CacheError, Prefetcher, TokenCache, TrainData, eval_batch_count, eval_batches
from metrics import Metrics, final_validation_result
from results import ResultsFileError, check_writable
from settings import (Config, TrainSettings, initial_model_config, model_config, recipe,  # noqa: F401
                      recipe_differences)  # (the scripts' names for them)
from trainer import Trainer, all_reduce_sum, distributed, end_distributed, micro_steps

DEFAULTS = settings.defaults(TrainSettings)
EXIT_INTERRUPTED = 3  # exit status of a run stopped by a signal or stop_after_updates, checkpointed to resume
USER_ERRORS = (ConfigError, ResultsFileError, CacheError, checkpoint.CheckpointError)  # one line, no traceback


# ---------------------------------------------------------------- setting up: every check before any work

def check_execution(cfg, world_size=1):
    """Every rule of train.py's settings (settings.py), refused as a ConfigError; returns the sequences per update."""
    settings.check(TrainSettings, cfg)
    return settings.sequences_per_update(cfg, world_size)


def load_initial_weights(cfg):
    """init_from's weights (None without it); a path that holds none, or a model outside the family, is a
    ConfigError."""
    if not cfg.init_from:
        return None
    try:
        return checkpoint.initial_weights(cfg.init_from)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def setup(cfg, initial=None):
    """Shared by train and bench: the verified data cache, the model config and the recipe. With init_from, the
    model's shape is that of the initial weights (`initial`, loaded here when not given)."""
    try:
        cache = TokenCache(cfg.data_dir, vocab_size=cfg.vocab_size)
    except CacheError as exc:
        raise ConfigError(str(exc)) from None
    initial = initial or load_initial_weights(cfg)
    mismatch = checkpoint.cache_mismatch(initial, cache)  # weights of another tokenizer's token ids
    if mismatch:
        raise ConfigError(mismatch)
    mcfg = initial_model_config(cfg, initial) if initial else model_config(cfg, cache.vocab_size)
    if cache.vocab_size > mcfg.vocab_size:
        fix = ("start from a model of this tokenizer" if initial
               else f"set vocab_size=0 (follow the data) or at least {cache.vocab_size}")
        raise ConfigError(f"the data's tokenizer has {cache.vocab_size} tokens but the model's vocabulary "
                          f"holds {mcfg.vocab_size}; {fix}")
    if cfg.vocab_size > cache.vocab_size and not initial:
        raise ConfigError(f"vocab_size {cfg.vocab_size} is larger than the {cache.vocab_size} tokens of the cache "
                          f"{cfg.data_dir}: the LM head would hold rows no token uses; set vocab_size=0 (follow the "
                          f"data) or {cache.vocab_size}, or prepare a cache of that vocabulary")
    try:
        if cfg.lm_head_fp8:
            model_lib.check_fp8_shape(mcfg.dim, mcfg.vocab_size)
        model_lib.check_quack_shape(mcfg, cfg.loss_impl, cfg.mlp_impl)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rec = recipe(cfg, mcfg, cache.identity, initial.sha256 if initial else None)
    return cache, mcfg, rec


def run_dir(cfg):
    """Where a run's checkpoint lives: out_dir, or out/<name>."""
    return Path(cfg.out_dir or f"out/{cfg.name}")


def prepare_out_dir(cfg, main_process=True):
    """The run's checkpoint path, its folder made now and locked for this process (a second train.py of the same
    run is refused). A checkpoint already there is a run of this name: continued with resume, replaced with
    overwrite, else refused. Returns (checkpoint path, the held lock or None)."""
    from filelock import FileLock, Timeout
    out = run_dir(cfg)
    ckpt = out / "ckpt.pt"
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
    except Timeout:
        raise ConfigError(f"another train.py is running {cfg.name!r} in {out} now; wait for it, or choose another "
                          f"--name") from None
    return ckpt, lock


def training_data(cfg, cache, sequences_per_update):
    """The fixed training subset of the cache, cut into the run's updates (train.py trains it, bench.py times it)."""
    return TrainData(cache.train, cfg.seq_len, sequences_per_update, cfg.seed, cfg.train_subset_tokens)


# ---------------------------------------------------------------- signals

class StopRequest:
    """Turns SIGTERM/SIGINT/SIGHUP (a scheduler's time limit, Ctrl-C, a closed terminal) into a checkpoint at the
    next update. The first signal is acknowledged at once and stops a validation pass early; a second one (not the
    first arriving twice) ends the process without a checkpoint."""

    SAME_STOP_SECONDS = process_guard.SAME_STOP_SECONDS  # a scheduler may signal the process, and its parent too

    def __init__(self):
        self.signal, self.signalled_at = None, None
        self.previous = process_guard.install(self._handle)  # not a SIGHUP that nohup ignores

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now, unless it is the first one arriving twice
            if time.monotonic() - self.signalled_at < self.SAME_STOP_SECONDS:
                return
            signal.signal(signum, self.previous[signum])
            raise KeyboardInterrupt
        self.signal, self.signalled_at = signum, time.monotonic()
        process_guard.stop_requested(f"{signal.Signals(signum).name} received: stopping at the next update with a "
                                     f"checkpoint (a second one stops at once, without one)\n")

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- the training run

@dataclasses.dataclass
class RunState:
    """What a run has done so far: saved in its checkpoint, restored on resume, reported in its entry."""
    epoch: int = 0
    update_in_epoch: int = 0
    tokens: int = 0
    validation_curve: list = dataclasses.field(default_factory=list)
    best_subset_loss: float = None
    best_epoch: int = None
    training_seconds: float = 0.0
    training_elapsed_seconds: float = 0.0
    interval_tokens_per_second: list = dataclasses.field(default_factory=list)
    run_id: str = dataclasses.field(default_factory=env.new_run_id)
    sessions: int = 0  # how many processes have trained this run (1 + the resumes)
    first_update_seconds: float = None
    final_validation: dict = None
    # the logged training loss, learning rate and gradient norm, one point per log interval
    training_curve: list = dataclasses.field(default_factory=list)
    target_reached: dict = None  # where the validation-subset loss first reached target_loss


# A checkpoint must hold these to be resumed (a final validation exists only once the run is complete; fields
# added later start at their defaults for checkpoints written before them).
RESUME_FIELDS = [f.name for f in dataclasses.fields(RunState)
                 if f.name not in ("final_validation", "training_curve", "target_reached")]


class Run:
    """One training run of a config: its data, trainer and state, and the steps train() takes in order."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.rank, local_rank, self.world_size = distributed()
        self.main_process = self.rank == 0
        self.sequences_per_update = check_execution(cfg, self.world_size)
        self.device = settings.resolve_device(cfg, local_rank)
        attention = settings.check_device(cfg, torch.device(self.device))
        check_writable(cfg.results_file)
        initial = load_initial_weights(cfg)
        self.cache, self.mcfg, self.recipe = setup(cfg, initial)
        self.data = training_data(cfg, self.cache, self.sequences_per_update)
        self.total_updates = self.data.updates_per_epoch * cfg.epochs
        for line in settings.doubtful_values(cfg, self.total_updates) if self.main_process else ():
            print(f"warning: {line}")
        # after every check above, so that a refused run leaves no folder
        self.ckpt_path, self.lock = prepare_out_dir(cfg, self.main_process)
        try:
            self.trainer = Trainer(cfg, self.mcfg, self.device, self.total_updates, self.world_size, local_rank,
                                   initial_state=initial.state if initial else None, attention=attention)
            if initial and self.main_process:
                print(f"initial weights from {cfg.init_from} ({initial.source}, {initial.sha256[:12]})")
            self.state, self.status, self.session_updates, self.at_target = RunState(), "running", 0, False
            self.last_checkpoint_time = time.time()
            self.metrics = Metrics(cfg, self.state, self.trainer, self.facts())
        except BaseException:  # out of memory, say: no run of this process holds the folder any more
            if self.lock:
                self.lock.release()
            raise

    def facts(self):
        """What the entry reports that does not change while the run trains."""
        gpu = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else None
        return {"main_process": self.main_process, "world_size": self.world_size, "device": self.device,
                "flops": model_lib.flops_per_token(self.mcfg, self.cfg.seq_len), "gpu_name": gpu,
                "parameters": sum(p.numel() for p in self.trainer.raw_model.parameters()),
                "total_updates": self.total_updates, "recipe": self.recipe, "recipe_id": env.hash_json(self.recipe),
                "fingerprint": env.fingerprint(self.cache.identity) if self.main_process else None}

    # -- resume or start

    def resume_or_start(self):
        """Continue from the checkpoint when resume is set and one exists (refused if its recipe differs)."""
        cfg, path = self.cfg, self.ckpt_path
        if cfg.resume and path.exists():
            try:
                self.load(checkpoint.to_resume(path, self.device, self.recipe, RESUME_FIELDS))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif cfg.resume:
            print(f"no checkpoint at {path}: starting from scratch")
        self.state.sessions += 1
        self.metrics.state = self.state
        self.metrics.open_dashboards(path.parent)

    def load(self, ckpt):
        self.trainer.raw_model.load_state_dict(ckpt["model"])
        optim.load_state(self.trainer.optimizer, ckpt["optimizer"])
        self.trainer.step = ckpt["step"]
        checkpoint.set_rng_state(ckpt["rng"])
        self.state = RunState(**{f.name: ckpt[f.name] for f in dataclasses.fields(RunState) if f.name in ckpt})
        print(f"resumed {self.ckpt_path} at update {self.trainer.step} (epoch {self.state.epoch + 1}, "
              f"update {self.state.update_in_epoch} of {self.data.updates_per_epoch})")

    def announce(self):
        if not self.main_process:
            return
        cfg, data, facts = self.cfg, self.data, self.metrics.facts
        compiles = cfg.compile and self.state.first_update_seconds is None
        print(f"{cfg.name}: {facts['parameters']:,} parameters, {data.n_sequences:,} sequences of {cfg.seq_len} per "
              f"epoch, {data.updates_per_epoch} updates per epoch x {cfg.epochs} epochs, micro-batch "
              f"{cfg.micro_batch_size} x {micro_steps(cfg, self.world_size)} accumulation x {self.world_size} "
              f"process(es), {self.device}, attention {self.trainer.attention} ({self.trainer.attention_reason}), "
              f"optimizer {cfg.optimizer}, recipe {facts['recipe_id'][:12]}"
              + ("; the first update compiles the model" if compiles else ""), flush=True)

    # -- the updates

    def epoch_batches(self):
        """The rest of this epoch's updates as (update index, this rank's micro-batches, target tokens)."""
        epoch, cfg = self.state.epoch, self.cfg
        updates = range(self.state.update_in_epoch, self.data.updates_per_epoch)
        return Prefetcher(lambda u: self.data.micro_batches(epoch, u, cfg.micro_batch_size, self.rank,
                                                            self.world_size), updates, self.device)

    def after_update(self, u, loss_sum, grad_norm, n_tokens):
        """Count the update; print the log line every log_interval updates."""
        self.metrics.count(loss_sum, n_tokens)
        self.state.update_in_epoch = u + 1
        self.session_updates += 1
        if self.trainer.step % self.cfg.log_interval == 0 or self.epoch_done():
            self.metrics.log(grad_norm)

    def epoch_done(self):
        return self.state.update_in_epoch == self.data.updates_per_epoch

    def evaluation_due(self):
        return bool(self.cfg.eval_interval) and self.trainer.step % self.cfg.eval_interval == 0

    def stop_requested(self, stop):
        """A signal (on any rank) or stop_after_updates: every rank stops at the same update."""
        signalled = stop.signal is not None
        if self.world_size > 1:
            # Ranks agree on a signal only where the log line syncs anyway, never with a host sync per update.
            signalled = False
            if self.trainer.step % self.cfg.log_interval == 0 or self.epoch_done():
                flag = torch.tensor([float(stop.signal is not None)], device=self.device)
                signalled = all_reduce_sum(flag, self.world_size).item() > 0
        limit = self.cfg.stop_after_updates
        return signalled or bool(limit and self.session_updates >= limit)

    def checkpoint_due(self):
        minutes = self.cfg.checkpoint_minutes
        return bool(minutes) and time.time() - self.last_checkpoint_time > 60 * minutes

    # -- the pause: validation, checkpoint and record, out of the training clock

    def pause(self, stop_now, stop):
        """The validation when due (the epoch's at its end, else every eval_interval updates), then, at an epoch's
        end, a stop, the target or checkpoint_minutes, the checkpoint and the entry."""
        pause_start = self.metrics.pause_clock()
        epoch_end = self.epoch_done()
        reached = False
        if epoch_end or self.evaluation_due():
            reached = self.validate(stop, epoch_end, pause_start)
        stop_now = stop_now or (stop.signal is not None and self.world_size == 1)  # one arrived while validating
        self.at_target = reached and self.cfg.stop_at_target
        if stop_now:
            self.status = "interrupted"
            self.say_stopped(stop)
        if stop_now or epoch_end or self.at_target or self.checkpoint_due():
            self.save_checkpoint()
            self.last_checkpoint_time = time.time()
            self.metrics.record(self.status)
        self.metrics.resume_clock(pause_start)

    def validate(self, stop, epoch_end, pause_start):
        """The validation-subset loss; an epoch's end counts only once its validation is done (a signal stops it
        early, and the resumed run validates that epoch first). Returns whether the target was reached now."""
        result = self.evaluate(self.cfg.val_subset_tokens, stop)
        if result is None:
            return False
        if epoch_end:
            self.state.epoch += 1
            self.state.update_in_epoch = 0
        epoch = self.state.epoch if epoch_end else self.state.epoch + 1
        return self.metrics.add_validation(result, epoch, time.time() - pause_start, epoch_end)

    def evaluate(self, max_tokens, stop=None):
        """Mean validation loss over the first max_tokens tokens (0: all), split among the ranks; None when a
        signal stopped it (one process only: ranks must agree on their batches)."""
        from tqdm import tqdm
        cfg, val = self.cfg, self.cache.val
        batches = eval_batches(val, cfg.seq_len, cfg.eval_batch_size, max_tokens)
        if self.world_size > 1:
            batches = (b for i, b in enumerate(batches) if i % self.world_size == self.rank)
        total = -(-eval_batch_count(len(val), cfg.seq_len, cfg.eval_batch_size, max_tokens) // self.world_size)
        # a full pass over a large validation split takes minutes; the bar goes when it ends
        batches = tqdm(batches, total=total, desc="full validation" if not max_tokens else "validation subset",
                       unit="batch", leave=False, disable=not self.main_process)
        stopped = (lambda: stop.signal is not None) if stop and self.world_size == 1 else None
        return self.trainer.evaluate(batches, stopped)

    def say_stopped(self, stop):
        if not self.main_process:
            return
        reason = (f"signal {signal.Signals(stop.signal).name}" if stop.signal is not None
                  else f"stop_after_updates={self.cfg.stop_after_updates}" if self.cfg.stop_after_updates
                  else "stop on another process")
        print(f"{reason}: checkpointed at update {self.trainer.step}; resume with --resume=True", flush=True)

    def save_checkpoint(self):
        if self.main_process:
            trainer = self.trainer
            checkpoint.save(self.ckpt_path, trainer.raw_model, trainer.optimizer, trainer.step,
                            dict(dataclasses.asdict(self.state), recipe=self.recipe, config=dict(self.cfg),
                                 model_config=self.mcfg.to_dict()))

    # -- the end

    def finish(self, stop):
        """The full validation pass (when configured), then the final checkpoint; a signal during the pass stops it
        and checkpoints the run as interrupted (the resumed run validates again)."""
        if self.cfg.full_validation:
            start = time.time()
            result = self.evaluate(0, stop)
            if result is None:
                self.status = "interrupted"
                self.say_stopped(stop)
                self.save_checkpoint()
                return
            self.metrics.add_final_validation(final_validation_result(result, time.time() - start))
        self.status = "complete"
        self.save_checkpoint()

    def fail(self, exc):
        """Record the run as aborted (a second signal: no checkpoint of this point) or failed, with the error."""
        aborted = isinstance(exc, KeyboardInterrupt)
        self.status = "aborted" if aborted else "failed"
        error = (f"a second signal ended it before its checkpoint; --resume=True continues from "
                 f"{'the last checkpoint' if self.ckpt_path.exists() else 'the start (no checkpoint was written)'}"
                 if aborted else f"{type(exc).__name__}: {exc}")
        self.metrics.record(self.status, error=error)
        self.metrics.close_dashboards()

    def release(self):
        if self.lock:
            self.lock.release()


def train(cfg):
    """Run (or resume) the configured training; returns the results entry."""
    run = Run(cfg)                   # every check, the data, the model and the optimizer: no work done yet
    try:
        run.resume_or_start()
        run.announce()
        stop = StopRequest()         # before the "running" entry, so that no signal can leave it standing
        run.metrics.record("running")
        try:
            loop(run, stop)
        except BaseException as exc:
            run.fail(exc)
            raise
        finally:
            stop.restore()
        return run.metrics.close(run.status)
    finally:
        run.release()


def loop(run, stop):
    """The epochs' updates, each pause where one is due, then the end."""
    while run.state.epoch < run.cfg.epochs and run.status == "running" and not run.at_target:
        if run.epoch_done():         # resumed after an epoch's updates, before its validation ended
            run.metrics.start_clock()
            run.pause(False, stop)
            continue
        batches = run.epoch_batches()
        run.metrics.start_clock()
        for u, micro_batches, n_tokens in batches:
            loss_sum, grad_norm = run.trainer.update(micro_batches, n_tokens)
            run.after_update(u, loss_sum, grad_norm, n_tokens)   # counts, first-update time, log line
            stop_now = run.stop_requested(stop)
            if stop_now or run.checkpoint_due() or run.epoch_done() or run.evaluation_due():
                run.pause(stop_now, stop)
            if run.status != "running" or run.at_target:
                break
    if run.status == "running":
        run.finish(stop)             # the full validation, then the final checkpoint


def main(argv):
    with process_guard.guarded():  # a closed output, a hang-up or a late signal never costs the run its updates
        try:
            cfg = Config(load_config(TrainSettings, argv))  # Run checks every rule, once
            entry = train(cfg)
            end_distributed()
        except USER_ERRORS as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    # A stopped run checkpointed cleanly but is not finished: say so to whatever runs this next.
    return EXIT_INTERRUPTED if entry["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
