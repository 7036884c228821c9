"""The settings, declared once and grouped by role: each key with its type, default, one line of help, its role and
its own rules; the combinations of keys, each checked once; and the recipe identity.

Each script composes the groups it uses (`compose`): train.py all of TRAIN_GROUPS, bench.py and tune.py the model,
the recipe and the execution with their protocol, sample.py the few keys it reads. A config file may assign any key
of train.py's (a config file is a recipe); a script takes those it declares and ignores the others, while a
--key=value it does not declare is refused. From the declaration come `--help` (the script's own keys, by group),
the type checks (configurator.py), the checks of each value and of the combinations (check(), before any work;
what the machine and the data decide is plan.py's), and the recipe identity (recipe()).

A role says what a key changes:
  recipe     the math of the run: in the recipe identity, so a resume or a matched comparison refuses a change
  model      the model's shape: in the recipe as the resolved model config (dim=0, the preset's, is dim=320)
  weights    init_from: in the recipe as the hash of the weights it names, not as its path
  execution  how the math runs, never what it is (compare.py and tune.py vary these)
  run        where a run reads and writes, and when it validates, logs, checkpoints and stops
"""
import dataclasses
import math
import os

import model as model_lib
from configurator import ConfigError
from model_kernels import registry
from optim import MAX_NS_STEPS, MUON_ADJUST, OPTIMIZERS, SCHEDULES
from results import SECTIONS

RECIPE, MODEL, WEIGHTS, EXECUTION, RUN = "recipe", "model", "weights", "execution", "run"

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks")
DEVICES = ("cuda", "cpu", "auto")
MODEL_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size")  # 0: the preset's (the data's)
# The recipe keys the identity hashes at any value. Every other recipe key enters it only off its default, so that
# declaring a new key never changes the identity of a run recorded without it (nor its resume or comparison).
IDENTITY_KEYS = frozenset({"train_subset_tokens", "val_subset_tokens", "full_validation", "seed", "epochs",
                           "tokens_per_update", "learning_rate", "min_lr", "warmup_updates", "weight_decay", "beta1",
                           "beta2", "adam_eps", "grad_clip"})


def setting(default, help, role=EXECUTION, *, choices=None, bounds=None, rule=None):
    """One declared key. bounds: "> 0", ">= 0", ">= 1", "[0, 1)", "(0, 1]" or "[0, 1]"; every float must also be
    finite. rule(value) returns why a value is refused (None when it is fine), for a rule that is none of these."""
    return dataclasses.field(default=default, metadata=dict(help=help, role=role, choices=choices, bounds=bounds,
                                                            rule=rule))


def run_name_problem(name):
    if not name or "/" in name or name in (".", ".."):
        return f"name {name!r} cannot name a run's folder and results entry; give a name without '/'"
    if name in SECTIONS:
        return f"name {name!r} is a section of the results file; choose another --name"
    return None


def one_val_token(v):
    return ("val_subset_tokens 1 holds no target (the first token is only an input); give 0 (all) or at least 2"
            if v == 1 else None)


# The sequence-length schedule's most steps: each context is another shape, which compiles once (a recompile under
# torch.compile's dynamic=False); a few keep the run's shapes few and within torch._dynamo's recompile limit.
MAX_CONTEXT_STEPS = 4


def schedule_steps(text):
    """A data schedule's steps, ((value, until), ...): the value holds while the run's tokens before an update are
    below `until` of all its tokens. "" is no schedule; a malformed one is a ValueError saying why (an empty step
    too: "," or "32:0.5," would be a schedule of no step, or the same as another, under another recipe identity)."""
    steps = []
    for part in (p.strip() for p in text.split(",")) if text else ():
        if not part:
            raise ValueError('it has an empty step (a comma too many, or spaces alone); "" is no schedule')
        value, colon, until = part.partition(":")
        try:
            steps.append((int(value), float(until)))
        except ValueError:
            raise ValueError(f"step {part!r} is not VALUE:UNTIL (a whole number, a colon, a fraction)") from None
    for (value, until), (last_value, last_until) in zip(steps, [(0, 0.0)] + steps):
        if not last_until < until < 1:
            raise ValueError(f"the UNTIL fractions of the run's tokens must grow within (0, 1), got {until:g}"
                             + (f" after {last_until:g}" if last_until else ""))
        if value <= last_value:
            raise ValueError(f"the values must be positive and grow, got {value}"
                             + (f" after {last_value}" if last_value else ""))
    return tuple(steps)


