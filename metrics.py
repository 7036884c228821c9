"""The run's accounting, as torchtitan's metrics processor: the run's state (what it has done so far, the one
record a checkpoint keeps and a resume restores), the training clock (what counts as training time and what is a
pause), the log line and the dashboards, the validation points and the target, the results entry and the closing
summary. train.py's loop calls it; nothing here changes what is trained."""
import contextlib
import dataclasses
import math
import statistics
import time

import torch

import env
from dashboard import Dashboards
from distributed import all_reduce_sum
from model_kernels import first_calls
from results import record
from trainer import peak_memory_bytes


@dataclasses.dataclass
class RunState:
    """What a run has done so far: saved in its checkpoint, restored on resume, reported in its entry. Only Metrics
    changes it."""
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
    # Inductor's graphs of the first update: how many it compiled, how many its cache held (warm or cold start), and
    # the kernels the cached ones launched from their saved binaries
    first_update_graphs: dict = None
    # the first update's seconds that torch.compile spent, by phase (env.compiled_since)
    first_update_compile_seconds: dict = None
    # cold: when the children of the first-call kernels had them, and the first update's waits (first_calls.timings)
    first_calls: dict = None
    final_validation: dict = None
    # the logged training loss, learning rate and gradient norm, one point per log interval
    training_curve: list = dataclasses.field(default_factory=list)
    target_reached: dict = None  # where the validation-subset loss first reached target_loss
    # the log interval a checkpoint fell in, so far (its updates, tokens, loss sum over the ranks and training
    # seconds): a resume goes on with it, so that its log point is the uninterrupted run's
    open_interval: dict = None


# A checkpoint must hold these to be resumed; the others start at their defaults when it has none of them (a final
# validation exists only once the run is complete).
RESUME_FIELDS = [f.name for f in dataclasses.fields(RunState)
                 if f.name not in ("final_validation", "training_curve", "target_reached", "first_update_graphs",
                                "first_update_compile_seconds", "first_calls", "open_interval")]


