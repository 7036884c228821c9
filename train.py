"""Train a tiny-llm model: python train.py config/20m_gh200.py [--key=value ...]

One process per GPU; `torchrun --nproc_per_node=N train.py ...` runs DistributedDataParallel.
bench.py imports this file and times the very update step (`Trainer.update`) that training runs.
"""
import contextlib
import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch._functorch.config  # activation_memory_budget

import env
import model as model_lib
from data.loader import CacheError, Prefetcher, TokenCache, TrainData, eval_batch_count, eval_batches

# ---------------------------------------------------------------- defaults (config files and --key=value override them)
# run
name = "run"                     # entry name in the results file; checkpoints go to out/<name>
out_dir = ""                     # "" means out/<name>
results_file = "results.json"
resume = False                   # continue from out_dir/ckpt.pt (refused if the recipe differs)
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
# execution: how the math is run, never what it is
device = "auto"                  # auto, cpu, cuda
micro_batch_size = 8
compile = False
compile_mode = "default"         # default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs
compile_scope = "model"          # model: one graph; blocks: each block and the loss head apart (compiles once
                                 # for all the identical blocks, so a much shorter cold start)
sdpa_backend = "auto"            # auto, flash, efficient, cudnn, math, or fa4 (cuDNN's forward, flash-attn-4's
                                 # backward; flash-attn-4 is installed apart)
loss_impl = "full"               # full, chunked, fused (see model.py)
loss_chunk_tokens = 8192         # tokens per slice of the chunked and fused losses
activation_memory_budget = 1.0   # compiled only: the share of the compiler's activation memory to keep; below 1 it
                                 # recomputes cheap ops in backward instead of saving their outputs
cpu_threads = 0                  # 0: PyTorch's default
ddp_bucket_mb = 100              # DistributedDataParallel gradient bucket, MB: 100 measured +1.9% over PyTorch's 25 (90m, 2 GPUs)
eval_batch_size = 32
log_interval = 50
checkpoint_minutes = 0.0         # also checkpoint every N minutes (0: only at epoch ends and on signals)
stop_after_updates = 0           # end this session after N updates, as a scheduler's time limit would

DEFAULTS = env.defaults_of(globals())

# Keys that only change how the math is executed; every other key is part of the recipe identity.
EXECUTION_KEYS = {"name", "out_dir", "results_file", "resume", "data_dir", "device", "micro_batch_size",
                  "compile", "compile_mode", "compile_scope", "sdpa_backend", "loss_impl", "loss_chunk_tokens",
                  "activation_memory_budget", "cpu_threads", "ddp_bucket_mb", "eval_batch_size", "log_interval",
                  "checkpoint_minutes", "stop_after_updates"}