def schedule_rule(key, form, max_steps=None):
    """The rule of a schedule key's own value (its form, growing, and its number of steps)."""
    def rule(text):
        try:
            steps = schedule_steps(text)
        except ValueError as exc:
            return f"{key} {text!r}: {exc} (its steps are {form}, comma-separated)"
        if max_steps and len(steps) > max_steps:
            return (f"{key} {text!r} has {len(steps)} steps; at most {max_steps} (each step's shape compiles "
                    f"apart)")
        return None
    return rule


# ---------------------------------------------------------------- the groups

@dataclasses.dataclass
class Paths:
    """the run's inputs and outputs"""
    name: str = setting("run", "entry name in the results file; checkpoints go to out/<name>", RUN,
                        rule=run_name_problem)
    out_dir: str = setting("", '"" means out/<name>', RUN)
    results_file: str = setting("results.json", "the JSON results file every script appends to", RUN)
    data_dir: str = setting("data/cache/gutenberg", "the token cache (data/prepare.py makes it)", RUN)
    init_from: str = setting("", "start from these weights: a transformers Llama folder, or a train.py checkpoint "
                                 "(ckpt.pt or its run folder); the model's shape is taken from them", WEIGHTS)


@dataclasses.dataclass
class ModelShape:
    """the model: a preset, any field overridable (0 keeps the preset's value)"""
    preset: str = setting("20m", "the model preset (python model.py lists them)", MODEL,
                          choices=tuple(model_lib.PRESETS))
    vocab_size: int = setting(0, "0: the tokenizer's vocabulary, from the data cache", MODEL, bounds=">= 0")
    dim: int = setting(0, "model width (0: the preset's)", MODEL, bounds=">= 0")
    n_layers: int = setting(0, "blocks (0: the preset's)", MODEL, bounds=">= 0")
    n_heads: int = setting(0, "attention heads (0: the preset's)", MODEL, bounds=">= 0")
    hidden_dim: int = setting(0, "SwiGLU hidden width (0: the preset's)", MODEL, bounds=">= 0")
    seq_len: int = setting(1024, "context length of training sequences (the model's max_seq_len)", MODEL,
                           bounds="> 0")