def format_seconds(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Metrics:
    """Counts, times and reports one run, and owns its state (a RunState), which the checkpoint keeps; `facts` is
    what does not change while it trains (parameters, flops, recipe, fingerprint, ...)."""

    def __init__(self, cfg, trainer, facts):
        self.cfg, self.trainer, self.facts = cfg, trainer, facts
        self.state = RunState()
        self.main = facts["main_process"]
        self.world_size = facts["world_size"]
        self.session_start = time.time()
        self.dashboards = None
        self.diverged = None  # what was not finite, once something is
        self.interval_updates, self.interval_tokens, self.loss_total = 0, 0, None
        self.segment_start = self.interval_start = time.time()
        self.clock_running = False  # start_clock starts it
        # (tokens, training seconds) after this process's first update, which compiles: the ETA's mean rate since
        self.rate_start = None
        self.compile_mark = None  # what torch.compile had done when the clock started (env.compile_totals)

    def restore(self, saved):
        """The state a checkpoint saved (a dict with at least RESUME_FIELDS)."""
        self.state = RunState(**{f.name: saved[f.name] for f in dataclasses.fields(RunState) if f.name in saved})

    def state_dict(self):
        return dataclasses.asdict(self.state)

    def start_session(self):
        self.state.sessions += 1

    def open_dashboards(self, out_dir):
        if self.main:
            self.dashboards = Dashboards(self.cfg, self.state.run_id, out_dir, start_step=self.trainer.step)

    def synchronize(self):
        if self.facts["device"].startswith("cuda"):
            torch.cuda.synchronize()

    # -- the training clock: updates count, evaluations, checkpoints and records do not

    def start_clock(self):
        """Training time starts now (the GPU synchronized first, so no earlier work is counted), in the log interval
        the checkpoint resumed from fell in, if it fell in one."""
        self.synchronize()
        self.compile_mark = env.compile_totals()  # the first update's compile is what comes after this
        self.segment_start = self.interval_start = time.time()
        self.clock_running = True
        self.interval_updates, self.interval_tokens, self.loss_total = 0, 0, None
        kept, self.state.open_interval = self.state.open_interval, None
        if kept:  # its rate: all its tokens over all its training seconds, the earlier process's included
            self.interval_updates, self.interval_tokens = kept["updates"], kept["tokens"]
            self.loss_total = kept["loss_sum"] if self.main else None  # log() adds up the ranks' sums
            self.interval_start -= kept["training_seconds"]

    def keep_open_interval(self, pause_start):
        """At a checkpoint (every rank: one all-reduce, where an update came since the last log line), the log
        interval so far, for the state it saves; pause_start: when the checkpoint's pause of the clock began."""
        self.state.open_interval = None
        if self.interval_updates:
            # a float or None: no update of this process in it yet (a resume that validated first), the sum as kept
            total = self.loss_total if torch.is_tensor(self.loss_total) else \
                torch.tensor(self.loss_total or 0.0, device=self.facts["device"])
            loss_sum = all_reduce_sum(total.detach().clone(), self.world_size).item()
            self.state.open_interval = {"updates": self.interval_updates, "tokens": self.interval_tokens,
                                        "loss_sum": loss_sum, "training_seconds": pause_start - self.interval_start}

    def pause_clock(self):
        """Training time stops: the segment so far is added; returns when the pause began."""
        self.synchronize()
        segment = time.time() - self.segment_start
        self.state.training_seconds += segment
        self.state.training_elapsed_seconds += segment
        self.clock_running = False
        return time.time()

    def resume_clock(self, pause_start):
        paused = time.time() - pause_start
        self.state.training_elapsed_seconds += paused
        self.interval_start += paused  # a mid-interval pause is not training time
        self.segment_start = time.time()
        self.clock_running = True

    def stop_clock(self, quiet=False):
        """The end of training where no pause followed the last updates (a diverged or failed run): their time is
        added, once; nothing before the clock started. quiet: a failed run's, whose GPU may fail the synchronize
        too (the run's own error is what it records)."""
        if self.clock_running:
            try:
                self.pause_clock()
            except Exception:
                if not quiet:
                    raise

    @contextlib.contextmanager
    def paused(self):
        """Out of the training clock (a validation, a checkpoint, a record); yields when the pause began."""
        start = self.pause_clock()
        try:
            yield start
        finally:
            self.resume_clock(start)

    def training_seconds_now(self):
        return self.state.training_seconds + time.time() - self.segment_start

    # -- updates and the log line

    def count(self, loss_sum, n_tokens):
        """One update's tokens and loss; the first update's time (compile included) is measured and printed."""
        state = self.state
        state.update_in_epoch += 1
        if self.rate_start is None:
            self.synchronize()
        if state.first_update_seconds is None:
            state.first_update_seconds = time.time() - self.segment_start
            if self.cfg.compile:
                state.first_update_graphs, state.first_update_compile_seconds = env.compiled_since(self.compile_mark)
            state.first_calls = first_calls.timings() or None
            if self.main:
                print(f"first update: {state.first_update_seconds:.1f} s"
                      + (" (compile included)" if self.cfg.compile else ""), flush=True)
        self.loss_total = loss_sum if self.loss_total is None else self.loss_total + loss_sum
        state.tokens += n_tokens
        self.interval_tokens += n_tokens
        self.interval_updates += 1
        if self.rate_start is None:
            self.rate_start = (state.tokens, self.training_seconds_now())

    def mean_rate(self, interval_rate):
        """Tokens per training second since this process's first update (a resumed run's earlier processes and the
        compile left out), or the interval's rate before there is any: what the ETA divides by. One interval's rate
        swings with whatever shared the machine then, and an ETA of it swung by minutes from line to line."""
        tokens, seconds = self.rate_start or (0, 0.0)
        elapsed = self.training_seconds_now() - seconds
        return (self.state.tokens - tokens) / elapsed if self.state.tokens > tokens and elapsed > 0 else interval_rate

    def log(self, grad_norm):
        """The interval's mean training loss, learning rate and gradient norm: printed, recorded in the
        training curve, and sent to the dashboards."""
        trainer, state = self.trainer, self.state
        loss = all_reduce_sum(self.loss_total.detach().clone(), self.world_size).item() / self.interval_tokens
        now = time.time()
        rate = self.interval_tokens / (now - self.interval_start)
        lr, norm = trainer.lr_at(trainer.step - 1), grad_norm.item()
        if not math.isfinite(loss) or not math.isfinite(norm):
            self.diverged = self.diverged or f"training loss {loss} and gradient norm {norm} at update {trainer.step}"
        state.interval_tokens_per_second.append(rate)
        state.training_curve.append({"update": trainer.step, "tokens": state.tokens, "loss": loss, "lr": lr,
                                     "grad_norm": norm, "training_seconds": self.training_seconds_now()})
        if self.main:
            self.dashboards.log(trainer.step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                               "train/tokens_per_second": rate})
            mfu = env.mfu(self.facts["flops"], rate / self.world_size, self.facts["gpu_name"])
            mfu = f"{100 * mfu:.1f}%" if mfu else "n/a"
            eta = (self.facts["total_tokens"] - state.tokens) / self.mean_rate(rate)  # the updates' sizes may vary
            print(f"update {trainer.step}/{self.facts['total_updates']} | epoch {state.epoch + 1} | loss {loss:.4f} | "
                  f"grad norm {norm:.3f} | lr {lr:.2e} | {rate / 1e3:,.1f}K tok/s | MFU {mfu} | "
                  f"ETA {format_seconds(eta)}", flush=True)
        self.interval_start, self.interval_updates, self.interval_tokens, self.loss_total = now, 0, 0, None

    def weights_finite(self, model):
        """Whether every weight is finite (one host sync: at checkpoints only); else the run diverged here."""
        finite = torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all().item()
        if not finite:
            self.diverged = self.diverged or f"a weight that is not finite at update {self.trainer.step}"
        return finite

    # -- validation points and the target

    def add_validation(self, result, seconds, epoch_end):
        """One validation-subset point (at an epoch's end, which it then counts, or every eval_interval updates): the
        curve, the best loss, and the first time the target was reached."""
        state, step = self.state, self.trainer.step
        if epoch_end:
            state.epoch += 1
            state.update_in_epoch = 0
        epoch = state.epoch if epoch_end else state.epoch + 1
        if not math.isfinite(result["loss"]):
            self.diverged = self.diverged or f"validation-subset loss {result['loss']} at update {step}"
        point = {"epoch": epoch, "update": step, "tokens": state.tokens, "loss": result["loss"], "seconds": seconds,
                 "training_seconds": state.training_seconds}
        state.validation_curve.append(point)
        if state.best_subset_loss is None or result["loss"] < state.best_subset_loss:
            state.best_subset_loss, state.best_epoch = result["loss"], epoch
        first = bool(self.cfg.target_loss) and state.target_reached is None and result["loss"] <= self.cfg.target_loss
        if first:
            state.target_reached = {k: point[k] for k in ("update", "tokens", "training_seconds", "loss", "epoch")}
        if self.main:
            self.dashboards.log(step, {"val/subset_loss": result["loss"]})
            where = f"epoch {epoch}" if epoch_end else f"update {step}"
            print(f"{where}: validation-subset loss {result['loss']:.4f} over {result['tokens']:,} tokens"
                  + (f"; target {self.cfg.target_loss} reached after {state.training_seconds:.1f} training s"
                     if first else ""), flush=True)

    def add_final_validation(self, result):
        self.state.final_validation = result
        if self.main:
            self.dashboards.log(self.trainer.step, {"val/loss": result["loss"], "val/perplexity": result["perplexity"]})
            print(f"full validation: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, "
                  f"{result['tokens']:,} tokens in {result['seconds']:.1f} s")

    # -- the results entry

    def entry(self, status):
        """The run's results entry: the reference's fields, then this project's."""
        s, cfg, facts = self.state, self.cfg, self.facts
        seconds, elapsed = s.training_seconds, s.training_elapsed_seconds
        tokens_per_second = s.tokens / seconds if seconds else None
        return {
            "status": status, "run_id": s.run_id, "parameters": facts["parameters"], "tokens": s.tokens,
            "step": self.trainer.step, "total_updates": facts["total_updates"], "epochs": s.epoch,
            "best_subset_loss": s.best_subset_loss, "best_epoch": s.best_epoch,
            "final_validation": s.final_validation, "seconds_this_session": time.time() - self.session_start,
            "training_seconds": seconds, "training_elapsed_seconds": elapsed,
            "training_tokens_per_second": tokens_per_second,
            "elapsed_tokens_per_second": s.tokens / elapsed if elapsed else None,
            "median_training_tokens_per_second": statistics.median(s.interval_tokens_per_second)
            if s.interval_tokens_per_second else None,
            "first_update_seconds": s.first_update_seconds, "first_update_graphs": s.first_update_graphs,
            "first_update_compile_seconds": s.first_update_compile_seconds, "first_calls": s.first_calls,
            "mfu": env.mfu(facts["flops"], tokens_per_second / self.world_size if seconds else None, facts["gpu_name"]),
            "flops_per_token": facts["flops"], "peak_memory_bytes": peak_memory_bytes(facts["device"]),
            "world_size": self.world_size, "sessions": s.sessions, "attention": self.trainer.attention,
            "recipe_identity": facts["recipe_id"], "recipe": facts["recipe"], "config": dict(cfg),
            "config_identity": env.config_identity(dict(cfg)), "validation_curve": s.validation_curve,
            "interval_tokens_per_second": s.interval_tokens_per_second, "training_curve": s.training_curve,
            **({"target": {"loss": cfg.target_loss, "reached": s.target_reached, "stop_at_target": cfg.stop_at_target}}
               if cfg.target_loss else {}),
            "environment": facts["fingerprint"],
        }

    def record(self, status, **extra):
        if self.main:
            record(self.cfg.results_file, [self.cfg.name], dict(self.entry(status), **extra))

    def close(self, status, **extra):
        """The final entry, recorded (with SLURM's accounting when under SLURM) and summarized."""
        result = dict(self.entry(status), **extra)
        if self.main:
            self.close_dashboards()
            record(self.cfg.results_file, [self.cfg.name], result)
            usage = env.allocation_usage()
            if usage:
                record(self.cfg.results_file, ["allocation-usage"], usage)
            print_summary(result)
        return result

    def close_dashboards(self):
        if self.dashboards:
            self.dashboards.close()
            self.dashboards = None


