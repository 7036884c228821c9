"""The tiny-llm model: a Llama-style decoder, its presets and its FLOP count.

Layout follows transformers' LlamaForCausalLM exactly (RMSNorm before attention and MLP, rotary positions
with the rotate-half convention, SwiGLU, tied embeddings, no biases), so weights map one to one (hf.py). Two
projections are stored fused for speed at small widths, with the same forward math: q, k, v as one matrix
(`wqkv`) and the SwiGLU gate and up projections as one (`w13`); Muon orthogonalizes a fused matrix whole unless
muon_split_projections cuts it into its pieces (fused_projections). The kernels it calls live in model_kernels/, and how
each concern runs (the loss, the MLP, attention) is the choice model_kernels/registry.py declares.

The architecture levers (ModelConfig's last fields, all off by default: then the model, its parameter names and
its initialisation under a seed are the plain Llama's above) change the math, as modded-nanogpt's records did:
qk_norm (Qwen3's per-head RMSNorm of q and k before the rotary embedding) and value_embeddings
(Transformer.through_blocks says its math). The levers that lost their screens left the code (REMOVED_LEVERS).

    python model.py      # the preset table
"""
import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from model_kernels.attention import causal_attention
from model_kernels.cross_entropy import linear_cross_entropy_losses
from model_kernels.registry import ATTENTION, LOSS, MLP


# The time-to-quality levers that lost their screens (docs/TIME_TO_QUALITY.md, "Levers not kept"), the model's and
# the recipe's, each with its off value, and the last commit whose code ran them. A model config saved while they
# existed (a checkpoint's) may hold one off, which is the model as it is now; switched on, it is refused, as the
# settings refuse the keys (configurator.py).
REMOVED_LEVERS = {"mlp_activation": "silu", "zero_init_proj": False, "logit_softcap": 0.0, "tie_embeddings": True,
                  "unet_skips": False, "batch_schedule": "", "muon_orthogonalizer": "newton_schulz",
                  "cautious_weight_decay": False, "bigram_embeddings": 0, "smear": False, "dropout": 0.0}
REMOVED_IN = dict.fromkeys(REMOVED_LEVERS, "94da7b6") | {"bigram_embeddings": "6921dcb", "smear": "6921dcb",
                                                         "dropout": "4e6b149"}


class RemovedLever(ValueError):
    """A saved model config with a removed lever switched on: the run needs the code of its commit, REMOVED_IN."""