@dataclasses.dataclass
class Recipe:
    """the recipe: what is trained, and how the math goes"""
    train_subset_tokens: int = setting(10_000_000, "an epoch is the first N tokens of the training split (0: all)",
                                       RECIPE, bounds=">= 0")
    val_subset_tokens: int = setting(262_144, "the validation-subset loss uses the first N val tokens (0: all)",
                                     RECIPE, bounds=">= 0", rule=one_val_token)
    full_validation: bool = setting(True, "a full validation pass at the end", RECIPE)
    seed: int = setting(1337, "initial weights and data order", RECIPE, bounds=f"[0, {2 ** 64})")  # torch's range
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
                                             "--allow_recipe_change)", RECIPE, choices=tuple(model_lib.RESIDUAL_DTYPES))
    lm_head_fp8: bool = setting(False, "the LM head's matmuls in FP8 (loss_impl fused, Hopper or newer): declared, "
                                       "as above", RECIPE)
    optimizer: str = setting("adamw", "adamw; or muon: Muon on the blocks' 2-D weights, AdamW on the embedding and "
                                      "the norms", RECIPE, choices=OPTIMIZERS)
    muon_lr: float = setting(0.02, "Muon's peak learning rate (scaled by the schedule as learning_rate is)", RECIPE,
                             bounds="> 0")
    muon_momentum: float = setting(0.95, "Muon's momentum (Nesterov)", RECIPE, bounds="[0, 1)")
    muon_ns_steps: int = setting(5, "Newton-Schulz iterations of Muon's orthogonalization", RECIPE,
                                 bounds=f"[1, {MAX_NS_STEPS})")
    muon_adjust_lr: str = setting("original", "torch.optim.Muon's adjust_lr_fn: original (sqrt(max(1, rows/cols))) "
                                              "or match_rms_adamw (0.2 sqrt(max(rows, cols)))", RECIPE,
                                  choices=MUON_ADJUST)
    lr_schedule: str = setting("cosine", "cosine: warmup, then cosine decay to min_lr; wsd: warmup, stable, then "
                                         "a linear cooldown to min_lr", RECIPE, choices=SCHEDULES)
    cooldown_fraction: float = setting(0.2, "wsd: the share of the updates that decay to min_lr", RECIPE,
                                       bounds="[0, 1]")
    # the optimizer levers (#38), each off by default: two refinements of Muon's update and the weights' average
    normuon: bool = setting(False, "NorMuon: each output neuron's row of Muon's update divided by the root of its "
                                   "second moment, the update's norm kept", RECIPE)
    muon_split_projections: bool = setting(False, "Muon orthogonalizes q, k and v (the fused wqkv) and the SwiGLU "
                                                  "gate and up (w13) each as a matrix of its own, as torch.optim.Muon "
                                                  "does transformers' Llama; off: each fused matrix whole", RECIPE)
    ema: float = setting(0.0, "the weights' exponential moving average with this decay (0: none), debiased: "
                              "validated, evaluated, sampled and exported in place of the trained weights", RECIPE,
                         bounds="[0, 1)")
    # the data schedule (#38): an update's context grows during the run; off ("") by default
    seq_len_schedule: str = setting("", 'shorter contexts first, as CONTEXT:UNTIL steps: "256:0.3,512:0.6" splits '
                                        'each sequence into windows of 256 until 30% of the run\'s tokens, 512 until '
                                        '60%, then seq_len: the same targets, a shorter attention context (contexts '
                                        'divide seq_len; validation keeps seq_len)', RECIPE,
                                    rule=schedule_rule("seq_len_schedule", "CONTEXT:UNTIL", MAX_CONTEXT_STEPS))
    # architecture levers (#38): each off by default, each a field of the model config (model.py says the math)
    qk_norm: bool = setting(False, "RMSNorm over each head's q and k, with a gain per head dimension (Qwen3's), "
                                   "before the rotary embedding", RECIPE)
    value_embeddings: int = setting(0, "k > 0: k more embedding tables, table i added to the values of block i "
                                       "and of block n_layers - k + i (at most n_layers / 2)", RECIPE, bounds=">= 0")


