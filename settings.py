"""The settings, declared once: every key train.py takes, with its type, default, one line of help, its role and
its rules. bench.py, tune.py, compare.py and sample.py subclass TrainSettings with their own keys.

From the declaration come `--help`, the type checks (configurator.py reads config files and --key=value), the
checks of each value and of the combinations (check(), before any work; the model and the trainer trust what it
passed), the recipe identity (recipe(): the keys whose role is the recipe or the model's shape) and the execution
keys that compare.py and tune.py may vary.

A role says what a key changes:
  recipe     the math of the run: in the recipe identity, so a resume or a matched comparison refuses a change
  model      the model's shape: in the recipe as the resolved model config (dim=0, the preset's, is dim=320)
  weights    init_from: in the recipe as the hash of the weights it names, not as its path
  execution  how the math runs, never what it is (compare.py and tune.py vary these)
A recipe key declared `later=True` was added after runs were recorded: it enters the recipe only off its
default, so those runs keep their identities (and stay resumable and comparable).
"""
import dataclasses
import math
import os

import torch

import model as model_lib
from configurator import ConfigError
from kernels import registry
from optim import MUON_ADJUST, OPTIMIZERS, SCHEDULES

RECIPE, MODEL, WEIGHTS, EXECUTION = "recipe", "model", "weights", "execution"

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
DEVICES = ("cuda", "cpu", "auto")
MODEL_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size")  # 0: the preset's (the data's)
# Sections of the results file that are not runs: a run may not take their names.
RESERVED_NAMES = {"environment", "benchmarks", "tuning", "profiles", "history", "matched-comparison",
                  "partial-probe", "trained-parity", "allocation-usage", "loss-microbench", "accumulation-check",
                  "ceilings", "time-to-target", "mlp-microbench"}


def setting(default, help, role=EXECUTION, *, choices=None, bounds=None, later=False, rule=None):
    """One declared key. bounds: "> 0", ">= 0", ">= 1", "[0, 1)", "(0, 1]" or "[0, 1]"; every float must also be
    finite. rule(value) returns why a value is refused (None when it is fine), for a rule that is none of these."""
    return dataclasses.field(default=default, metadata=dict(help=help, role=role, choices=choices, bounds=bounds,
                                                            later=later, rule=rule))


def run_name_problem(name):
    if not name or "/" in name or name in (".", ".."):
        return f"name {name!r} cannot name a run's folder and results entry; give a name without '/'"
    if name in RESERVED_NAMES:
        return f"name {name!r} is a section of the results file; choose another --name"
    return None