MODEL_KEYS = {"preset", "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "seq_len"}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
RESERVED_NAMES = {"environment", "benchmarks", "tuning", "profiles", "history", "matched-comparison",
                  "partial-probe", "trained-parity", "allocation-usage", "loss-microbench"}


EXIT_INTERRUPTED = 3  # exit status of a run stopped by a signal or stop_after_updates, checkpointed to resume

# Mistakes a user can fix: reported as one line, never a traceback.
USER_ERRORS = (env.ConfigError, env.ResultsFileError, CacheError)


class Config(dict):
    """The resolved configuration; keys read as attributes."""
    __getattr__ = dict.__getitem__


def model_config(cfg, vocab):
    """The model's shape: the preset with the config's overrides; a bad one is a ConfigError."""
    overrides = {k: cfg[k] for k in ("dim", "n_layers", "n_heads", "hidden_dim") if cfg[k]}
    try:
        return model_lib.get_preset(cfg.preset, vocab_size=cfg.vocab_size or vocab, max_seq_len=cfg.seq_len,
                                    **overrides)
    except ValueError as exc:  # unknown preset, width not divisible by heads, ...
        raise env.ConfigError(str(exc)) from None


def recipe(cfg, mcfg, cache_identity):
    """Everything that changes the math of a run, and nothing that only changes its execution."""
    # The model's own fields are taken from the resolved config, so "dim=0" (the preset's) and "dim=320"
    # are one recipe.
    fields = {k: v for k, v in cfg.items() if k not in EXECUTION_KEYS and k not in MODEL_KEYS}
    fields.update(model=mcfg.to_dict(), cache_identity=cache_identity)
    return fields


def run_dir(cfg):
    """Where a run's checkpoint lives: out_dir, or out/<name>."""
    return Path(cfg.out_dir or f"out/{cfg.name}")


def resolve_device(cfg, local_rank=None):
    """"cpu" or "cuda"; given this process's local rank, its own GPU ("cuda:N"), made the current one."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise env.ConfigError(f"device {cfg.device!r} is not one of auto, cpu, cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise env.ConfigError("device 'cuda' was asked for but PyTorch sees no GPU; use --device=cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and local_rank is not None:
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return device


def training_data(cfg, cache, sequences_per_update):
    """The fixed training subset of the cache, cut into the run's updates (train.py trains it, bench.py times it)."""
    return TrainData(cache.train, cfg.seq_len, sequences_per_update, cfg.seed, cfg.train_subset_tokens)


def check_execution(cfg, world_size=1):
    """Every setting that would fail or mean nothing, refused before any work as a ConfigError; returns the
    sequences per update."""
    if cfg.compile_mode not in COMPILE_MODES:
        raise env.ConfigError(f"compile_mode {cfg.compile_mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if cfg.compile_scope not in COMPILE_SCOPES:
        raise env.ConfigError(f"compile_scope {cfg.compile_scope!r} is not one of {', '.join(COMPILE_SCOPES)}")
    if cfg.sdpa_backend not in model_lib.ATTENTION_BACKENDS:
        raise env.ConfigError(f"sdpa_backend {cfg.sdpa_backend!r} is not one of "
                              f"{', '.join(model_lib.ATTENTION_BACKENDS)}")
    if cfg.sdpa_backend == "fa4":
        try:
            model_lib.flash_attn_4()
        except ValueError as exc:  # flash-attn-4 is not installed, or lacks the backward function the op calls
            raise env.ConfigError(f"sdpa_backend: {exc}") from None
    if cfg.loss_impl not in model_lib.LOSS_IMPLEMENTATIONS:
        raise env.ConfigError(f"loss_impl {cfg.loss_impl!r} is not one of {', '.join(model_lib.LOSS_IMPLEMENTATIONS)}")
    if not 0 < cfg.activation_memory_budget <= 1:
        raise env.ConfigError(f"activation_memory_budget must lie in (0, 1], got {cfg.activation_memory_budget}")
    for key in ("seq_len", "tokens_per_update", "loss_chunk_tokens", "ddp_bucket_mb", "log_interval",
                "eval_batch_size"):
        if cfg[key] <= 0:
            raise env.ConfigError(f"{key} must be positive, got {cfg[key]}")
    for key in ("epochs", "warmup_updates", "cpu_threads", "checkpoint_minutes", "stop_after_updates",
                "train_subset_tokens", "val_subset_tokens", "seed", "weight_decay", "grad_clip", "min_lr"):
        if cfg[key] < 0:
            raise env.ConfigError(f"{key} must be 0 or more, got {cfg[key]}")
    for key in ("learning_rate", "adam_eps"):
        if cfg[key] <= 0:
            raise env.ConfigError(f"{key} must be positive, got {cfg[key]}")
    for key in ("beta1", "beta2"):
        if not 0 <= cfg[key] < 1:
            raise env.ConfigError(f"{key} must lie in [0, 1), got {cfg[key]}")
    if cfg.min_lr > cfg.learning_rate:
        raise env.ConfigError(f"min_lr {cfg.min_lr} is above learning_rate {cfg.learning_rate}; the cosine schedule "
                              f"decays from learning_rate to min_lr")
    if cfg.val_subset_tokens == 1:
        raise env.ConfigError("val_subset_tokens 1 holds no target (the first token is only an input); give 0 "
                              "(all) or at least 2")
    if cfg.name in RESERVED_NAMES:
        raise env.ConfigError(f"name {cfg.name!r} is a section of the results file; choose another --name")
    if cfg.tokens_per_update % cfg.seq_len:
        raise env.ConfigError(f"tokens_per_update {cfg.tokens_per_update} is not a multiple of seq_len "
                              f"{cfg.seq_len}; an update is a whole number of sequences")
    sequences = cfg.tokens_per_update // cfg.seq_len
    if cfg.micro_batch_size < 1 or sequences % (cfg.micro_batch_size * world_size):
        valid = [m for m in range(1, sequences + 1) if sequences % (m * world_size) == 0]
        raise env.ConfigError(
            f"micro_batch_size {cfg.micro_batch_size} on {world_size} process(es) does not divide the "
            f"{sequences} sequences of an update (tokens_per_update / seq_len); valid sizes: {valid}")
    return sequences


# ---------------------------------------------------------------- distributed

def distributed():
    """(rank, local_rank, world_size); initializes the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 0, 1
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), world_size


def all_reduce_sum(tensor, world_size):
    if world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor


# ---------------------------------------------------------------- the update step

class Trainer:
    """Model, optimizer and schedule, with the one update step that train.py runs and bench.py times."""

    def __init__(self, cfg, mcfg, device, total_updates, world_size=1, local_rank=0):
        self.cfg, self.device, self.world_size = cfg, torch.device(device), world_size
        self.total_updates = total_updates
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        if cfg.sdpa_backend == "fa4" and not (self.device.type == "cuda"
                                                and torch.cuda.get_device_capability(self.device)[0] in (9, 10)):
            # flash-attn-4's backward runs on these; on the CPU its import may work, its kernels do not
            raise env.ConfigError("sdpa_backend 'fa4' runs on Hopper and Blackwell GPUs only (compute capability "
                                  "9.x or 10.x); choose auto, flash, efficient, cudnn or math")
        torch.manual_seed(cfg.seed)
        self.raw_model = model_lib.Transformer(mcfg, attention_backend=cfg.sdpa_backend, loss_impl=cfg.loss_impl,
                                               loss_chunk_tokens=cfg.loss_chunk_tokens).to(self.device)
        self.model = self.raw_model
        self.cudagraphs = cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune")
        if cfg.compile:
            # Read by the partitioner when the first call compiles; process-wide, as torch.compile's settings are.
            torch._functorch.config.activation_memory_budget = cfg.activation_memory_budget
            mode = None if cfg.compile_mode == "default" else cfg.compile_mode
            if cfg.compile_scope == "blocks":
                # Compiled in place, so the module (and its state_dict names) stay as they are.
                for layer in self.raw_model.layers:
                    layer.compile(dynamic=False, mode=mode)
                self.raw_model.loss = torch.compile(self.raw_model.loss, dynamic=False, mode=mode)
            else:
                self.model = torch.compile(self.raw_model, dynamic=False, mode=mode)
        self.eval_model = self.model  # evaluation needs no gradient sync, so never the DDP wrapper
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel
            # No buffer broadcast: the rotary tables are identical on every rank, and a broadcast per forward
            # would make evaluation (ranks see different batch counts) a collective.
            import inspect
            no_buffer_sync = ({"forward_sync_buffers": False}
                              if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                              else {"broadcast_buffers": False})  # renamed after PyTorch 2.11
            self.model = DistributedDataParallel(self.model, **no_buffer_sync, gradient_as_bucket_view=True,
                                                 bucket_cap_mb=cfg.ddp_bucket_mb,
                                                 device_ids=[local_rank] if self.device.type == "cuda" else None)
        decay = [p for p in self.raw_model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.raw_model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
            fused=self.device.type == "cuda")
        self.step = 0
        # bf16 autocast on the GPU; None (float32) on the CPU. A test turns it on there too.
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None

    def autocast(self, enabled=True):
        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=enabled and self.autocast_dtype is not None)

    def lr_at(self, step):
        """Linear warmup to learning_rate, then cosine decay to min_lr at the last update."""
        cfg = self.cfg
        if step < cfg.warmup_updates:
            return cfg.learning_rate * (step + 1) / cfg.warmup_updates
        progress = (step - cfg.warmup_updates) / max(1, self.total_updates - cfg.warmup_updates)
        progress = min(progress, 1.0)
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)

    def update(self, micro_batches, n_tokens):
        """One optimizer update over this rank's micro-batches; n_tokens counts the update's targets on all
        ranks. Returns (sum of this rank's token losses, gradient norm before clipping) as device tensors:
        no host sync here, the caller reads them when it logs."""
        lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Each micro-step adds sum(token losses) / n_tokens, so the update's gradient is the mean over its
        # tokens whatever the micro-batch size; DDP averages over ranks, hence the world_size factor.
        scale = self.world_size / n_tokens
        loss_sum = torch.zeros((), device=self.device)
        last = len(micro_batches) - 1
        # One autocast region for all micro-steps: autocast keeps its bf16 copy of each weight until the
        # region ends, so eager casts the weights once per update instead of once per micro-step (the
        # weights change only in the optimizer step, so the copies are the same). Backward runs outside
        # autocast, as before.
        with self.autocast():
            for i, (x, y) in enumerate(micro_batches):
                sync = contextlib.nullcontext()
                if self.world_size > 1 and i < last:
                    sync = self.model.no_sync()  # all-reduce gradients once, on the last micro-step
                if self.cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with sync:
                    loss = self.model(x, y, reduction="sum")
                    with self.autocast(enabled=False):
                        (loss * scale).backward()
                loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.grad_clip or math.inf)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_sum, grad_norm

    @torch.no_grad()
    def evaluate(self, batches):
        """Mean token loss over batches, with the per-token standard deviation and the token count."""
        self.eval_model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in batches:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.autocast():
                losses = self.eval_model(x, y, reduction="none").double()
            totals += torch.stack([losses.sum(), (losses * losses).sum(), (y != -100).sum().double()])
        self.eval_model.train()
        totals = all_reduce_sum(totals, self.world_size)
        loss_sum, square_sum, count = totals.tolist()
        mean = loss_sum / max(count, 1)
        std = math.sqrt(max(square_sum / max(count, 1) - mean * mean, 0.0))
        return {"loss": mean, "loss_std": std, "tokens": int(count)}


def peak_memory_bytes(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS on the CPU


def setup(cfg):
    """Shared by train and bench: the verified data cache, the model config and the recipe identity."""
    try:
        cache = TokenCache(cfg.data_dir, vocab_size=cfg.vocab_size)
    except CacheError as exc:
        raise env.ConfigError(str(exc)) from None
    mcfg = model_config(cfg, cache.vocab_size)
    if cache.vocab_size > mcfg.vocab_size:
        raise env.ConfigError(f"the data's tokenizer has {cache.vocab_size} tokens but the model's vocabulary "
                              f"holds {mcfg.vocab_size}; set vocab_size=0 (follow the data) or at least "
                              f"{cache.vocab_size}")
    rec = recipe(cfg, mcfg, cache.identity)
    return cache, mcfg, rec


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(path, trainer, state):
    payload = dict(state, model=trainer.raw_model.state_dict(), optimizer=trainer.optimizer.state_dict(),
                   step=trainer.step, rng=rng_state())
    env.atomic_write(path, lambda f: torch.save(payload, f))


def rng_state():
    import random
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    import random
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def recipe_differences(old, new):
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


# ---------------------------------------------------------------- the training run

class StopRequest:
    """Turns SIGTERM/SIGINT (a scheduler's time limit, Ctrl-C) into a checkpoint at the next update."""

    def __init__(self):
        self.signal = None
        self.previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            signal.signal(signum, self.previous[signum])
            raise KeyboardInterrupt
        self.signal = signum  # no print here: printing inside a handler can hit a reentrant stdout write

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def format_seconds(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def train(cfg):
    """Run (or resume) the configured training; returns the results entry."""
    session_start = time.time()
    rank, local_rank, world_size = distributed()
    main_process = rank == 0
    device = resolve_device(cfg, local_rank)
    sequences_per_update = check_execution(cfg, world_size)
    cache, mcfg, rec = setup(cfg)
    recipe_id = env.hash_json(rec)
    data = training_data(cfg, cache, sequences_per_update)
    total_updates = data.updates_per_epoch * cfg.epochs
    trainer = Trainer(cfg, mcfg, device, total_updates, world_size, local_rank)
    out = run_dir(cfg)
    try:  # now, not at the first checkpoint after an epoch of training
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise env.ConfigError(f"out_dir {str(out)!r} cannot be made ({exc.strerror}); give a writable folder") from None
    ckpt_path = out / "ckpt.pt"
    flops = model_lib.flops_per_token(mcfg, cfg.seq_len)
    gpu_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else None

    state = {"epoch": 0, "update_in_epoch": 0, "tokens": 0, "validation_curve": [], "best_subset_loss": None,
             "best_epoch": None, "training_seconds": 0.0, "training_elapsed_seconds": 0.0,
             "interval_tokens_per_second": [], "run_id": env.new_run_id(), "sessions": 0,
             "first_update_seconds": None}
    if cfg.resume and ckpt_path.exists():
        try:
            ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)  # our own file: numpy RNG too
        except Exception as exc:
            raise env.ConfigError(f"checkpoint {ckpt_path} could not be loaded ({type(exc).__name__}: {exc}); "
                                  f"move it away to start afresh, or resume from another --out_dir") from None
        missing = [k for k in ("recipe", "model", "optimizer", "step", "rng", *state)
                   if not isinstance(ckpt, dict) or k not in ckpt]
        if missing:
            raise env.ConfigError(f"checkpoint {ckpt_path} is not one train.py wrote (it lacks "
                                  f"{', '.join(missing[:4])}); move it away to start afresh, or resume from "
                                  f"another --out_dir")
        differ = recipe_differences(ckpt["recipe"], rec)
        if differ:
            raise env.ConfigError(f"checkpoint {ckpt_path} was trained with another recipe; fields that differ: "
                                  f"{', '.join(differ)}. Resume with the same recipe, or start a new --name")
        trainer.raw_model.load_state_dict(ckpt["model"])
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
        trainer.step = ckpt["step"]
        set_rng_state(ckpt["rng"])
        state = {k: ckpt[k] for k in state}
        print(f"resumed {ckpt_path} at update {trainer.step} (epoch {state['epoch'] + 1}, "
              f"update {state['update_in_epoch']} of {data.updates_per_epoch})")
    elif cfg.resume:
        print(f"no checkpoint at {ckpt_path}: starting from scratch")
    state["sessions"] += 1

    parameters = sum(p.numel() for p in trainer.raw_model.parameters())
    fingerprint = env.fingerprint(cache.identity) if main_process else None

    def entry(status):
        seconds = state["training_seconds"]
        elapsed = state["training_elapsed_seconds"]
        rates = sorted(state["interval_tokens_per_second"])
        return {
            "status": status, "run_id": state["run_id"], "parameters": parameters, "tokens": state["tokens"],
            "step": trainer.step, "total_updates": total_updates, "epochs": state["epoch"],
            "best_subset_loss": state["best_subset_loss"], "best_epoch": state["best_epoch"],
            "final_validation": state.get("final_validation"),
            "seconds_this_session": time.time() - session_start,
            "training_seconds": seconds, "training_elapsed_seconds": elapsed,
            "training_tokens_per_second": state["tokens"] / seconds if seconds else None,
            "elapsed_tokens_per_second": state["tokens"] / elapsed if elapsed else None,
            "median_training_tokens_per_second": rates[len(rates) // 2] if rates else None,
            "first_update_seconds": state["first_update_seconds"],
            "mfu": env.mfu(flops, state["tokens"] / seconds / world_size if seconds else None, gpu_name),
            "flops_per_token": flops, "peak_memory_bytes": peak_memory_bytes(device),
            "world_size": world_size, "sessions": state["sessions"],
            "recipe_identity": recipe_id, "recipe": rec, "config": dict(cfg),
            "config_identity": env.config_identity(dict(cfg)), "validation_curve": state["validation_curve"],
            "interval_tokens_per_second": state["interval_tokens_per_second"], "environment": fingerprint,
        }

    def record(status):
        if main_process:
            env.record(cfg.results_file, [cfg.name], entry(status))

    def checkpoint():
        if main_process:
            save_checkpoint(ckpt_path, trainer, dict(state, recipe=rec, config=dict(cfg), model_config=mcfg.to_dict()))

    def evaluate(max_tokens):
        from tqdm import tqdm
        batches = eval_batches(cache.val, cfg.seq_len, cfg.eval_batch_size, max_tokens)
        if world_size > 1:
            batches = (b for i, b in enumerate(batches) if i % world_size == rank)
        total = math.ceil(eval_batch_count(len(cache.val), cfg.seq_len, cfg.eval_batch_size, max_tokens) / world_size)
        # a full pass over a large validation split takes minutes; the bar goes when it ends
        batches = tqdm(batches, total=total, desc="full validation" if not max_tokens else "validation subset",
                       unit="batch", leave=False, disable=not main_process)
        return trainer.evaluate(batches)

    if main_process:
        print(f"{cfg.name}: {parameters:,} parameters, {data.n_sequences:,} sequences of {cfg.seq_len} per epoch, "
              f"{data.updates_per_epoch} updates per epoch x {cfg.epochs} epochs, "
              f"micro-batch {cfg.micro_batch_size} x {sequences_per_update // cfg.micro_batch_size // world_size} "
              f"accumulation x {world_size} process(es), {device}, recipe {recipe_id[:12]}"
              + ("; the first update compiles the model" if cfg.compile and state["first_update_seconds"] is None
                 else ""), flush=True)
    stop = StopRequest()  # before the "running" entry, so that no signal can leave it standing
    record("running")
    status = "running"
    session_updates = 0
    last_checkpoint = time.time()
    try:
        while state["epoch"] < cfg.epochs and status == "running":
            epoch = state["epoch"]
            updates = range(state["update_in_epoch"], data.updates_per_epoch)
            batches = Prefetcher(lambda u: data.micro_batches(epoch, u, cfg.micro_batch_size, rank, world_size),
                                 updates, device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            segment_start = interval_start = time.time()
            interval_tokens, loss_total = 0, None
            for u, micro_batches, n_tokens in batches:
                loss_sum, grad_norm = trainer.update(micro_batches, n_tokens)
                if state["first_update_seconds"] is None:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    state["first_update_seconds"] = time.time() - segment_start
                    if main_process:
                        print(f"first update: {state['first_update_seconds']:.1f} s"
                              + (" (compile included)" if cfg.compile else ""), flush=True)
                loss_total = loss_sum if loss_total is None else loss_total + loss_sum
                state["tokens"] += n_tokens
                state["update_in_epoch"] = u + 1
                interval_tokens += n_tokens
                session_updates += 1
                last_update = u + 1 == data.updates_per_epoch
                if trainer.step % cfg.log_interval == 0 or last_update:
                    loss_value = all_reduce_sum(loss_total.detach().clone(), world_size).item() / interval_tokens
                    now = time.time()
                    rate = interval_tokens / (now - interval_start)
                    state["interval_tokens_per_second"].append(rate)
                    if main_process:
                        mfu = env.mfu(flops, rate / world_size, gpu_name)
                        mfu = f"{100 * mfu:.1f}%" if mfu else "n/a"
                        eta = (total_updates - trainer.step) * cfg.tokens_per_update / rate
                        print(f"update {trainer.step}/{total_updates} | epoch {epoch + 1} | loss {loss_value:.4f} | "
                              f"grad norm {grad_norm.item():.3f} | lr {trainer.lr_at(trainer.step - 1):.2e} | "
                              f"{rate / 1e3:,.1f}K tok/s | MFU {mfu} | ETA {format_seconds(eta)}", flush=True)
                    interval_start, interval_tokens, loss_total = now, 0, None
                signalled = stop.signal is not None
                if world_size > 1:
                    # Every rank must stop at the same update, so they agree on a signal; only where the
                    # log line syncs anyway, never with a host sync on every update.
                    signalled = False
                    if trainer.step % cfg.log_interval == 0 or last_update:
                        flag = torch.tensor([float(stop.signal is not None)], device=device)
                        signalled = all_reduce_sum(flag, world_size).item() > 0
                stop_now = signalled or bool(cfg.stop_after_updates and session_updates >= cfg.stop_after_updates)
                timed_checkpoint = cfg.checkpoint_minutes and time.time() - last_checkpoint > 60 * cfg.checkpoint_minutes
                if stop_now or timed_checkpoint or last_update:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    segment = time.time() - segment_start
                    state["training_seconds"] += segment
                    state["training_elapsed_seconds"] += segment
                    pause_start = time.time()
                    if last_update:
                        state["epoch"] += 1
                        state["update_in_epoch"] = 0
                        result = evaluate(cfg.val_subset_tokens)
                        point = {"epoch": state["epoch"], "tokens": state["tokens"], "loss": result["loss"],
                                 "seconds": time.time() - pause_start,
                                 "training_seconds": state["training_seconds"]}
                        state["validation_curve"].append(point)
                        if state["best_subset_loss"] is None or result["loss"] < state["best_subset_loss"]:
                            state["best_subset_loss"], state["best_epoch"] = result["loss"], state["epoch"]
                        if main_process:
                            print(f"epoch {state['epoch']}: validation-subset loss {result['loss']:.4f} "
                                  f"over {result['tokens']:,} tokens")
                    if stop_now:
                        status = "interrupted"
                        if main_process:
                            reason = (f"signal {signal.Signals(stop.signal).name}" if stop.signal is not None
                                      else f"stop_after_updates={cfg.stop_after_updates}"
                                      if cfg.stop_after_updates else "stop on another process")
                            print(f"{reason}: checkpointed at update {trainer.step}; resume with --resume=True",
                                  flush=True)
                    checkpoint()
                    last_checkpoint = time.time()
                    record(status)
                    paused = time.time() - pause_start
                    state["training_elapsed_seconds"] += paused
                    interval_start += paused  # a mid-interval checkpoint is not training time
                    segment_start = time.time()
                    if stop_now:
                        break
        if status == "running":
            if cfg.full_validation:
                start = time.time()
                result = evaluate(0)
                result.update(perplexity=math.exp(result["loss"]), seconds=time.time() - start, split="full",
                              validation_complete=True, tokens_per_second=result["tokens"] / (time.time() - start))
                state["final_validation"] = result
                if main_process:
                    print(f"full validation: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, "
                          f"{result['tokens']:,} tokens in {result['seconds']:.1f} s")
            status = "complete"
            checkpoint()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = "failed"
            state["error"] = f"{type(exc).__name__}: {exc}"
        result = entry(status)
        if main_process:
            env.record(cfg.results_file, [cfg.name], dict(result, error=state.get("error")))
        raise
    finally:
        stop.restore()
    result = entry(status)
    if main_process:
        env.record(cfg.results_file, [cfg.name], result)
        usage = env.allocation_usage()
        if usage:
            env.record(cfg.results_file, ["allocation-usage"], usage)
        print_summary(result)
    return result


def print_summary(r):
    fv = r["final_validation"] or {}
    rows = [("status", r["status"]), ("updates", f"{r['step']}/{r['total_updates']}"), ("tokens", f"{r['tokens']:,}"),
            ("best subset loss", f"{r['best_subset_loss']:.4f} (epoch {r['best_epoch']})" if r["best_subset_loss"] else "-"),
            ("final validation", f"{fv['loss']:.4f} (ppl {fv['perplexity']:.2f})" if fv else "-"),
            ("training tokens/s", f"{r['training_tokens_per_second']:,.0f}" if r["training_tokens_per_second"] else "-"),
            ("training seconds", f"{r['training_seconds']:.1f} of {r['training_elapsed_seconds']:.1f} elapsed"),
            ("MFU", f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"),
            ("peak memory", f"{r['peak_memory_bytes'] / 2**30:.2f} GiB")]
    print("\n".join(f"{k:>20}: {v}" for k, v in rows))


def main(argv):
    try:
        cfg = Config(env.load_config(DEFAULTS, argv))
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