@dataclasses.dataclass
class Execution:
    """execution: how the math is run, never what it is"""
    device: str = setting("cuda", "cuda, cpu, or auto (a GPU if there is one); the CPU only when asked for",
                          choices=DEVICES)
    micro_batch_size: int = setting(8, "sequences per forward pass; an update accumulates the rest", bounds=">= 1")
    compile: bool = setting(False, "torch.compile the model")
    compile_mode: str = setting("default", "torch.compile's mode", choices=COMPILE_MODES)
    warm_kernels: bool = setting(True, "compiled, on a GPU: a child process compiles the kernels that compile at "
                                       "their first call (flash-attn-4's backward, the fused loss) while the model "
                                       "compiles (model_kernels/first_calls.py)")
    warm_compiler: bool = setting(True, "compiled: Inductor's modules imported and the hashes of torch's and "
                                        "Triton's sources that key its caches computed as the run starts, with its "
                                        "other imports, not in its first update (model_kernels/first_calls.py)")
    compile_scope: str = setting("blocks", "blocks: each block and the loss head a graph of its own, compiled once "
                                           "for all blocks (with CUDA graphs, on one GPU, each update then captured "
                                           "whole as one); model: one graph of the whole model, compiled in one piece "
                                           "(docs/COLD_START.md)",
                                 choices=COMPILE_SCOPES)
    compile_cache: str = setting("", "compiled only: a file of the run's compiled code (compile_cache.py), loaded at "
                                     "start when the same code, torch and GPU made it, and written when the run has "
                                     "compiled what it lacks, so another machine starts warm")
    static_launch_user_kernels: bool = setting(True, "compiled, on a GPU: Inductor launches the SwiGLU Triton "
                                                     "kernel from the binary its cache saved, as it launches its "
                                                     "own, so that a warm run or a loaded compile_cache does not "
                                                     "compile it again (docs/COLD_START.md)")
    attention_backend: str = setting("auto", registry.ATTENTION.help, choices=registry.ATTENTION)
    loss_impl: str = setting("full", registry.LOSS.help, choices=registry.LOSS)
    loss_chunk_tokens: int = setting(8192, "tokens per slice of the fused and quack_chunked losses", bounds="> 0")
    mlp_impl: str = setting("torch", registry.MLP.help, choices=registry.MLP)
    update_graph: bool = setting(False, "compiled only: the gradient clip and the optimizer step compiled too, in "
                                        "the model's compile mode (with reduce-overhead, CUDA graphs); AdamW then "
                                        "runs its capturable foreach form with the learning rate a device tensor: "
                                        "the same update, other kernels")
    context_windows: bool = setting(False, "with a seq_len_schedule (without one, no effect): each context's "
                                           "windows kept in the rows of seq_len, positions restarting and attention "
                                           "within each window (flash-attn-4's variable-length kernels), so that "
                                           "every context is one shape, compiled and captured once: the same math")
    activation_memory_budget: float = setting(1.0, "compiled only: the share of the compiler's activation memory to "
                                                   "keep; below 1 it recomputes cheap ops in backward", bounds="(0, 1]")
    cpu_threads: int = setting(0, "0: PyTorch's default; at most 1,024 (thousands crash PyTorch)", bounds="[0, 1024]")
    ddp_bucket_mb: int = setting(100, "DistributedDataParallel gradient bucket, MB (docs/PERFORMANCE.md, levers)",
                                 bounds="> 0")
    eval_batch_size: int = setting(32, "sequences per validation batch", bounds="> 0")


# How a process runs a run, not the run itself: a resume may change them, and a recorded run is the same run
# whatever they were (train.py's resume, compare.py's reuse).
LAUNCH_KEYS = ("resume", "overwrite", "stop_after_updates")


@dataclasses.dataclass
class Lifecycle:
    """the run's lifecycle: resume, validation, target, logs, checkpoints and stops"""
    resume: bool = setting(False, "continue from out_dir/ckpt.pt (refused if the recipe differs)", RUN)
    overwrite: bool = setting(False, "start afresh over an existing out_dir/ckpt.pt (else a rerun of a name is "
                                     "refused)", RUN)
    eval_interval: int = setting(0, "updates between validation-subset evaluations (0: once per epoch, at its end)",
                                 RUN, bounds=">= 0")
    target_loss: float = setting(0.0, "record when the validation-subset loss first reaches this (0: no target)", RUN,
                                 bounds=">= 0")
    stop_at_target: bool = setting(False, "end the run, checkpointed, when target_loss is reached", RUN)
    log_interval: int = setting(50, "updates between log lines", RUN, bounds="> 0")
    checkpoint_minutes: float = setting(0.0, "also checkpoint every N minutes (0: only at epoch ends and on "
                                             "signals; under torchrun at the next log line)", RUN, bounds=">= 0")
    tensorboard_dir: str = setting("", "also log the curves to TensorBoard, into <this folder>/<name> (pip install "
                                       "tensorboard)", RUN)
    wandb_log: bool = setting(False, "also log them to Weights & Biases, offline (pip install wandb)", RUN)
    wandb_project: str = setting("tiny-llm", "the Weights & Biases project", RUN)
    stop_after_updates: int = setting(0, "stop (checkpointed) after N updates of this process, as a scheduler's "
                                         "time limit would", RUN, bounds=">= 0")


