"""Every execution choice, declared once: one registry per concern (the loss, the MLP, attention), each choice with
its name, one line of help, what the model calls, and why it cannot run on a device or take a shape.

model.py builds from the registries; settings.py takes its fields' choices and help from them and refuses a run
with `problem`; tune.py's candidates are those fields' choices. A new choice is one entry here beside its kernel.
A choice stays only if it is its concern's default, the plain torch reference, or measured faster than the default
on some preset on the H200 (docs/PERFORMANCE.md; the others are in its "Levers tried and not kept").
"""
import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.nn.attention import SDPBackend

from model_kernels import attention, cross_entropy, quack_ops, swiglu
from model_kernels import linear_cross_entropy_fp8 as fp8


def runs_anywhere(device):
    return None


def takes_any_shape(model_config, cfg):
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice:
    """One execution choice. device_problem(device) says why it cannot run on that torch.device and
    shape_problem(model_config, cfg) why it cannot take the settings' token counts or, given a ModelConfig (else
    None), the model's shape: each as the words that follow "KEY NAME" in the refusal ("needs ...", "runs only
    ..."), or None. load(), where given, runs when a model takes the choice: a ValueError if what it calls is
    missing, so that this fails at construction rather than in the first forward."""
    name: str
    help: str
    device_problem: Callable[[torch.device], Optional[str]] = runs_anywhere
    shape_problem: Callable[[Any, Any], Optional[str]] = takes_any_shape
    load: Optional[Callable[[], Any]] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossChoice(Choice):
    """train(h, weight, targets, chunk_tokens): the sum of the token losses of h @ weight.T (targets of -100
    ignored), with autograd. losses_only: evaluation without gradients takes cross_entropy.linear_cross_entropy_losses,
    for a loss that makes its gradients in forward. fp8: train with the declared FP8 head (lm_head_fp8), where the
    loss has that form."""
    train: Callable
    losses_only: bool = False
    fp8: Optional[Callable] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPChoice(Choice):
    """forward(x, w13, w2): F.linear(silu(gate) * up, w2) with [gate; up] = F.linear(x, w13)."""
    forward: Callable


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionChoice(Choice):
    """backends: what model_kernels.attention.causal_attention runs: "auto", "fa4", None (SDPA's own pick) or one SDPA
    kernel."""
    backends: Any


def listed(names):
    """'a, b or c'."""
    names = list(names)
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


class Registry:
    """One concern's choices by name, in declaration order. It iterates over the names and answers `in`, so that it
    serves as a settings field's choices (configurator's --help, settings.check_value, tune.py's lists)."""

    def __init__(self, key, summary, *choices):
        self.key, self.summary = key, summary  # the settings key, and what the choices run
        self._choices = {c.name: c for c in choices}

    def __iter__(self):
        return iter(tuple(self._choices))

    def __len__(self):
        return len(self._choices)

    def __contains__(self, name):
        return name in self._choices

    def __getitem__(self, name):
        """The choice called `name`; another name is a ValueError listing the valid ones."""
        if name not in self._choices:
            raise ValueError(f"unknown {self.key} {name!r}; valid: {', '.join(self)}")
        return self._choices[name]

    def __repr__(self):
        return f"Registry({self.key!r}: {', '.join(self)})"

    @property
    def help(self):
        """The settings field's help: what the choices run, then each one's line."""
        return f"{self.summary}. " + "; ".join(f"{c.name}: {c.help}" for c in self._choices.values())

    @contextlib.contextmanager
    def temporary(self, choice):
        """`choice` among the others while the block runs (a test's), gone after it."""
        if choice.name in self._choices:
            raise ValueError(f"{self.key} {choice.name!r} is declared already")
        self._choices[choice.name] = choice
        try:
            yield choice
        finally:
            del self._choices[choice.name]

    def runs_on(self, device):
        """The names of the choices that can run on `device`."""
        return [name for name, c in self._choices.items() if c.device_problem(device) is None]

    def problem(self, cfg, device=None, model_config=None):
        """Why the configured choice cannot run (see the module's `problem`), or None."""
        name = cfg[self.key]
        if name not in self._choices:
            return f"{self.key} {name!r} is not one of {', '.join(self)}"
        choice = self._choices[name]
        why = choice.shape_problem(model_config, cfg)
        if why:
            return f"{self.key} {name} {why}"
        why = device is not None and choice.device_problem(device)
        if not why:
            return None
        others = [n for n in self.runs_on(device) if n != name]
        return f"{self.key} {name!r} {why}" + (f"; choose {listed(others)} instead" if others else "")


