"""A run's plan: checked settings in, a frozen record of the run to make out. Every check runs here, once, in one
order (the settings' values and combinations, the processes, the device and what it can run, the results file, the
data cache, the initial weights, the model's shape), so that a refused run has done no work and left nothing behind.
train.py, bench.py, tune.py, compare.py and sample.py take the record it returns."""
import dataclasses
import tempfile
from pathlib import Path

import torch

import checkpoint
import compile_cache
import env
import model as model_lib
import settings
from configurator import ConfigError
from data.loader import CacheError, TokenCache, TrainData
from distributed import distributed
from model_kernels import first_calls, registry
from results import ResultsFileError, check_writable, real_path

USER_ERRORS = (ConfigError, ResultsFileError, CacheError, checkpoint.CheckpointError)  # one line, never a traceback
EXIT_INTERRUPTED = 3  # train.py's exit status for a run stopped by a signal or stop_after_updates, checkpointed
EXIT_DIVERGED = 4     # train.py's exit status for a run whose loss is not a finite number
SYNTHETIC_VOCAB = 32000  # bench.py's synthetic tokens without a cache: the Llama tokenizer's vocabulary


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run to make, resolved: what every script needs to build it, and nothing it must work out again."""
    cfg: settings.Config            # the settings, checked
    rank: int
    local_rank: int
    world_size: int
    device: str                     # "cpu", "cuda" or, under torchrun, this process's "cuda:N"
    attention: str                  # the attention backend that runs here ("auto" resolved)
    attention_reason: str           # why that one
    cache: TokenCache | None        # None: bench.py's synthetic data
    model: model_lib.ModelConfig
    initial: checkpoint.InitialWeights | None
    recipe: dict                    # everything that changes the math (settings.recipe)
    recipe_id: str
    sequences_per_update: int
    micro_steps: int                # on each process
    context_steps: tuple = ()       # seq_len_schedule's ((context, until), ...)

    @property
    def main_process(self):
        return self.rank == 0


def resolve(cfg, cls=settings.TrainSettings, world=None, synthetic=False, prestart=False):
    """The plan of a run of cfg (a Config of cls's keys). world: (rank, local_rank, world_size), by default this
    process's (torchrun's); compare.py passes one process for the runs it checks before training them. synthetic:
    random tokens in place of the cache (bench.py's data_mode=synthetic). prestart, for a process that goes on to
    train: once the device is known, start what a cold first update would wait for (first_calls.prestart), so that
    it readies while the checks import the attention's package and the data and the model are made."""
    settings.check(cls, cfg)
    rank, local_rank, world_size = world or distributed(cfg.get("device"))
    sequences = settings.sequences_per_update(cfg, world_size)
    device = resolve_device(cfg, local_rank if world is None else None)
    if prestart:
        first_calls.prestart(cfg, torch.device(device), env.compiler_cache_state()[1])
    attention, reason = check_device(cfg, torch.device(device))
    if "results_file" in cfg:
        check_writable(cfg.results_file)
    check_compile_cache(cfg)
    cache = None if synthetic else open_cache(cfg)
    initial = load_initial_weights(cfg)
    mcfg = model_of(cfg, cache, initial)
    if cache and "eval_interval" in cfg:  # a run that validates (train.py's lifecycle)
        check_validation(cfg, cache)
    rec = settings.recipe(cfg, mcfg, cache.identity if cache else None, initial.sha256 if initial else None)
    return Plan(cfg, rank, local_rank, world_size, device, attention, reason, cache, mcfg, initial, rec,
                env.hash_json(rec), sequences, settings.micro_steps(cfg, world_size),
                settings.schedule_steps(cfg.seq_len_schedule))


# ---------------------------------------------------------------- the device

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


def check_device(cfg, device):
    """What the machine decides: each execution choice (and the FP8 head) where it cannot run
    (model_kernels/registry.py), and the profiler without a GPU. device: the torch.device the run will use. Returns (attention backend, why)."""
    from model_kernels.attention import resolve_backend
    problem = registry.problem(cfg, device)
    if problem:
        raise ConfigError(problem)
    if cfg.get("profile") and device.type != "cuda":
        raise ConfigError("profile records GPU kernel time, and this runs on the CPU (where it would record CPU "
                          "operator time as kernel_ms); profile on a GPU, or drop profile")
    return resolve_backend(cfg.attention_backend, device)


def check_compile_cache(cfg):
    """A compile_cache path that holds another kind of file (it is never written over), or in a folder this process
    cannot write (the file is written after the first update), is refused before any work."""
    if cfg.get("compile_cache"):
        try:
            compile_cache.check_path(cfg.compile_cache)
            parent = real_path(cfg.compile_cache).parent  # made at the save; probed here where it starts to exist,
            folder = next(p for p in [parent, *parent.parents] if p.exists())  # so a refused run leaves no folder
            if not folder.is_dir():
                raise NotADirectoryError(20, "a file stands where its folder would be")
            tempfile.TemporaryFile(dir=folder).close()
        except compile_cache.CompileCacheError as exc:
            raise ConfigError(str(exc)) from None
        except OSError as exc:
            raise ConfigError(f"compile_cache {cfg.compile_cache} cannot be written there ({exc.strerror or exc}); "
                              f"give a path in a folder this user can write") from None


# ---------------------------------------------------------------- the data, the weights and the model

def open_cache(cfg):
    """The verified token cache of data_dir."""
    try:
        return TokenCache(cfg.data_dir, vocab_size=cfg.vocab_size)
    except CacheError as exc:
        raise ConfigError(str(exc)) from None


def load_initial_weights(cfg):
    """init_from's weights (None without it); a path that holds none, or a model outside the family, is a
    ConfigError."""
    if not cfg.get("init_from"):
        return None
    try:
        return checkpoint.initial_weights(cfg.init_from)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_config(cfg, vocab):
    """The model's shape: the preset with the config's overrides and architecture levers (a script's settings
    without the levers build them off); a bad one is a ConfigError."""
    overrides = {k: cfg[k] for k in settings.MODEL_SHAPE_KEYS[:-1] if cfg[k]}
    levers = {k: cfg[k] for k in model_lib.LEVERS if k in cfg}
    try:
        return model_lib.get_preset(cfg.preset, vocab_size=cfg.vocab_size or vocab, max_seq_len=cfg.seq_len,
                                    **overrides, **levers)
    except ValueError as exc:  # width not divisible by heads, more value embeddings than blocks allow, ...
        raise ConfigError(str(exc)) from None


def check_shape(cfg):
    """Before any work (bench.py's presets, each before the first is measured): the model cfg builds over the data's
    vocabulary (synthetic_vocab's: a look at the cache's meta.json), and whether the configured kernels take it."""
    problem = registry.problem(cfg, model_config=model_config(cfg, synthetic_vocab(cfg)))
    if problem:
        raise ConfigError(problem)


def initial_model_config(cfg, initial):
    """With init_from, the model's shape and architecture levers are the weights' own; a shape key, or a lever set
    off its default, that contradicts them is refused."""
    mcfg = dataclasses.replace(initial.config, max_seq_len=cfg.seq_len)  # rotary tables are not weights
    contradicted = [f"{k}={cfg[k]} (the weights have {getattr(mcfg, k)})" for k in settings.MODEL_SHAPE_KEYS
                    if cfg[k] and cfg[k] != getattr(mcfg, k)]
    contradicted += [f"{k}={cfg[k]} (the weights' model has {getattr(mcfg, k)})" for k, off in model_lib.LEVERS.items()
                     if k in cfg and cfg[k] != off and cfg[k] != getattr(mcfg, k)]
    if cfg.preset != settings.field_of(settings.ModelShape, "preset").default:  # asked for: its shape, where no key is
        preset = model_lib.get_preset(cfg.preset, vocab_size=mcfg.vocab_size)
        contradicted += [f"preset={cfg.preset}'s {k} {getattr(preset, k)} (the weights have {getattr(mcfg, k)})"
                         for k in settings.MODEL_SHAPE_KEYS[:-1]
                         if not cfg[k] and getattr(preset, k) != getattr(mcfg, k)]
    if contradicted:
        raise ConfigError(f"init_from {cfg.init_from} fixes the model's shape, which the settings contradict: "
                          f"{', '.join(contradicted)}; leave them at 0 (the levers off) or match the weights")
    return mcfg


def synthetic_vocab(cfg):
    """The vocabulary of bench.py's synthetic tokens: a cache's at data_dir when there is one, else the Llama
    tokenizer's."""
    try:
        return TokenCache(cfg.data_dir, verify=False).vocab_size
    except CacheError:
        return SYNTHETIC_VOCAB


def model_of(cfg, cache, initial):
    """The model config: the initial weights' shape, or the preset's over the data's vocabulary; a vocabulary that
    does not fit the data, or a shape a kernel cannot take, is refused."""
    if cache:
        mismatch = checkpoint.cache_mismatch(initial, cache)  # weights of another tokenizer's token ids
        if mismatch:
            raise ConfigError(mismatch)
    vocab = cache.vocab_size if cache else synthetic_vocab(cfg)
    mcfg = initial_model_config(cfg, initial) if initial else model_config(cfg, vocab)
    if cache and cache.vocab_size > mcfg.vocab_size:
        fix = ("start from a model of this tokenizer" if initial
               else f"set vocab_size=0 (follow the data) or at least {cache.vocab_size}")
        raise ConfigError(f"the data's tokenizer has {cache.vocab_size} tokens but the model's vocabulary "
                          f"holds {mcfg.vocab_size}; {fix}")
    if cache and cfg.vocab_size > cache.vocab_size and not initial:
        raise ConfigError(f"vocab_size {cfg.vocab_size} is larger than the {cache.vocab_size} tokens of the cache "
                          f"{cfg.data_dir}: the LM head would hold rows no token uses; set vocab_size=0 (follow the "
                          f"data) or {cache.vocab_size}, or prepare a cache of that vocabulary")
    problem = registry.problem(cfg, model_config=mcfg)  # a shape the configured kernels do not take
    if problem:
        raise ConfigError(problem)
    return mcfg


def check_validation(cfg, cache):
    """A validation subset that fits in the validation split (as the training subset must fit in its own)."""
    available = len(cache.val)
    if cfg.val_subset_tokens > available:
        raise ConfigError(f"val_subset_tokens {cfg.val_subset_tokens:,} exceeds the {available:,} validation tokens "
                          f"of the cache; use at most that, or 0 for all of them")


# ---------------------------------------------------------------- what a run reads and writes

def training_data(plan):
    """The fixed training subset of the cache, cut into the run's updates over its epochs, with its context schedule
    (train.py trains it, bench.py times it)."""
    cfg = plan.cfg
    return TrainData(plan.cache.train, cfg.seq_len, plan.sequences_per_update, cfg.seed, cfg.train_subset_tokens,
                     cfg.epochs, plan.context_steps, cfg.get("context_windows", False))


def run_dir(cfg):
    """Where a run's checkpoint lives: out_dir, or out/<name>."""
    return Path(cfg.out_dir or f"out/{cfg.name}")