@dataclasses.dataclass
class TrainSettings:
    # run
    name: str = setting("run", "entry name in the results file; checkpoints go to out/<name>", rule=run_name_problem)
    out_dir: str = setting("", '"" means out/<name>')
    results_file: str = setting("results.json", "the JSON results file every script appends to")
    resume: bool = setting(False, "continue from out_dir/ckpt.pt (refused if the recipe differs)")
    overwrite: bool = setting(False, "start afresh over an existing out_dir/ckpt.pt (else a rerun of a name is refused)")
    init_from: str = setting("", "start from these weights: a transformers Llama folder, or a train.py checkpoint "
                                 "(ckpt.pt or its run folder); the model's shape is taken from them", WEIGHTS)
    # model: a preset, any field overridable (0 keeps the preset's value)
    preset: str = setting("20m", "the model preset (python model.py lists them)", MODEL,
                          choices=tuple(model_lib.PRESETS))
    vocab_size: int = setting(0, "0: the tokenizer's vocabulary, from the data cache", MODEL, bounds=">= 0")
    dim: int = setting(0, "model width (0: the preset's)", MODEL, bounds=">= 0")
    n_layers: int = setting(0, "blocks (0: the preset's)", MODEL, bounds=">= 0")
    n_heads: int = setting(0, "attention heads (0: the preset's)", MODEL, bounds=">= 0")
    hidden_dim: int = setting(0, "SwiGLU hidden width (0: the preset's)", MODEL, bounds=">= 0")
    seq_len: int = setting(1024, "context length of training sequences (the model's max_seq_len)", MODEL,
                           bounds="> 0")
    # data
    data_dir: str = setting("data/cache/gutenberg", "the token cache (data/prepare.py makes it)")
    train_subset_tokens: int = setting(10_000_000, "an epoch is the first N tokens of train.bin (0: all)", RECIPE,
                                       bounds=">= 0")
    val_subset_tokens: int = setting(262_144, "the validation-subset loss uses the first N val tokens (0: all)",
                                     RECIPE, bounds=">= 0", rule=lambda v: (
                                         "val_subset_tokens 1 holds no target (the first token is only an input); "
                                         "give 0 (all) or at least 2") if v == 1 else None)
    full_validation: bool = setting(True, "a full validation pass at the end", RECIPE)
    # recipe
    seed: int = setting(1337, "initial weights and data order", RECIPE, bounds=">= 0")
    epochs: int = setting(10, "passes over the training subset (0 only with init_from: evaluate those weights)",
                          RECIPE, bounds=">= 0")
    tokens_per_update: int = setting(32_768, "tokens of one optimizer update (a multiple of seq_len)", RECIPE,
                                     bounds="> 0")
    learning_rate: float = setting(2e-3, "AdamW's peak learning rate", RECIPE, bounds="> 0")
    min_lr: float = setting(2e-4, "the schedule's floor (wsd reaches it at the last update, cosine one after)", RECIPE,
                            bounds=">= 0")
    warmup_updates: int = setting(100, "linear warmup to the peak learning rate", RECIPE, bounds=">= 0")
    weight_decay: float = setting(0.1, "decoupled weight decay of the 2-D weights", RECIPE, bounds=">= 0")
    beta1: float = setting(0.9, "AdamW's beta1", RECIPE, bounds="[0, 1)")
    beta2: float = setting(0.95, "AdamW's beta2", RECIPE, bounds="[0, 1)")
    adam_eps: float = setting(1e-8, "AdamW's epsilon", RECIPE, bounds="> 0")
    grad_clip: float = setting(1.0, "clip the gradient's global norm to this (0: no clipping; the norm is still "
                                    "logged)", RECIPE, bounds=">= 0")
    residual_dtype: str = setting("float32", "float32, or bfloat16: a declared change of math (compare.py "
                                             "--allow_recipe_change)", RECIPE, choices=tuple(model_lib.RESIDUAL_DTYPES),
                                  later=True)
    lm_head_fp8: bool = setting(False, "the LM head's matmuls in FP8 (loss_impl fused, Hopper or newer): declared, "
                                       "as above", RECIPE, later=True)
    optimizer: str = setting("adamw", "adamw; or muon: Muon on the blocks' 2-D weights, AdamW on the embedding and "
                                      "the norms", RECIPE, choices=OPTIMIZERS, later=True)
    muon_lr: float = setting(0.02, "Muon's peak learning rate (scaled by the schedule as learning_rate is)", RECIPE,
                             bounds="> 0", later=True)
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)", RECIPE, bounds="[0, 1)", later=True)
    muon_ns_steps: int = setting(5, "Newton-Schulz iterations of Muon's orthogonalization", RECIPE, bounds=">= 1",
                                 later=True)
    muon_adjust_lr: str = setting("original", "torch.optim.Muon's adjust_lr_fn: original (sqrt(max(1, rows/cols))) "
                                              "or match_rms_adamw (0.2 sqrt(max(rows, cols)))", RECIPE,
                                  choices=MUON_ADJUST, later=True)
    lr_schedule: str = setting("cosine", "cosine: warmup, then cosine decay to min_lr; wsd: warmup, stable, then "
                                         "a linear cooldown to min_lr", RECIPE, choices=SCHEDULES, later=True)
    cooldown_fraction: float = setting(0.2, "wsd: the share of the updates that decay to min_lr", RECIPE,
                                       bounds="[0, 1]", later=True)
    # execution: how the math is run, never what it is
    device: str = setting("cuda", "cuda, cpu, or auto (a GPU if there is one); the CPU only when asked for",
                          choices=DEVICES)
    micro_batch_size: int = setting(8, "sequences per forward pass; an update accumulates the rest", bounds=">= 1")
    compile: bool = setting(False, "torch.compile the model")
    compile_mode: str = setting("default", "torch.compile's mode", choices=COMPILE_MODES)
    compile_scope: str = setting("model", "model: one graph; blocks: each block and the loss head apart (compiles "
                                          "once for all the identical blocks, so a much shorter cold start)",
                                 choices=COMPILE_SCOPES)
    attention_backend: str = setting("auto", registry.ATTENTION.help, choices=registry.ATTENTION)
    loss_impl: str = setting("full", registry.LOSS.help, choices=registry.LOSS)
    loss_chunk_tokens: int = setting(8192, "tokens per slice of the fused and quack_chunked losses", bounds="> 0")
    mlp_impl: str = setting("torch", registry.MLP.help, choices=registry.MLP)
    update_graph: bool = setting(False, "compiled only: the gradient clip and the optimizer step compiled too, in "
                                        "the model's compile mode (with reduce-overhead, CUDA graphs); AdamW then "
                                        "runs its capturable foreach form with the learning rate a device tensor: "
                                        "the same update, other kernels")
    activation_memory_budget: float = setting(1.0, "compiled only: the share of the compiler's activation memory to "
                                                   "keep; below 1 it recomputes cheap ops in backward", bounds="(0, 1]")
    cpu_threads: int = setting(0, "0: PyTorch's default", bounds=">= 0")
    ddp_bucket_mb: int = setting(100, "DistributedDataParallel gradient bucket, MB (100 measured +1.9% over 25)",
                                 bounds="> 0")
    eval_batch_size: int = setting(32, "sequences per validation batch", bounds="> 0")
    eval_interval: int = setting(0, "updates between validation-subset evaluations (0: once per epoch, at its end)",
                                 bounds=">= 0")
    target_loss: float = setting(0.0, "record when the validation-subset loss first reaches this (0: no target)",
                                 bounds=">= 0")
    stop_at_target: bool = setting(False, "end the run, checkpointed, when target_loss is reached")
    log_interval: int = setting(50, "updates between log lines", bounds="> 0")
    checkpoint_minutes: float = setting(0.0, "also checkpoint every N minutes (0: only at epoch ends and on signals)",
                                        bounds=">= 0")
    tensorboard_dir: str = setting("", "also log the curves to TensorBoard in this folder (pip install tensorboard)")
    wandb_log: bool = setting(False, "also log them to Weights & Biases, offline (pip install wandb)")
    wandb_project: str = setting("tiny-llm", "the Weights & Biases project")
    stop_after_updates: int = setting(0, "stop (checkpointed) after N updates of this process, as a scheduler's "
                                         "time limit would", bounds=">= 0")

    @staticmethod
    def rules(cfg):
        """The combinations of train.py's keys, each a ConfigError."""
        if cfg.min_lr > cfg.learning_rate:
            raise ConfigError(f"min_lr {cfg.min_lr} is above learning_rate {cfg.learning_rate}; the schedule "
                              f"decays from learning_rate to min_lr")
        if cfg.tokens_per_update % cfg.seq_len:
            raise ConfigError(f"tokens_per_update {cfg.tokens_per_update} is not a multiple of seq_len "
                              f"{cfg.seq_len}; an update is a whole number of sequences")
        if cfg.epochs == 0 and not cfg.init_from:
            raise ConfigError("epochs 0 trains nothing and would record random weights as a complete run; give at "
                              "least 1 (or init_from, to evaluate those weights)")
        muon_keys = [k for k in ("muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr")
                     if cfg[k] != field_of(TrainSettings, k).default]
        if muon_keys and cfg.optimizer != "muon":
            raise ConfigError(f"{', '.join(muon_keys)} set but optimizer is {cfg.optimizer!r}; set optimizer=muon "
                              f"or leave the muon_ keys at their defaults")
        if cfg.lr_schedule != "wsd" and cfg.cooldown_fraction != field_of(TrainSettings, "cooldown_fraction").default:
            raise ConfigError(f"cooldown_fraction {cfg.cooldown_fraction} is wsd's and lr_schedule is "
                              f"{cfg.lr_schedule!r}, which would ignore it; set lr_schedule=wsd or leave "
                              f"cooldown_fraction at its default")
        if cfg.update_graph and not cfg.compile:
            raise ConfigError("update_graph compiles the clip and the optimizer step with the model; set compile=True "
                              "(or leave update_graph off)")
        if cfg.stop_at_target and not cfg.target_loss:
            raise ConfigError("stop_at_target needs a target: set target_loss (the validation-subset loss to reach)")
        problem = registry.problem(cfg)  # the execution choices' (and the FP8 head's) rules on these numbers
        if problem:
            raise ConfigError(problem)