# ---------------------------------------------------------------- the choices

def cuda_only(device):
    return None if device.type == "cuda" else f"runs only on CUDA GPUs, not on {device.type}"


def fa4_device_problem(device):
    """flash-attn-4 first (the package a user can install), then the GPU as model_kernels.attention.fa4_problem says it
    (looked up at each call, so that tests can stand in for it)."""
    problem = attention.flash_attn_4_problem() or attention.fa4_problem(device)
    return problem and problem.removeprefix("fa4 ")


LOSS = Registry(
    "loss_impl", "the LM head and its cross-entropy, same math",
    LossChoice(name="full", help="all logits at once, float32 inside cross-entropy, the plain torch reference",
               train=cross_entropy.full_cross_entropy),
    LossChoice(name="fused", help="our op, which makes the loss and its gradients in forward one slice of "
                                  "loss_chunk_tokens at a time in bf16 (model_kernels/cross_entropy.py) and runs "
                                  "the FP8 head",
               train=cross_entropy.linear_cross_entropy, losses_only=True, fp8=fp8.linear_cross_entropy_fp8),
    LossChoice(name="quack_chunked", help="fused's slices through quack-kernels' cross-entropy and autotuned weight "
                                          "gradient (Hopper), with a higher peak memory (docs/PERFORMANCE.md)",
               train=quack_ops.linear_cross_entropy, losses_only=True, device_problem=quack_ops.device_problem,
               shape_problem=quack_ops.loss_shape_problem, load=quack_ops.load),
)

MLP = Registry(
    "mlp_impl", "the SwiGLU MLP, same math and parameters",
    MLPChoice(name="torch", help="the w13 matmul, then SwiGLU and the down projection as one op "
                                 "(model_kernels/swiglu.py)",
              forward=swiglu.swiglu_mlp),
    MLPChoice(name="quack", help="quack-kernels' gated matmuls, SwiGLU in their epilogues (Hopper, "
                                 "model_kernels/quack_ops.py)",
              forward=quack_ops.swiglu_mlp, device_problem=quack_ops.device_problem,
              shape_problem=quack_ops.mlp_shape_problem, load=quack_ops.load),
)

ATTENTION = Registry(
    "attention_backend", "causal attention",
    AttentionChoice(name="auto", help="fa4 where it can run, else sdpa", backends="auto"),
    AttentionChoice(name="sdpa", help="PyTorch's scaled_dot_product_attention, its own pick of kernel", backends=None),
    AttentionChoice(name="cudnn", help="SDPA's cuDNN kernel (CUDA)", backends=SDPBackend.CUDNN_ATTENTION,
                    device_problem=cuda_only),
    AttentionChoice(name="math", help="SDPA's math kernel, the plain torch reference", backends=SDPBackend.MATH),
    AttentionChoice(name="fa4", help="cuDNN's forward and flash-attn-4's backward (Hopper or Blackwell, "
                                     "requirements-gpu.txt)", backends="fa4", device_problem=fa4_device_problem,
                    load=attention.flash_attn_4),
)

REGISTRIES = (LOSS, MLP, ATTENTION)


def fp8_problem(cfg, device=None, model_config=None):
    """Why the declared FP8 head (lm_head_fp8, a recipe key that runs inside a loss) cannot run with these
    settings, or None: a loss without its FP8 form, then the FP8 matmuls' token counts and shape, then the GPU."""
    if not cfg["lm_head_fp8"]:
        return None
    with_fp8 = [name for name in LOSS if LOSS[name].fp8]
    if cfg["loss_impl"] not in with_fp8:
        return (f"lm_head_fp8 runs inside the {listed(with_fp8)} loss; set loss_impl={with_fp8[0]} (got "
                f"{cfg['loss_impl']!r})")
    why = fp8.shape_problem(model_config, cfg)
    if why:
        return f"lm_head_fp8 {why}"
    why = device is not None and fp8.device_problem(device)
    return f"lm_head_fp8 {why}; set lm_head_fp8=False" if why else None


def problem(cfg, device=None, model_config=None):
    """The first reason the configured loss_impl, mlp_impl and attention_backend (and lm_head_fp8) cannot run, as
    the one line a user sees, or None. cfg: the settings (a mapping). Without device or model_config, the settings'
    own numbers only (settings.check, before the data gives the vocabulary); with a torch.device, what it can run;
    with a ModelConfig, the shapes the kernels take."""
    for registry in REGISTRIES:
        why = registry.problem(cfg, device, model_config)
        if why:
            return why
    return fp8_problem(cfg, device, model_config)