@dataclasses.dataclass
class Protocol:
    """the benchmark's protocol (bench.py; tune.py runs it)"""
    warmup: int = setting(20, "updates before the timed windows (the first one compiles)", bounds=">= 1")
    steps: int = setting(100, "updates in each timed window", bounds=">= 1")
    windows: int = setting(3, "timed windows; the headline is the median window's tokens/s", bounds=">= 1")
    data_mode: str = setting("real", "real: the token cache; synthetic: random tokens, no dataset needed (the "
                                     "vocabulary still follows a cache at data_dir when there is one, else 32,000)",
                             choices=("real", "synthetic"))
    profile: bool = setting(False, "GPU kernel time by category over profile_updates updates, in profiles.NAME")
    profile_updates: int = setting(3, "updates the profiler records", bounds=">= 1")
    cold: bool = setting(False, "compile with fresh, empty inductor and Triton caches")
    partial_probe: bool = setting(False, "time single updates of 32, 11, 25 and 32 sequences")
    presets: str = setting("", 'e.g. "20m,50m,90m": run each preset, shown beside its previous entry')
    scaling_reference: str = setting("", "a one-GPU benchmarks entry to compute scaling efficiency against")


# ---------------------------------------------------------------- composing a script's settings

def pick(group, *keys, **defaults):
    """The group with only these keys (defaults= gives a script its own default for one of them)."""
    chosen = [f for f in dataclasses.fields(group) if f.name in keys]
    missing = set(keys) - {f.name for f in chosen}
    assert not missing, f"{group.__name__} has no {missing}"
    specs = [(f.name, f.type, dataclasses.field(default=defaults.get(f.name, f.default), metadata=f.metadata))
             for f in chosen]
    return dataclasses.make_dataclass(group.__name__, specs, namespace={"__doc__": group.__doc__})


def compose(class_name, *groups, **defaults):
    """A script's settings class: the groups' keys in order, each group's title kept for --help; defaults= gives
    the script its own default for a key, or its own declaration (a setting(), for bench.py's name, say)."""
    specs = []
    for group in groups:
        for f in dataclasses.fields(group):
            own = defaults.get(f.name, f.default)
            field = own if isinstance(own, dataclasses.Field) else dataclasses.field(default=own, metadata=f.metadata)
            specs.append((f.name, f.type, field))
    return dataclasses.make_dataclass(class_name, specs, namespace={"groups": groups})


TRAIN_GROUPS = (Paths, ModelShape, Recipe, Execution, Lifecycle)
TrainSettings = compose("TrainSettings", *TRAIN_GROUPS)
BENCH_GROUPS = (Protocol, pick(Paths, "name", "results_file", "data_dir", "init_from"), ModelShape, Recipe, Execution)
BenchSettings = compose("BenchSettings", *BENCH_GROUPS, name=setting(
    "bench", "entry name under benchmarks. in the results file", RUN, rule=run_name_problem))


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
    (those outside IDENTITY_KEYS only off their defaults), the resolved model config, the data's identity and the
    initial weights' hash (only when given: a run from the seed's weights has none)."""
    fields_ = {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.metadata["role"] == RECIPE
               and (f.name in IDENTITY_KEYS or cfg[f.name] != f.default)}
    fields_.update(model=mcfg.to_dict(), cache_identity=cache_identity)
    if init_weights:
        fields_["init_weights"] = init_weights
    return fields_


def recipe_differences(old, new):
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def load(cls, argv):
    """Read a script's settings, unchecked: defaults <- config files <- --key=value. A config file may assign any
    of train.py's keys; those this script does not declare are left out."""
    from configurator import load_config
    return Config(load_config(cls, argv, file_keys=TrainSettings))


def resolve(cls, argv):
    """Read a script's settings and check every value and combination: a Config."""
    cfg = load(cls, argv)
    check(cls, cfg)
    return cfg


# ---------------------------------------------------------------- the checks of values

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


# ---------------------------------------------------------------- the checks of combinations