# ---------------------------------------------------------------- the declaration, read

class Config(dict):
    """A resolved configuration: the keys of a settings class with their values; keys read as attributes."""
    __getattr__ = dict.__getitem__


def fields(cls):
    return {f.name: f for f in dataclasses.fields(cls)}


def field_of(cls, key):
    return fields(cls)[key]


def defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls)}


def keys_of_role(role, cls=TrainSettings):
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("role") == role}


def execution_keys():
    """train.py's keys that change only how the math runs: what compare.py and tune.py may vary."""
    return keys_of_role(EXECUTION)


def recipe(cfg, mcfg, cache_identity, init_weights=None, cls=TrainSettings):
    """Everything that changes the math of a run, and nothing that only changes its execution: the recipe keys
    (a later one only off its default), the resolved model config, the data's identity and the initial weights'
    hash (only when given, so that every run without them keeps the identity it has always had)."""
    fields_ = {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.metadata["role"] == RECIPE
               and not (f.metadata["later"] and cfg[f.name] == f.default)}
    fields_.update(model=mcfg.to_dict(), cache_identity=cache_identity)
    if init_weights:
        fields_["init_weights"] = init_weights
    return fields_


def recipe_differences(old, new):
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


# ---------------------------------------------------------------- the model's shape

def model_config(cfg, vocab):
    """The model's shape: the preset with the config's overrides; a bad one is a ConfigError."""
    overrides = {k: cfg[k] for k in MODEL_SHAPE_KEYS[:-1] if cfg[k]}
    try:
        return model_lib.get_preset(cfg.preset, vocab_size=cfg.vocab_size or vocab, max_seq_len=cfg.seq_len,
                                    **overrides)
    except ValueError as exc:  # width not divisible by heads, ...
        raise ConfigError(str(exc)) from None