def final_validation_result(result, seconds):
    return dict(result, perplexity=math.exp(result["loss"]), seconds=seconds, split="full", validation_complete=True,
                tokens_per_second=result["tokens"] / seconds)


def print_summary(entry):
    """The run's closing table: status, updates, tokens, losses, speed, MFU and peak memory."""
    fv, best, rate = entry["final_validation"] or {}, entry["best_subset_loss"], entry["training_tokens_per_second"]
    target = (entry.get("target") or {}).get("reached")
    rows = [("status", entry["status"]), ("updates", f"{entry['step']}/{entry['total_updates']}"),
            ("tokens", f"{entry['tokens']:,}"),
            ("best subset loss", f"{best:.4f} (epoch {entry['best_epoch']})" if best else "-"),
            ("final validation", f"{fv['loss']:.4f} (ppl {fv['perplexity']:.2f})" if fv else "-"),
            ("training tokens/s", f"{rate:,.0f}" if rate else "-"),
            ("training seconds", f"{entry['training_seconds']:.1f} of {entry['training_elapsed_seconds']:.1f} elapsed"),
            ("MFU", f"{100 * entry['mfu']:.1f}%" if entry["mfu"] else "n/a"),
            ("peak memory", f"{entry['peak_memory_bytes'] / 2**30:.2f} GiB")]
    if entry.get("target"):
        rows.append(("target", f"{entry['target']['loss']} reached at update {target['update']}, "
                               f"{target['training_seconds']:.1f} training s" if target else
                     f"{entry['target']['loss']} not reached"))
    print("\n".join(f"{k:>20}: {v}" for k, v in rows))
