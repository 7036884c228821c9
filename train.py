"""Train a tiny-llm model: python train.py config/20m_gh200.py [--key=value ...]

One process per GPU; `torchrun --nproc_per_node=N train.py ...` runs DistributedDataParallel.
bench.py imports this file for its settings and times the very update step (trainer.Trainer.update) that
training runs.
"""
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

import torch

import checkpoint
import env
import model as model_lib
from configurator import ConfigError, defaults_of, load_config
from dashboard import Dashboards
from data.loader import CacheError, Prefetcher, TokenCache, TrainData, eval_batch_count, eval_batches
from results import ResultsFileError, check_writable, record
from trainer import Trainer, all_reduce_sum, distributed, micro_steps, peak_memory_bytes

# ---------------------------------------------------------------- defaults (config files and --key=value override them)
# run
name = "run"                     # entry name in the results file; checkpoints go to out/<name>
out_dir = ""                     # "" means out/<name>
results_file = "results.json"
resume = False                   # continue from out_dir/ckpt.pt (refused if the recipe differs)
overwrite = False                # start afresh over an existing out_dir/ckpt.pt (else a rerun of a name is refused)
init_from = ""                   # start from these weights: a transformers Llama folder, or a train.py checkpoint
                                 # (ckpt.pt or its run folder); the model's shape is taken from them
# model: a preset, any field overridable (0 keeps the preset's value)
preset = "20m"
vocab_size = 0                   # 0: the tokenizer's vocabulary, from the data cache
dim = 0
n_layers = 0
n_heads = 0
hidden_dim = 0
seq_len = 1024                   # context length of training sequences (the model's max_seq_len)
# data
data_dir = "data/cache/gutenberg"
train_subset_tokens = 10_000_000  # an epoch is the first N tokens of train.bin (0: all)
val_subset_tokens = 262_144       # the validation-subset loss after each epoch uses the first N val tokens
full_validation = True            # a full validation pass at the end
# recipe
seed = 1337
epochs = 10
tokens_per_update = 32_768
learning_rate = 2e-3
min_lr = 2e-4
warmup_updates = 100
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
adam_eps = 1e-8
grad_clip = 1.0                  # clip the gradient's global norm to this (0: no clipping; the norm is still logged)
residual_dtype = "float32"       # float32, or bfloat16: a declared change of math (compare.py --allow_recipe_change)
lm_head_fp8 = False              # the LM head's matmuls in FP8 (loss_impl fused, Hopper or newer): declared, as above
# execution: how the math is run, never what it is
device = "cuda"                  # cuda, cpu, or auto (a GPU if there is one); the CPU only when asked for
micro_batch_size = 8
compile = False
compile_mode = "default"         # default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs
compile_scope = "model"          # model: one graph; blocks: each block and the loss head apart (compiles once
                                 # for all the identical blocks, so a much shorter cold start)
attention_backend = "auto"       # auto: fa4 where it can run, else sdpa; sdpa (SDPA's choice), flash, efficient,
                                 # cudnn, math (one SDPA kernel), or fa4 (cuDNN's forward, flash-attn-4's backward;
                                 # pip install -r requirements-gpu.txt, Hopper or Blackwell)
loss_impl = "full"               # full, chunked, fused, fused_epilogue (see kernels/cross_entropy.py)
loss_chunk_tokens = 8192         # tokens per slice of the chunked and fused losses
activation_memory_budget = 1.0   # compiled only: the share of the compiler's activation memory to keep; below 1 it
                                 # recomputes cheap ops in backward instead of saving their outputs
cpu_threads = 0                  # 0: PyTorch's default
ddp_bucket_mb = 100              # DistributedDataParallel gradient bucket, MB: 100 measured +1.9% over PyTorch's 25 (90m, 2 GPUs)
eval_batch_size = 32
log_interval = 50
checkpoint_minutes = 0.0         # also checkpoint every N minutes (0: only at epoch ends and on signals)
tensorboard_dir = ""             # also log the curves to TensorBoard in this folder (pip install tensorboard)
wandb_log = False                # also log them to Weights & Biases, offline (pip install wandb; `wandb sync` later)
wandb_project = "tiny-llm"
stop_after_updates = 0           # stop (checkpointed) after N updates of this process, as a scheduler's time limit would