def initial_model_config(cfg, initial):
    """With init_from, the model's shape is the weights' own; a shape key that contradicts it is refused."""
    mcfg = dataclasses.replace(initial.config, max_seq_len=cfg.seq_len)  # rotary tables are not weights
    contradicted = [f"{k}={cfg[k]} (the weights have {getattr(mcfg, k)})" for k in MODEL_SHAPE_KEYS
                    if cfg[k] and cfg[k] != getattr(mcfg, k)]
    if contradicted:
        raise ConfigError(f"init_from {cfg.init_from} fixes the model's shape, which the settings contradict: "
                          f"{', '.join(contradicted)}; leave them at 0 or match the weights")
    return mcfg


# ---------------------------------------------------------------- the checks

def bounds_problem(key, value, bounds):
    if bounds in ("> 0", ">= 0", ">= 1"):
        low, strict = float(bounds.split()[-1]), bounds.startswith("> ")
        if value < low or (strict and value == low):
            wanted = "positive" if bounds == "> 0" else "0 or more" if bounds == ">= 0" else f"at least {low:g}"
            return f"{key} must be {wanted}, got {value}"
        return None
    low, high = (float(x) for x in bounds[1:-1].split(","))
    below = value < low or (bounds[0] == "(" and value == low)
    above = value > high or (bounds[-1] == ")" and value == high)
    return f"{key} must lie in {bounds}, got {value}" if below or above else None


def check_value(key, value, field):
    """A declared key's own rules: finite, its choices, its bounds, its rule."""
    meta = field.metadata
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key} must be a finite number, got {value}"
    if meta.get("choices") and value not in meta["choices"]:
        return f"{key} {value!r} is not one of {', '.join(meta['choices'])}"
    if meta.get("bounds"):
        problem = bounds_problem(key, value, meta["bounds"])
        if problem:
            return problem
    return meta["rule"](value) if meta.get("rule") else None


def check(cls, cfg):
    """Every key's own rules, then each settings class's combinations (TrainSettings' first): a ConfigError
    before any work."""
    for key, field in fields(cls).items():
        problem = check_value(key, cfg[key], field)
        if problem:
            raise ConfigError(problem)
    for klass in reversed(cls.__mro__):
        if "rules" in vars(klass):
            klass.rules(cfg)


def sequences_per_update(cfg, world_size=1):
    """The sequences of one update; a micro-batch that does not divide them on world_size processes is a
    ConfigError listing the sizes that do."""
    sequences = cfg.tokens_per_update // cfg.seq_len
    if sequences % (cfg.micro_batch_size * world_size):
        valid = [m for m in range(1, sequences + 1) if sequences % (m * world_size) == 0]
        raise ConfigError(
            f"micro_batch_size {cfg.micro_batch_size} on {world_size} process(es) does not divide the "
            f"{sequences} sequences of an update (tokens_per_update / seq_len); valid sizes: {valid}")
    return sequences


def check_device(cfg, device):
    """What the machine decides: each execution choice (and the FP8 head) where it cannot run, in one line
    (kernels/registry.py). device: the torch.device the run will use. Returns the attention backend that runs here
    and why (kernels.attention.resolve_backend)."""
    from kernels.attention import resolve_backend
    problem = registry.problem(cfg, device)
    if problem:
        raise ConfigError(problem)
    return resolve_backend(cfg.attention_backend, device)


def resolve_device(cfg, local_rank=None):
    """"cpu" or "cuda"; given this process's local rank, its own GPU ("cuda:N"), made the current one."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("this config trains on a GPU (device 'cuda') and PyTorch sees none; pass --device=cpu to "
                          "run it on the CPU anyway (config/tiny_cpu.py is the model sized for one)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and local_rank is not None:
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return device


def doubtful_values(cfg, total_updates):
    """Legal values that are probably not what was meant: one line each, training goes on."""
    lines = []
    if cfg.warmup_updates >= total_updates > 0:
        lines.append(f"warmup_updates {cfg.warmup_updates} is not shorter than the run's {total_updates} updates: "
                     f"the learning rate never reaches its peak {cfg.learning_rate}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cfg.cpu_threads > cores:
        lines.append(f"cpu_threads {cfg.cpu_threads} is more than the {cores} cores this process may use; the "
                     f"extra threads only contend")
    return lines


def resolve(cls, argv):
    """Read a script's settings: defaults <- config files <- --key=value, then every check: a Config."""
    from configurator import load_config
    cfg = Config(load_config(cls, argv))
    check(cls, cfg)
    return cfg