COMBINATIONS = []  # (the keys a rule reads, the rule): a script's settings run the rules whose keys they all hold


def combination(*keys):
    def register(rule):
        COMBINATIONS.append((keys, rule))
        return rule
    return register


@combination("min_lr", "learning_rate")
def _lr_floor(cfg):
    if cfg.min_lr > cfg.learning_rate:
        return (f"min_lr {cfg.min_lr} is above learning_rate {cfg.learning_rate}; the schedule decays from "
                f"learning_rate to min_lr")


@combination("tokens_per_update", "seq_len")
def _whole_sequences(cfg):
    if cfg.tokens_per_update % cfg.seq_len:
        return (f"tokens_per_update {cfg.tokens_per_update} is not a multiple of seq_len {cfg.seq_len}; an update is "
                f"a whole number of sequences")


@combination("seq_len_schedule", "windows")
def _schedule_in_bench(cfg):
    """bench.py (and tune.py, which runs it) times updates of tokens_per_update at seq_len, one shape."""
    if cfg.seq_len_schedule:
        return ("seq_len_schedule makes updates of other shapes than the one bench.py times; bench each context C "
                "alone without it (--seq_len_schedule= --seq_len=C --micro_batch_size=micro_batch_size x seq_len / C)")


@combination("seq_len_schedule", "seq_len")
def _seq_len_schedule(cfg):
    for context, _ in schedule_steps(cfg.seq_len_schedule):
        if cfg.seq_len % context or context >= cfg.seq_len:
            return (f"seq_len_schedule's context {context} must divide seq_len {cfg.seq_len} and be shorter (each "
                    f"sequence is split into windows of that many targets); valid: "
                    f"{[c for c in range(1, cfg.seq_len) if cfg.seq_len % c == 0]}")


@combination("epochs", "init_from")
def _epochs(cfg):
    if cfg.epochs == 0 and not cfg.init_from:
        return ("epochs 0 trains nothing and would record random weights as a complete run; give at least 1 (or "
                "init_from, to evaluate those weights)")


@combination("epochs", "full_validation")
def _evaluation_only(cfg):
    if cfg.epochs == 0 and not cfg.full_validation:
        return ("epochs 0 evaluates init_from's weights in the full validation alone, and full_validation is False: "
                "the run would record no loss as complete; set full_validation=True, or epochs to train")


@combination("optimizer", "muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr")
def _muon_keys(cfg):
    muon_keys = [k for k in ("muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr")
                 if cfg[k] != field_of(Recipe, k).default]
    if muon_keys and cfg.optimizer != "muon":
        return (f"{', '.join(muon_keys)} set but optimizer is {cfg.optimizer!r}; set optimizer=muon or leave the "
                f"muon_ keys at their defaults")


@combination("lr_schedule", "cooldown_fraction")
def _cooldown(cfg):
    if cfg.lr_schedule != "wsd" and cfg.cooldown_fraction != field_of(Recipe, "cooldown_fraction").default:
        return (f"cooldown_fraction {cfg.cooldown_fraction} is wsd's and lr_schedule is {cfg.lr_schedule!r}, which "
                f"would ignore it; set lr_schedule=wsd or leave cooldown_fraction at its default")


@combination("optimizer", "normuon", "muon_split_projections")
def _muon_levers(cfg):
    """normuon and muon_split_projections, the optimizer levers of #38 that refine Muon: Muon's alone."""
    for lever in ("normuon", "muon_split_projections"):
        if cfg[lever] and cfg.optimizer != "muon":
            return (f"{lever} refines Muon's update and optimizer is {cfg.optimizer!r}; set optimizer=muon or leave "
                    f"{lever} off")


@combination("ema", "epochs")
def _ema(cfg):
    if cfg.ema and not cfg.epochs:
        return f"ema {cfg.ema} averages the weights of the updates and epochs 0 makes none; train, or leave ema at 0"


@combination("update_graph", "compile")
def _update_graph(cfg):
    if cfg.update_graph and not cfg.compile:
        return "update_graph compiles the clip and the optimizer step with the model; set compile=True (or leave " \
               "update_graph off)"