DEFAULTS = defaults_of(globals())

# Keys that only change how the math is executed; every other key is part of the recipe identity.
EXECUTION_KEYS = {"name", "out_dir", "results_file", "resume", "overwrite", "data_dir", "device", "micro_batch_size",
                  "compile", "compile_mode", "compile_scope", "attention_backend", "loss_impl", "loss_chunk_tokens",
                  "activation_memory_budget", "cpu_threads", "ddp_bucket_mb", "eval_batch_size", "log_interval",
                  "checkpoint_minutes", "stop_after_updates", "tensorboard_dir", "wandb_log", "wandb_project"}
MODEL_KEYS = {"preset", "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "seq_len"}
# Recipe keys added after runs were recorded: each enters the recipe only off its default, so that those runs
# keep their identities (and stay resumable and comparable).
LATER_RECIPE_KEYS = {"residual_dtype": "float32", "lm_head_fp8": False}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
RESERVED_NAMES = {"environment", "benchmarks", "tuning", "profiles", "history", "matched-comparison",
                  "partial-probe", "trained-parity", "allocation-usage", "loss-microbench", "accumulation-check",
                  "ceilings"}

EXIT_INTERRUPTED = 3  # exit status of a run stopped by a signal or stop_after_updates, checkpointed to resume

# Mistakes a user can fix: reported as one line, never a traceback.
USER_ERRORS = (ConfigError, ResultsFileError, CacheError)


class Config(dict):
    """The resolved configuration; keys read as attributes."""
    __getattr__ = dict.__getitem__


MODEL_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size")  # 0: the preset's (the data's)


def model_config(cfg, vocab):
    """The model's shape: the preset with the config's overrides; a bad one is a ConfigError."""
    overrides = {k: cfg[k] for k in MODEL_SHAPE_KEYS[:-1] if cfg[k]}
    try:
        return model_lib.get_preset(cfg.preset, vocab_size=cfg.vocab_size or vocab, max_seq_len=cfg.seq_len,
                                    **overrides)
    except ValueError as exc:  # unknown preset, width not divisible by heads, ...
        raise ConfigError(str(exc)) from None


def recipe(cfg, mcfg, cache_identity, init_weights=None):
    """Everything that changes the math of a run, and nothing that only changes its execution."""
    # The model's own fields are taken from the resolved config, so "dim=0" (the preset's) and "dim=320"
    # are one recipe. Initial weights enter as their hash, not their path, and only when given, so that
    # every run without them keeps the identity it has always had.
    fields = {k: v for k, v in cfg.items() if k not in EXECUTION_KEYS and k not in MODEL_KEYS and k != "init_from"
              and not (k in LATER_RECIPE_KEYS and v == LATER_RECIPE_KEYS[k])}
    fields.update(model=mcfg.to_dict(), cache_identity=cache_identity)
    if init_weights:
        fields["init_weights"] = init_weights
    return fields


def recipe_differences(old, new):
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def run_dir(cfg):
    """Where a run's checkpoint lives: out_dir, or out/<name>."""
    return Path(cfg.out_dir or f"out/{cfg.name}")


def resolve_device(cfg, local_rank=None):
    """"cpu" or "cuda"; given this process's local rank, its own GPU ("cuda:N"), made the current one."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device {cfg.device!r} is not one of auto, cpu, cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("this config trains on a GPU (device 'cuda') and PyTorch sees none; pass --device=cpu to "
                          "run it on the CPU anyway (config/tiny_cpu.py is the model sized for one)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and local_rank is not None:
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return device


def prepare_out_dir(cfg):
    """The run's checkpoint path, its folder made now (not after an epoch of training). A checkpoint already
    there is a run of this name: continued with resume, replaced with overwrite, else refused."""
    out = run_dir(cfg)
    ckpt = out / "ckpt.pt"
    if ckpt.exists() and not cfg.resume and not cfg.overwrite:
        raise ConfigError(f"{ckpt} exists: a run named {cfg.name!r} trained there; continue it with --resume=True, "
                          f"start it afresh with --overwrite=True, or choose another --name")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"out_dir {str(out)!r} cannot be made ({exc.strerror}); give a writable folder") from None
    return ckpt


def training_data(cfg, cache, sequences_per_update):
    """The fixed training subset of the cache, cut into the run's updates (train.py trains it, bench.py times it)."""
    return TrainData(cache.train, cfg.seq_len, sequences_per_update, cfg.seed, cfg.train_subset_tokens)


def check_choices(cfg):
    """The settings that name one of a few choices."""
    for key, choices in (("compile_mode", COMPILE_MODES), ("compile_scope", COMPILE_SCOPES),
                         ("attention_backend", tuple(model_lib.ATTENTION_BACKENDS)),
                         ("loss_impl", model_lib.LOSS_IMPLEMENTATIONS),
                         ("residual_dtype", tuple(model_lib.RESIDUAL_DTYPES))):
        if cfg[key] not in choices:
            raise ConfigError(f"{key} {cfg[key]!r} is not one of {', '.join(choices)}")
    if cfg.attention_backend == "fa4":
        try:
            model_lib.flash_attn_4()
        except ValueError as exc:  # flash-attn-4 is not installed, or lacks the backward function the op calls
            raise ConfigError(f"attention_backend: {exc}") from None
    if not cfg.name or "/" in cfg.name or cfg.name in (".", ".."):
        raise ConfigError(f"name {cfg.name!r} cannot name a run's folder and results entry; give a name without '/'")
    if cfg.name in RESERVED_NAMES:
        raise ConfigError(f"name {cfg.name!r} is a section of the results file; choose another --name")


def check_numbers(cfg):
    """The numeric settings that would fail or mean nothing."""
    if not 0 < cfg.activation_memory_budget <= 1:
        raise ConfigError(f"activation_memory_budget must lie in (0, 1], got {cfg.activation_memory_budget}")
    for key in ("seq_len", "tokens_per_update", "loss_chunk_tokens", "ddp_bucket_mb", "log_interval",
                "eval_batch_size", "learning_rate", "adam_eps"):
        if cfg[key] <= 0:
            raise ConfigError(f"{key} must be positive, got {cfg[key]}")
    for key in ("epochs", "warmup_updates", "cpu_threads", "checkpoint_minutes", "stop_after_updates",
                "train_subset_tokens", "val_subset_tokens", "seed", "weight_decay", "grad_clip", "min_lr"):
        if cfg[key] < 0:
            raise ConfigError(f"{key} must be 0 or more, got {cfg[key]}")
    for key in ("beta1", "beta2"):
        if not 0 <= cfg[key] < 1:
            raise ConfigError(f"{key} must lie in [0, 1), got {cfg[key]}")
    if cfg.min_lr > cfg.learning_rate:
        raise ConfigError(f"min_lr {cfg.min_lr} is above learning_rate {cfg.learning_rate}; the cosine schedule "
                          f"decays from learning_rate to min_lr")
    if cfg.val_subset_tokens == 1:
        raise ConfigError("val_subset_tokens 1 holds no target (the first token is only an input); give 0 "
                          "(all) or at least 2")


def check_fp8_head(cfg):
    """lm_head_fp8 runs inside the fused loss, on token counts its FP8 matmuls take."""
    if not cfg.lm_head_fp8:
        return
    if cfg.loss_impl != "fused":
        raise ConfigError(f"lm_head_fp8 runs inside the fused loss; set loss_impl=fused (got {cfg.loss_impl!r})")
    multiple = model_lib.FP8_MULTIPLE
    for key, tokens in (("micro_batch_size x seq_len", cfg.micro_batch_size * cfg.seq_len),
                        ("loss_chunk_tokens", cfg.loss_chunk_tokens)):
        if tokens % multiple:
            raise ConfigError(f"lm_head_fp8 needs {key} to be a multiple of {multiple} tokens (FP8 matmuls), "
                              f"got {tokens}")


def check_execution(cfg, world_size=1):
    """Every setting that would fail or mean nothing, refused before any work as a ConfigError; returns the
    sequences per update."""
    check_choices(cfg)
    check_numbers(cfg)
    if cfg.tokens_per_update % cfg.seq_len:
        raise ConfigError(f"tokens_per_update {cfg.tokens_per_update} is not a multiple of seq_len "
                          f"{cfg.seq_len}; an update is a whole number of sequences")
    sequences = cfg.tokens_per_update // cfg.seq_len
    check_fp8_head(cfg)
    if cfg.micro_batch_size < 1 or sequences % (cfg.micro_batch_size * world_size):
        valid = [m for m in range(1, sequences + 1) if sequences % (m * world_size) == 0]
        raise ConfigError(
            f"micro_batch_size {cfg.micro_batch_size} on {world_size} process(es) does not divide the "
            f"{sequences} sequences of an update (tokens_per_update / seq_len); valid sizes: {valid}")
    return sequences


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
    if initial:
        mcfg = dataclasses.replace(initial.config, max_seq_len=cfg.seq_len)  # rotary tables are not weights
        contradicted = [f"{k}={cfg[k]} (the weights have {getattr(mcfg, k)})" for k in MODEL_SHAPE_KEYS
                        if cfg[k] and cfg[k] != getattr(mcfg, k)]
        if contradicted:
            raise ConfigError(f"init_from {cfg.init_from} fixes the model's shape, which the settings contradict: "
                              f"{', '.join(contradicted)}; leave them at 0 or match the weights")
    else:
        mcfg = model_config(cfg, cache.vocab_size)
    if cache.vocab_size > mcfg.vocab_size:
        fix = ("start from a model of this tokenizer" if initial
               else f"set vocab_size=0 (follow the data) or at least {cache.vocab_size}")
        raise ConfigError(f"the data's tokenizer has {cache.vocab_size} tokens but the model's vocabulary "
                          f"holds {mcfg.vocab_size}; {fix}")
    if cfg.vocab_size > cache.vocab_size and not initial:
        raise ConfigError(f"vocab_size {cfg.vocab_size} is larger than the {cache.vocab_size} tokens of the cache "
                          f"{cfg.data_dir}: the LM head would hold rows no token uses; set vocab_size=0 (follow the "
                          f"data) or {cache.vocab_size}, or prepare a cache of that vocabulary")
    if cfg.lm_head_fp8:
        try:
            model_lib.check_fp8_shape(mcfg.dim, mcfg.vocab_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    rec = recipe(cfg, mcfg, cache.identity, initial.sha256 if initial else None)
    return cache, mcfg, rec


class StopRequest:
    """Turns SIGTERM/SIGINT (a scheduler's time limit, Ctrl-C) into a checkpoint at the next update."""

    SAME_STOP_SECONDS = 2.0  # a scheduler may signal the process and its parent passes the signal on too

    def __init__(self):
        self.signal, self.signalled_at = None, None
        self.previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now, unless it is the first one arriving twice
            if time.monotonic() - self.signalled_at < self.SAME_STOP_SECONDS:
                return
            signal.signal(signum, self.previous[signum])
            raise KeyboardInterrupt
        self.signal, self.signalled_at = signum, time.monotonic()  # no print: a handler's print can reenter stdout

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def format_seconds(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


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


# A checkpoint must hold these to be resumed (a final validation exists only once the run is complete, and
# checkpoints written before the training curve was recorded lack it: it starts empty for them).
RESUME_FIELDS = [f.name for f in dataclasses.fields(RunState) if f.name not in ("final_validation", "training_curve")]


class Run:
    """One training run of a config: its data, trainer and state, and the steps train() takes in order."""

    def __init__(self, cfg):
        self.cfg, self.session_start = cfg, time.time()
        self.rank, local_rank, self.world_size = distributed()
        self.main_process = self.rank == 0
        self.device = resolve_device(cfg, local_rank)
        self.sequences_per_update = check_execution(cfg, self.world_size)
        check_writable(cfg.results_file)
        initial = load_initial_weights(cfg)
        self.cache, self.mcfg, self.recipe = setup(cfg, initial)
        self.recipe_id = env.hash_json(self.recipe)
        self.data = training_data(cfg, self.cache, self.sequences_per_update)
        self.total_updates = self.data.updates_per_epoch * cfg.epochs
        self.trainer = Trainer(cfg, self.mcfg, self.device, self.total_updates, self.world_size, local_rank,
                               initial_state=initial.state if initial else None)
        self.ckpt_path = prepare_out_dir(cfg)  # after every check above, so that a refused run leaves no folder
        if initial and self.main_process:
            print(f"initial weights from {cfg.init_from} ({initial.source}, {initial.sha256[:12]})")
        self.flops = model_lib.flops_per_token(self.mcfg, cfg.seq_len)
        self.gpu_name = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else None
        self.parameters = sum(p.numel() for p in self.trainer.raw_model.parameters())
        self.state, self.status, self.session_updates = RunState(), "running", 0
        self.last_checkpoint_time = time.time()
        self.fingerprint = env.fingerprint(self.cache.identity) if self.main_process else None

    # -- resume or start

    def resume_or_start(self):
        """Continue from the checkpoint when resume is set and one exists (refused if its recipe differs)."""
        cfg, path = self.cfg, self.ckpt_path
        if cfg.resume and path.exists():
            try:
                ckpt = checkpoint.read(path, self.device)
            except ValueError as exc:
                raise ConfigError(f"{exc} Move it away to start afresh, or resume from another --out_dir") from None
            missing = [k for k in ("recipe", "model", "optimizer", "step", "rng", *RESUME_FIELDS)
                       if not isinstance(ckpt, dict) or k not in ckpt]
            if missing:
                raise ConfigError(f"checkpoint {path} is not one train.py wrote (it lacks "
                                  f"{', '.join(missing[:4])}); move it away to start afresh, or resume from "
                                  f"another --out_dir")
            differ = recipe_differences(ckpt["recipe"], self.recipe)
            if differ:
                raise ConfigError(f"checkpoint {path} was trained with another recipe; fields that differ: "
                                  f"{', '.join(differ)}. Resume with the same recipe, or start a new --name")
            self.trainer.raw_model.load_state_dict(ckpt["model"])
            self.trainer.optimizer.load_state_dict(ckpt["optimizer"])
            self.trainer.step = ckpt["step"]
            checkpoint.set_rng_state(ckpt["rng"])
            self.state = RunState(**{f.name: ckpt[f.name] for f in dataclasses.fields(RunState) if f.name in ckpt})
            print(f"resumed {path} at update {self.trainer.step} (epoch {self.state.epoch + 1}, "
                  f"update {self.state.update_in_epoch} of {self.data.updates_per_epoch})")
        elif cfg.resume:
            print(f"no checkpoint at {path}: starting from scratch")
        self.state.sessions += 1
        self.dashboards = Dashboards(cfg, self.state.run_id, path.parent) if self.main_process else None

    def announce(self):
        if not self.main_process:
            return
        cfg, data = self.cfg, self.data
        accumulation = micro_steps(cfg, self.world_size)
        compiles = cfg.compile and self.state.first_update_seconds is None
        print(f"{cfg.name}: {self.parameters:,} parameters, {data.n_sequences:,} sequences of {cfg.seq_len} per "
              f"epoch, {data.updates_per_epoch} updates per epoch x {cfg.epochs} epochs, micro-batch "
              f"{cfg.micro_batch_size} x {accumulation} accumulation x {self.world_size} process(es), "
              f"{self.device}, attention {self.trainer.attention} ({self.trainer.attention_reason}), "
              f"recipe {self.recipe_id[:12]}"
              + ("; the first update compiles the model" if compiles else ""), flush=True)

    # -- one update and its log

    def epoch_batches(self):
        """The rest of this epoch's updates as (update index, this rank's micro-batches, target tokens)."""
        epoch, cfg = self.state.epoch, self.cfg
        updates = range(self.state.update_in_epoch, self.data.updates_per_epoch)
        batches = Prefetcher(lambda u: self.data.micro_batches(epoch, u, cfg.micro_batch_size, self.rank,
                                                               self.world_size), updates, self.device)
        self.synchronize()
        self.segment_start = self.interval_start = time.time()
        self.interval_tokens, self.loss_total = 0, None
        return batches

    def synchronize(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def after_update(self, u, loss_sum, grad_norm, n_tokens):
        """Count the update's tokens; time the first update; print the log line every log_interval updates."""
        state = self.state
        if state.first_update_seconds is None:
            self.synchronize()
            state.first_update_seconds = time.time() - self.segment_start
            if self.main_process:
                print(f"first update: {state.first_update_seconds:.1f} s"
                      + (" (compile included)" if self.cfg.compile else ""), flush=True)
        self.loss_total = loss_sum if self.loss_total is None else self.loss_total + loss_sum
        state.tokens += n_tokens
        state.update_in_epoch = u + 1
        self.interval_tokens += n_tokens
        self.session_updates += 1
        if self.is_log_step(u):
            self.log(grad_norm)

    def is_log_step(self, u):
        return self.trainer.step % self.cfg.log_interval == 0 or self.epoch_ends(u)

    def epoch_ends(self, u):
        return u + 1 == self.data.updates_per_epoch

    def log(self, grad_norm):
        """The interval's mean training loss, learning rate and gradient norm: printed, recorded in the
        training curve, and sent to the dashboards."""
        cfg, trainer, state = self.cfg, self.trainer, self.state
        loss = all_reduce_sum(self.loss_total.detach().clone(), self.world_size).item() / self.interval_tokens
        now = time.time()
        rate = self.interval_tokens / (now - self.interval_start)
        lr, norm = trainer.lr_at(trainer.step - 1), grad_norm.item()
        state.interval_tokens_per_second.append(rate)
        state.training_curve.append({"update": trainer.step, "tokens": state.tokens, "loss": loss, "lr": lr,
                                     "grad_norm": norm,
                                     "training_seconds": state.training_seconds + now - self.segment_start})
        if self.main_process:
            self.dashboards.log(trainer.step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                               "train/tokens_per_second": rate})
            mfu = env.mfu(self.flops, rate / self.world_size, self.gpu_name)
            mfu = f"{100 * mfu:.1f}%" if mfu else "n/a"
            eta = (self.total_updates - trainer.step) * cfg.tokens_per_update / rate
            print(f"update {trainer.step}/{self.total_updates} | epoch {state.epoch + 1} | loss {loss:.4f} | "
                  f"grad norm {norm:.3f} | lr {lr:.2e} | {rate / 1e3:,.1f}K tok/s | MFU {mfu} | "
                  f"ETA {format_seconds(eta)}", flush=True)
        self.interval_start, self.interval_tokens, self.loss_total = now, 0, None

    def stop_requested(self, stop, u):
        """A signal (on any rank) or stop_after_updates: every rank stops at the same update."""
        signalled = stop.signal is not None
        if self.world_size > 1:
            # Ranks agree on a signal only where the log line syncs anyway, never with a host sync per update.
            signalled = False
            if self.is_log_step(u):
                flag = torch.tensor([float(stop.signal is not None)], device=self.device)
                signalled = all_reduce_sum(flag, self.world_size).item() > 0
        limit = self.cfg.stop_after_updates
        return signalled or bool(limit and self.session_updates >= limit)

    def checkpoint_due(self):
        minutes = self.cfg.checkpoint_minutes
        return bool(minutes) and time.time() - self.last_checkpoint_time > 60 * minutes

    # -- the pause: epoch end with evaluation, checkpoint and record

    def pause(self, u, stop_now, stop):
        """Out of the training clock: the epoch's validation (at its end), the checkpoint and the entry."""
        self.synchronize()
        segment = time.time() - self.segment_start
        self.state.training_seconds += segment
        self.state.training_elapsed_seconds += segment
        pause_start = time.time()
        if self.epoch_ends(u):
            self.end_epoch(pause_start)
        if stop_now:
            self.status = "interrupted"
            self.say_stopped(stop)
        self.save_checkpoint()
        self.last_checkpoint_time = time.time()
        self.record(self.status)
        paused = time.time() - pause_start
        self.state.training_elapsed_seconds += paused
        self.interval_start += paused  # a mid-interval checkpoint is not training time
        self.segment_start = time.time()

    def end_epoch(self, pause_start):
        state = self.state
        state.epoch += 1
        state.update_in_epoch = 0
        result = self.evaluate(self.cfg.val_subset_tokens)
        state.validation_curve.append({"epoch": state.epoch, "tokens": state.tokens, "loss": result["loss"],
                                       "seconds": time.time() - pause_start,
                                       "training_seconds": state.training_seconds})
        if state.best_subset_loss is None or result["loss"] < state.best_subset_loss:
            state.best_subset_loss, state.best_epoch = result["loss"], state.epoch
        if self.main_process:
            self.dashboards.log(self.trainer.step, {"val/subset_loss": result["loss"]})
            print(f"epoch {state.epoch}: validation-subset loss {result['loss']:.4f} over {result['tokens']:,} tokens")

    def say_stopped(self, stop):
        if not self.main_process:
            return
        reason = (f"signal {signal.Signals(stop.signal).name}" if stop.signal is not None
                  else f"stop_after_updates={self.cfg.stop_after_updates}" if self.cfg.stop_after_updates
                  else "stop on another process")
        print(f"{reason}: checkpointed at update {self.trainer.step}; resume with --resume=True", flush=True)

    def evaluate(self, max_tokens):
        """Mean validation loss over the first max_tokens tokens (0: all), split among the ranks."""
        from tqdm import tqdm
        cfg, val = self.cfg, self.cache.val
        batches = eval_batches(val, cfg.seq_len, cfg.eval_batch_size, max_tokens)
        if self.world_size > 1:
            batches = (b for i, b in enumerate(batches) if i % self.world_size == self.rank)
        total = math.ceil(eval_batch_count(len(val), cfg.seq_len, cfg.eval_batch_size, max_tokens) / self.world_size)
        # a full pass over a large validation split takes minutes; the bar goes when it ends
        batches = tqdm(batches, total=total, desc="full validation" if not max_tokens else "validation subset",
                       unit="batch", leave=False, disable=not self.main_process)
        return self.trainer.evaluate(batches)

    def save_checkpoint(self):
        if self.main_process:
            trainer = self.trainer
            checkpoint.save(self.ckpt_path, trainer.raw_model, trainer.optimizer, trainer.step,
                            dict(dataclasses.asdict(self.state), recipe=self.recipe, config=dict(self.cfg),
                                 model_config=self.mcfg.to_dict()))

    # -- the end

    def finish(self):
        """The full validation pass (when configured), then the final checkpoint."""
        if self.cfg.full_validation:
            start = time.time()
            result = self.evaluate(0)
            seconds = time.time() - start
            result.update(perplexity=math.exp(result["loss"]), seconds=seconds, split="full",
                          validation_complete=True, tokens_per_second=result["tokens"] / seconds)
            self.state.final_validation = result
            if self.main_process:
                self.dashboards.log(self.trainer.step, {"val/loss": result["loss"], "val/perplexity": result["perplexity"]})
                print(f"full validation: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, "
                      f"{result['tokens']:,} tokens in {result['seconds']:.1f} s")
        self.status = "complete"
        self.save_checkpoint()

    def fail(self, exc):
        """Record the run as interrupted (a second signal) or failed, with the error, before it propagates."""
        self.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        error = None if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        if self.main_process:
            record(self.cfg.results_file, [self.cfg.name], dict(self.entry(), error=error))
            if getattr(self, "dashboards", None):
                self.dashboards.close()

    def close(self):
        """The final entry, recorded (with SLURM's accounting when under SLURM) and summarized."""
        result = self.entry()
        if self.main_process:
            self.dashboards.close()
            record(self.cfg.results_file, [self.cfg.name], result)
            usage = env.allocation_usage()
            if usage:
                record(self.cfg.results_file, ["allocation-usage"], usage)
            print_summary(result)
        return result

    def record(self, status):
        if self.main_process:
            record(self.cfg.results_file, [self.cfg.name], self.entry(status))

    def entry(self, status=None):
        """The run's results entry: the reference's fields, then this project's."""
        s, cfg = self.state, self.cfg
        seconds, elapsed = s.training_seconds, s.training_elapsed_seconds
        rates = sorted(s.interval_tokens_per_second)
        tokens_per_second = s.tokens / seconds if seconds else None
        return {
            "status": status or self.status, "run_id": s.run_id, "parameters": self.parameters, "tokens": s.tokens,
            "step": self.trainer.step, "total_updates": self.total_updates, "epochs": s.epoch,
            "best_subset_loss": s.best_subset_loss, "best_epoch": s.best_epoch,
            "final_validation": s.final_validation, "seconds_this_session": time.time() - self.session_start,
            "training_seconds": seconds, "training_elapsed_seconds": elapsed,
            "training_tokens_per_second": tokens_per_second,
            "elapsed_tokens_per_second": s.tokens / elapsed if elapsed else None,
            "median_training_tokens_per_second": rates[len(rates) // 2] if rates else None,
            "first_update_seconds": s.first_update_seconds,
            "mfu": env.mfu(self.flops, tokens_per_second / self.world_size if seconds else None, self.gpu_name),
            "flops_per_token": self.flops, "peak_memory_bytes": peak_memory_bytes(self.device),
            "world_size": self.world_size, "sessions": s.sessions, "attention": self.trainer.attention,
            "recipe_identity": self.recipe_id, "recipe": self.recipe, "config": dict(cfg),
            "config_identity": env.config_identity(dict(cfg)), "validation_curve": s.validation_curve,
            "interval_tokens_per_second": s.interval_tokens_per_second, "training_curve": s.training_curve,
            "environment": self.fingerprint,
        }


def train(cfg):
    """Run (or resume) the configured training; returns the results entry."""
    run = Run(cfg)                   # every check, the data, the model and the optimizer: no work done yet
    run.resume_or_start()
    run.announce()
    stop = StopRequest()             # before the "running" entry, so that no signal can leave it standing
    run.record("running")
    try:
        while run.state.epoch < cfg.epochs and run.status == "running":
            for u, micro_batches, n_tokens in run.epoch_batches():
                loss_sum, grad_norm = run.trainer.update(micro_batches, n_tokens)
                run.after_update(u, loss_sum, grad_norm, n_tokens)   # counts, first-update time, log line
                stop_now = run.stop_requested(stop, u)
                if stop_now or run.checkpoint_due() or run.epoch_ends(u):
                    run.pause(u, stop_now, stop)   # the epoch's validation at its end, checkpoint, record
                if stop_now:
                    break
        if run.status == "running":
            run.finish()             # the full validation, then the final checkpoint
    except BaseException as exc:
        run.fail(exc)
        raise
    finally:
        stop.restore()
    return run.close()


def print_summary(entry):
    """The run's closing table: status, updates, tokens, losses, speed, MFU and peak memory."""
    fv, best, rate = entry["final_validation"] or {}, entry["best_subset_loss"], entry["training_tokens_per_second"]
    rows = [("status", entry["status"]), ("updates", f"{entry['step']}/{entry['total_updates']}"),
            ("tokens", f"{entry['tokens']:,}"),
            ("best subset loss", f"{best:.4f} (epoch {entry['best_epoch']})" if best else "-"),
            ("final validation", f"{fv['loss']:.4f} (ppl {fv['perplexity']:.2f})" if fv else "-"),
            ("training tokens/s", f"{rate:,.0f}" if rate else "-"),
            ("training seconds", f"{entry['training_seconds']:.1f} of {entry['training_elapsed_seconds']:.1f} elapsed"),
            ("MFU", f"{100 * entry['mfu']:.1f}%" if entry["mfu"] else "n/a"),
            ("peak memory", f"{entry['peak_memory_bytes'] / 2**30:.2f} GiB")]
    print("\n".join(f"{k:>20}: {v}" for k, v in rows))


def main(argv):
    try:
        cfg = Config(load_config(DEFAULTS, argv))
        entry = train(cfg)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Free the DDP wrapper (it sits in reference cycles) and the process group now: left to interpreter
            # exit, gloo's threads can abort the process (SIGABRT, "terminate called without an active
            # exception"), and torchrun then fails the job and kills rank 0, maybe before it records the run.
            import gc
            gc.collect()
            torch.distributed.destroy_process_group()
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    # A stopped run checkpointed cleanly but is not finished: say so to whatever runs this next.
    return EXIT_INTERRUPTED if entry["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