def removed_lever(key, value=None):
    """The sentence that refuses a removed lever: `key`, or key=value when the value is known."""
    named = key if value is None else f"{key}={value}"
    return (f"{named} was a time-to-quality lever removed after its screen (docs/TIME_TO_QUALITY.md); the code "
            f"that ran it is in commit {REMOVED_IN[key]}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    dim: int = 320
    n_layers: int = 8
    n_heads: int = 5
    hidden_dim: int = 896  # SwiGLU inner width
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # architecture levers (#38), off by default (the module's docstring; settings.py's Recipe declares them)
    qk_norm: bool = False
    value_embeddings: int = 0

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {field} must be a positive integer, got {value!r}")
        for field, lowest in (("norm_eps", 0), ("rope_theta", 1e-9)):  # a hand-made or corrupt config: NaN logits
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < lowest:
                raise ValueError(f"model {field} must be a finite number of at least {lowest:g}, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model width {self.dim} is not divisible by the head count {self.n_heads}; "
                             f"choose a width that is a multiple of n_heads (heads of 64: width = 64 x n_heads)")
        if self.head_dim % 2:
            raise ValueError(f"head size {self.head_dim} (width / heads) must be even for rotary positions")
        self.check_levers()

    def check_levers(self):
        k = self.value_embeddings
        if not isinstance(k, int) or k < 0 or 2 * k > self.n_layers:
            raise ValueError(f"value_embeddings {k!r} needs 2 x {k!r} blocks (the first and last of them take a "
                             f"table each) and the model has {self.n_layers}; give 0 to {self.n_layers // 2}")

    @property
    def head_dim(self):
        return self.dim // self.n_heads

    def to_dict(self):
        """The fields, with each lever left out at its default: the dict a recipe identity hashes and a checkpoint
        keeps, so that a run recorded before the levers existed keeps its identity (and ModelConfig(**d) of an
        old checkpoint's dict is the same model)."""
        return {k: v for k, v in asdict(self).items() if k not in LEVERS or v != LEVERS[k]}

    @classmethod
    def from_dict(cls, saved):
        """The ModelConfig of a saved dict (to_dict's, a checkpoint's): a removed lever it holds at its off value is
        dropped, as that is the model now; one switched on is a RemovedLever naming it."""
        for key, value in saved.items():
            if key in REMOVED_LEVERS and value != REMOVED_LEVERS[key]:
                raise RemovedLever(removed_lever(key, value))
        return cls(**{k: v for k, v in saved.items() if k not in REMOVED_LEVERS})


# The architecture levers and their defaults (off): ModelConfig's fields from qk_norm on
LEVERS = {f.name: f.default for f in fields(ModelConfig)[[f.name for f in fields(ModelConfig)].index("qk_norm"):]}


PRESETS = {
    # 20,403,520 parameters: the exact shape of the system tiny-llm replaces.
    "20m": ModelConfig(),
    # 50.5M and 88.3M: the same family with heads of 64 and SwiGLU at 3x and 8/3 x width.
    "50m": ModelConfig(dim=512, n_layers=10, n_heads=8, hidden_dim=1536),
    "90m": ModelConfig(dim=768, n_layers=9, n_heads=12, hidden_dim=2048),
}

# The residual stream's dtype under autocast: float32 (the embedding's, so each block's bf16 output is added in
# float32) or, declared as a change of math, bfloat16 (the weights and the optimizer stay float32).
RESIDUAL_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def get_preset(name, **overrides):
    """The preset called `name`, with any field replaced by `overrides` (e.g. vocab_size from the data)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def flops_per_token(config, seq_len, context_steps=()):
    """Training FLOPs per token: 6 x matmul parameters (forward 2, backward 4) plus attention scores; context_steps:
    a seq_len_schedule's ((context, until), ...), whose attention term is each context's by its share of the tokens.

    Matmul parameters are the attention and MLP projections plus the LM head (the embedding lookup does
    no multiplication, but the tied matrix is used again as the head). The attention term counts QK^T and
    attention x V over the full T x T square, 12 x layers x width x T per token, as PaLM, nanoGPT and
    torchtitan do. Causal masking lets a flash kernel skip about half of that square; we do NOT halve it,
    so our MFU is comparable with theirs and slightly flatters attention-heavy shapes.

    No architecture lever adds a matmul, so none changes the count: value embeddings are lookups, and qk_norm's
    norms and gains are elementwise work that, like the RMSNorms and SwiGLU, is not counted.
    """
    c = config
    per_layer = 4 * c.dim * c.dim + 3 * c.dim * c.hidden_dim
    matmul_params = c.n_layers * per_layer + c.vocab_size * c.dim
    mean_context, start = 0.0, 0.0
    for context, until in context_steps:
        mean_context, start = mean_context + context * (until - start), until
    mean_context = mean_context + seq_len * (1 - start) if context_steps else seq_len  # an int without a schedule
    return 6 * matmul_params + 12 * c.n_layers * c.dim * mean_context


def parameter_count(config):
    """The model's parameters without building it: the tied embedding, each block's projections and norms, the
    final norm, and the levers' own: q and k gains per block, the value embeddings' tables and their two mixing
    weights in each block that takes one."""
    c = config
    per_layer = 4 * c.dim * c.dim + 3 * c.dim * c.hidden_dim + 2 * c.dim + 2 * c.head_dim * c.qk_norm
    tables = (1 + c.value_embeddings) * c.vocab_size * c.dim
    return tables + c.n_layers * per_layer + c.dim + 2 * (2 * c.value_embeddings)


def value_embedding_layers(config):
    """Which table each block adds to its values (None: none): table i to block i and to block
    n_layers - value_embeddings + i, the first k blocks and the last k in the same order, as modded-nanogpt."""
    k, n = config.value_embeddings, config.n_layers
    return [i if i < k else i - (n - k) if i >= n - k else None for i in range(n)]


def rotary_tables(config, device=None):
    """cos and sin of shape (max_seq_len, head_dim), transformers' rotate-half layout, in float32."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=device).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** half)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def signed_sin(sin):
    """sin with its first half negated, so that rotate_half(x) * sin == cat(x2, x1) * signed_sin(sin)."""
    first, second = sin.chunk(2, dim=-1)
    return torch.cat((-first, second), dim=-1)


def apply_rotary(x, cos, sin_signed):
    """x: (B, T, ..., D); cos, sin_signed (see signed_sin): (T, D) in x's dtype.

    transformers' rotate-half, x * cos + cat(-x2, x1) * sin, with the sign moved into the table and the
    multiply-add fused: eager launches 3 kernels forward instead of 5 (it is launch-bound at small widths).
    """
    shape = (x.shape[1],) + (1,) * (x.dim() - 3) + (x.shape[-1],)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos.view(shape), torch.cat((x2, x1), dim=-1), sin_signed.view(shape))