@combination("compile_cache", "compile")
def _compile_cache(cfg):
    if cfg.compile_cache and not cfg.compile:
        return ("compile_cache holds compiled code and this run compiles nothing; set compile=True (or drop "
                "compile_cache)")


@combination("stop_at_target", "target_loss")
def _target(cfg):
    if cfg.stop_at_target and not cfg.target_loss:
        return "stop_at_target needs a target: set target_loss (the validation-subset loss to reach)"


@combination("resume", "overwrite")
def _resume_or_overwrite(cfg):
    if cfg.resume and cfg.overwrite:
        return ("resume=True continues the checkpoint and overwrite=True starts afresh over it; give one of them, "
                "not both")


@combination("loss_impl", "mlp_impl", "attention_backend", "lm_head_fp8", "loss_chunk_tokens", "micro_batch_size",
             "seq_len")
def _execution_choices(cfg):
    """The execution choices' (and the FP8 head's) rules on these numbers (model_kernels/registry.py)."""
    return registry.problem(cfg)


@combination("presets", *MODEL_SHAPE_KEYS[:-1])
def _presets(cfg):
    """bench.py's presets: known names, and no shape key beside them (each preset runs in its own shape, so a dim
    given with presets would be dropped without a word)."""
    if not cfg.presets:
        return None
    names = preset_names(cfg)
    if not names:
        return f"presets={cfg.presets!r} names no preset; valid: {', '.join(model_lib.PRESETS)}"
    unknown = [p for p in names if p not in model_lib.PRESETS]
    if unknown:
        return f"unknown model preset {unknown[0]!r}; valid presets: {', '.join(model_lib.PRESETS)}"
    shape = [f"{k}={cfg[k]}" for k in MODEL_SHAPE_KEYS[:-1] if cfg[k]]
    if shape:
        return (f"presets={cfg.presets} runs each preset in its own shape, so {', '.join(shape)} would be ignored; "
                f"leave them at 0 with presets, or drop presets to time this shape")


@combination("presets", "init_from")
def _presets_from_weights(cfg):
    if cfg.presets and cfg.init_from:
        return (f"presets={cfg.presets} times each preset in its own shape, and init_from {cfg.init_from} fixes one "
                f"shape, the weights'; drop one of them")


@combination("scaling_reference")
def _scaling_reference(cfg):
    if cfg.scaling_reference and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return (f"scaling_reference={cfg.scaling_reference} compares several processes with that one-GPU entry, and "
                f"this is one process; run under torchrun --nproc_per_node=N, or drop scaling_reference")


def preset_names(cfg):
    return [p.strip() for p in cfg.presets.split(",") if p.strip()]


def check(cls, cfg):
    """Every key's own rules, then the combinations of the keys cls holds, then cls's own `rules` (a script's, or a
    test's subclass): a ConfigError before any work."""
    declared = fields(cls)
    for key, field in declared.items():
        problem = check_value(key, cfg[key], field)
        if problem:
            raise ConfigError(problem)
    for keys, rule in COMBINATIONS:
        problem = set(keys) <= set(declared) and rule(cfg)
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


def micro_steps(cfg, world_size=1):
    """Micro-batches per update on each process: the gradient accumulation count."""
    return max(1, cfg.tokens_per_update // cfg.seq_len // (cfg.micro_batch_size * world_size))


def doubtful_values(cfg, total_updates):
    """Legal values that are probably not what was meant: one line each, training goes on."""
    lines = []
    if cfg.warmup_updates > total_updates > 0:  # at equal lengths the last update reaches the peak
        lines.append(f"warmup_updates {cfg.warmup_updates} is longer than the run's {total_updates} updates: "
                     f"the learning rate never reaches its peak {cfg.learning_rate}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cfg.cpu_threads > cores:
        lines.append(f"cpu_threads {cfg.cpu_threads} is more than the {cores} cores this process may use; the "
                     f"extra threads only contend")
    return lines