class Attention(nn.Module):
    def __init__(self, config, value_embedding=False):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:  # Qwen3's q_norm and k_norm: a gain per head dimension, shared by the heads
            self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps)
        if value_embedding:  # v <- lambdas[0] v + lambdas[1] ve (Transformer.through_blocks)
            self.value_lambdas = nn.Parameter(torch.full((2,), 0.5))

    def forward(self, x, cos, sin, backends, ve=None, windows=None):
        B, T, C = x.shape
        qkv = self.wqkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        # split (not slicing and indexing, whose backward pads each gradient with zeros and adds them),
        # and q and k rotated in one pass
        qk, v = qkv.split([2, 1], dim=2)
        if self.qk_norm:  # both normalised in one pass, each then times its own gain: (2, 1, head_dim) over heads,
            # in float32 under autocast (the gains'), rounded once to the dtype q and k had
            gains = torch.stack((self.q_norm.weight, self.k_norm.weight))[:, None, :]
            qk = (F.rms_norm(qk, (self.head_dim,), eps=self.q_norm.eps) * gains).to(qk.dtype)
        q, k = apply_rotary(qk, cos, sin).unbind(2)
        v = v.squeeze(2)
        if ve is not None:  # in float32 (the table's), rounded once to v's dtype for the attention kernel
            v = (self.value_lambdas[0] * v + self.value_lambdas[1] * ve.view_as(v)).to(v.dtype)
        return self.wo(causal_attention(q, k, v, backends, windows).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, config, impl="torch"):
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)  # [gate; up]
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.impl, self._forward = impl, MLP[impl].forward  # how it runs (model_kernels/registry.py), same math
        if MLP[impl].load:
            MLP[impl].load()  # a missing package fails here, not in the first forward

    def forward(self, x):
        return self._forward(x, self.w13.weight, self.w2.weight)


class Block(nn.Module):
    def __init__(self, config, mlp_impl="torch", value_embedding=False):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config, value_embedding)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config, mlp_impl)

    def forward(self, x, cos, sin, backends, ve=None, windows=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, backends, ve, windows)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config, attention_backend="auto", loss_impl="full", loss_chunk_tokens=8192,
                 residual_dtype="float32", lm_head_fp8=False, mlp_impl="torch"):
        super().__init__()
        if isinstance(config, str):
            config = get_preset(config)
        self.config = config
        self.set_attention_backend(attention_backend)
        loss = LOSS[loss_impl]  # an unknown name is a ValueError listing the valid ones (the MLP's: FeedForward)
        if loss.load:
            loss.load()  # a missing package fails here, not in the first forward
        if lm_head_fp8 and loss.fp8 is None:
            raise ValueError(f"lm_head_fp8 runs inside a loss with an FP8 form; loss_impl {loss_impl!r} has none")
        if residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"unknown residual_dtype {residual_dtype!r}; valid: {', '.join(RESIDUAL_DTYPES)}")
        self.residual_dtype = RESIDUAL_DTYPES[residual_dtype]
        self.loss_impl, self.loss_chunk_tokens, self.lm_head_fp8 = loss_impl, loss_chunk_tokens, lm_head_fp8
        # the declared FP8 head runs in training's loss only (model_kernels/linear_cross_entropy_fp8.py); the
        # settings and shapes that can run a choice are model_kernels/registry.py's to say, and settings.py's to check
        self._train_loss, self._losses_only = (loss.fp8 if lm_head_fp8 else loss.train), loss.losses_only
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # value_embeddings: tables apart from the blocks (an embedding's optimizer, AdamW, as optim.py splits them)
        self.value_embeds = nn.ModuleList(nn.Embedding(config.vocab_size, config.dim)
                                          for _ in range(config.value_embeddings))
        self._value_embedding_of = value_embedding_layers(config)
        self.layers = nn.ModuleList(Block(config, mlp_impl, value_embedding=table is not None)
                                    for table in self._value_embedding_of)
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied
        # Computed once here and moved with the module: recomputed per forward, they are kernels in every update.
        cos, sin = rotary_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)
        self.reset_parameters()

    def set_attention_backend(self, name):
        choice = ATTENTION[name]
        if choice.load:
            choice.load()  # a missing package fails here, not in the first forward
        self.attention_backend, self._sdpa_backends = name, choice.backends

    def reset_parameters(self):
        """RMSNorm gains (qk_norm's too) 1, value-embedding mixes 0.5 each; the output projections
        N(0, 0.02 / sqrt(2 x layers)); every other matrix N(0, 0.02): the embedding (the tied LM head) and the value
        embeddings' tables."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("value_lambdas"):
                nn.init.constant_(p, 0.5)
            elif p.dim() < 2:
                nn.init.ones_(p)  # RMSNorm gains
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def fused_projections(self):
        """The weights stored fused (the module's docstring), each with the matrices it stacks by rows: each
        block's wqkv (q, k, v) and w13 (the SwiGLU gate and up)."""
        return [(w, pieces) for block in self.layers
                for w, pieces in ((block.attention.wqkv.weight, 3), (block.feed_forward.w13.weight, 2))]

    def check_input(self, idx, targets=None):
        """Shape and token-id checks, run before any kernel so that a bad input is one clear error.

        The id range is checked only for CPU tensors: on the GPU it would cost a host sync per forward.
        Batches reach the GPU from the data loader, which checks ids on the CPU side first.
        """
        if idx.dim() != 2:
            raise ValueError(f"model input must be (batch, sequence) token ids, got shape {tuple(idx.shape)}")
        if idx.dtype not in (torch.int64, torch.int32) or targets is not None and targets.dtype != torch.int64:
            raise ValueError(f"token ids must be int64 or int32 and targets int64, got {idx.dtype}"
                             + (f" and {targets.dtype}" if targets is not None else ""))
        if idx.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx.shape[1]} is longer than the model's context "
                             f"{self.config.max_seq_len}; use at most max_seq_len tokens")
        if idx.device.type == "cpu" and idx.numel():
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}) (the vocabulary), "
                                 f"got ids from {low} to {high}")
        if targets is None:
            return
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the input's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if targets.device.type == "cpu" and targets.numel():
            counted = targets[targets != -100]
            if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= self.config.vocab_size):
                raise ValueError(f"targets must lie in [0, {self.config.vocab_size}) or be -100 (ignored), got "
                                 f"{int(counted.min())} to {int(counted.max())}")

    def hidden_states(self, idx, windows=None):
        T = idx.shape[1]
        # q and k come out of the projection in the autocast dtype: cast the tables to it once per forward.
        device_type = idx.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.rope_cos.dtype
        at = slice(T) if windows is None else windows[0]  # context_windows: each position's place in its window
        cos, sin = self.rope_cos[at].to(dtype), self.rope_sin_signed[at].to(dtype)
        x = self.tok_embeddings(idx)
        if self.residual_dtype is not None and torch.is_autocast_enabled(device_type):
            x = x.to(self.residual_dtype)  # the declared bf16 stream: every add and norm then reads half the bytes
        return self.norm(self.through_blocks(x, idx, cos, sin, windows))

    def through_blocks(self, x, idx, cos, sin, windows=None):
        """The blocks over the embedded x, with the value_embeddings lever: for k tables, ve_j = value_embeds[j](idx);
        block i of the first k and block n - k + i of the last k take ve_i into their values,
        v = value_lambdas[0] v + value_lambdas[1] ve_i (per head, the table's width split as v is), both lambdas 0.5
        at first."""
        ves = [table(idx) for table in self.value_embeds]
        for layer, table in zip(self.layers, self._value_embedding_of):
            x = layer(x, cos, sin, self._sdpa_backends, None if table is None else ves[table], windows)
        return x

    def forward(self, idx, targets=None, reduction="mean", windows=None):
        """Logits (B, T, V) without targets; else the token cross-entropy, ignoring targets of -100.

        windows: None, or (positions, starts), data/loader.py's window_tensors: each row is windows of a shorter
        context, positions restarting at each and attention kept within it (context_windows).

        reduction "mean" averages over the counted targets; "sum" adds them (the training step divides
        by the update's token count itself, so that a partial update weighs each token the same); "none"
        gives each position's loss, 0 where ignored (evaluation uses it for the loss's spread).
        """
        if not torch.compiler.is_compiling():
            self.check_input(idx, targets)
        h = self.hidden_states(idx, windows)
        if targets is None:
            return self.output(h)
        return self.loss(h, targets, reduction)

    def loss(self, h, targets, reduction="mean"):
        """The LM head and cross-entropy on the last hidden state (a method of its own so that it can be
        compiled apart from the blocks)."""
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"unknown loss reduction {reduction!r}; valid: mean, sum, none")
        flat_h, flat_targets = h.flatten(0, 1), targets.flatten()
        # evaluation (no gradient to compute) of the losses that make gradients in forward: each token's loss from
        # our losses-only op
        if self._losses_only and not torch.is_grad_enabled():
            losses = linear_cross_entropy_losses(flat_h, self.output.weight, flat_targets, self.loss_chunk_tokens)
            if reduction == "none":
                return losses
            total = losses.sum()
        elif reduction == "none":
            return F.cross_entropy(self.output(flat_h).float(), flat_targets, ignore_index=-100, reduction="none")
        else:
            total = self._train_loss(flat_h, self.output.weight, flat_targets, self.loss_chunk_tokens)
        if reduction == "sum":
            return total
        return total / (targets != -100).sum().clamp(min=1)


def print_presets():
    """The README's preset table: parameters, shape and training FLOPs per token of each preset."""
    print(f"{'preset':<8}{'parameters':>14}{'width':>7}{'layers':>7}{'heads':>6}{'hidden':>8}"
          f"{'FLOPs/token (T=1024)':>22}")
    for name, cfg in PRESETS.items():
        params = sum(p.numel() for p in Transformer(cfg).parameters())
        print(f"{name:<8}{params:>14,}{cfg.dim:>7}{cfg.n_layers:>7}{cfg.n_heads:>6}{cfg.hidden_dim:>8}"
              f"{flops_per_token(cfg, 1024) / 1e6:>20.1f}M")


if __name__ == "__main__":
    print_presets()
