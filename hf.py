"""transformers interop: our model as a LlamaForCausalLM (or, with qk_norm, a Qwen3ForCausalLM) and back, weight for
weight.

The tiny-llm family is Llama with heads that are all query heads (no grouped-query attention), tied
embeddings, no biases, SwiGLU and default rotary positions, but for the levers below; a Llama outside it is
refused in one sentence.

Of the architecture levers (model.py), qk_norm exports to Qwen3ForCausalLM, whose attention is Llama's with q_norm
and k_norm, RMSNorms of head_dim (gain per head dimension, eps rms_norm_eps) before the rotary embedding, as ours.
value_embeddings has no transformers class of this family that computes it: export refuses it (export_problem).
"""
import json
import re
from pathlib import Path

import torch

from model import LEVERS, ModelConfig, Transformer

MODEL_TYPES = ("llama", "qwen3")  # what an export's config.json is, and what from_hf reads back
NOT_EXPORTED = ("value_embeddings",)


def unexported_levers(config):
    """The levers of NOT_EXPORTED that our ModelConfig has on, as KEY=VALUE."""
    return [f"{k}={getattr(config, k)}" for k in NOT_EXPORTED if getattr(config, k) != LEVERS[k]]


def export_problem(config):
    """Why our ModelConfig has no transformers class that computes its function (a lever in NOT_EXPORTED is on),
    as one line, or None."""
    on = unexported_levers(config)
    if on:
        return (f"--export_hf cannot export {', '.join(on)}: neither transformers' LlamaForCausalLM nor "
                f"Qwen3ForCausalLM computes it; export a model trained without it")
    return None


def hf_config(config, bos_token_id=None, eos_token_id=None, pad_token_id=None):
    """transformers' LlamaConfig (Qwen3Config with qk_norm) of our ModelConfig; the special token ids come from the
    token cache the model was trained on (None where the caller has none). ValueError (export_problem) for a
    model no such config describes."""
    problem = export_problem(config)
    if problem:
        raise ValueError(problem)
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True, attention_bias=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if config.qk_norm:
        from transformers import Qwen3Config
        return Qwen3Config(**fields, use_sliding_window=False)
    from transformers import LlamaConfig
    return LlamaConfig(**fields, mlp_bias=False)


def causal_lm_class(hf_cfg):
    """LlamaForCausalLM or Qwen3ForCausalLM, by the config's model_type."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    return Qwen3ForCausalLM if hf_cfg.model_type == "qwen3" else LlamaForCausalLM


def hf_named_tensors(model, of=lambda p: p):
    """Our weights (or, with of=lambda p: p.grad, their gradients) under transformers' Llama names (and Qwen3's
    q_norm and k_norm; the LM head is the embedding).

    Fused matrices are split into views, so copying into a returned tensor writes into our weights.
    """
    out = {"model.embed_tokens.weight": of(model.tok_embeddings.weight),
           "model.norm.weight": of(model.norm.weight)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = of(layer.attention.wqkv.weight).chunk(3, dim=0)
        gate, up = of(layer.feed_forward.w13.weight).chunk(2, dim=0)
        out.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": of(layer.attention.wo.weight),
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": of(layer.feed_forward.w2.weight),
            p + "input_layernorm.weight": of(layer.attention_norm.weight),
            p + "post_attention_layernorm.weight": of(layer.ffn_norm.weight),
        })
        if model.config.qk_norm:
            out.update({p + "self_attn.q_norm.weight": of(layer.attention.q_norm.weight),
                        p + "self_attn.k_norm.weight": of(layer.attention.k_norm.weight)})
    return out


def to_hf(model, bos_token_id=None, eos_token_id=None, pad_token_id=None):
    """A transformers LlamaForCausalLM (Qwen3ForCausalLM with qk_norm) with this model's weights (float32, on the
    CPU); the token ids go into its config and generation config (eos_token_id is where generate() stops)."""
    config = hf_config(model.config, bos_token_id, eos_token_id, pad_token_id)
    hf = causal_lm_class(config)(config)
    state = {k: v.detach().float().cpu().clone() for k, v in hf_named_tensors(model).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto {type(hf).__name__}: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


def config_from_hf(hf_cfg):
    """Our ModelConfig of a transformers Llama (or Qwen3: qk_norm) config of the tiny-llm family and its levers;
    ValueError naming what is outside it."""
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    problems = []
    if getattr(hf_cfg, "model_type", "llama") not in MODEL_TYPES:  # another family's config: its fields differ
        raise ValueError(f"model_type {hf_cfg.model_type!r} is outside the tiny-llm family "
                         f"({' or '.join(MODEL_TYPES)})")
    if hf_cfg.num_key_value_heads != hf_cfg.num_attention_heads:
        problems.append("grouped-query attention (num_key_value_heads != num_attention_heads)")
    if head_dim * hf_cfg.num_attention_heads != hf_cfg.hidden_size:
        problems.append("head_dim x heads != hidden_size")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        problems.append("biases")
    if not getattr(hf_cfg, "tie_word_embeddings", False):
        problems.append("untied input and output embeddings")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    if getattr(hf_cfg, "use_sliding_window", False):
        problems.append("sliding-window attention")
    if getattr(hf_cfg, "hidden_act", "silu") not in ("silu", "swish"):  # SwiGLU's gate; the same function
        problems.append(f"activation {hf_cfg.hidden_act!r} (SwiGLU needs silu)")
    if problems:
        raise ValueError("this Llama checkpoint is outside the tiny-llm family: " + ", ".join(problems))
    return ModelConfig(vocab_size=hf_cfg.vocab_size, dim=hf_cfg.hidden_size, n_layers=hf_cfg.num_hidden_layers,
                       n_heads=hf_cfg.num_attention_heads, hidden_dim=hf_cfg.intermediate_size,
                       max_seq_len=hf_cfg.max_position_embeddings, norm_eps=hf_cfg.rms_norm_eps,
                       rope_theta=float(theta), qk_norm=hf_cfg.model_type == "qwen3")


def from_hf(hf_model):
    """A Transformer with the weights of a transformers LlamaForCausalLM of the tiny-llm family."""
    model = Transformer(config_from_hf(hf_model.config))
    src = hf_model.state_dict()
    with torch.no_grad():
        for name, target in hf_named_tensors(model).items():
            target.copy_(src[name])
    return model


# A transformers folder's weights: one file, or the shards its index names; safetensors first, and each single file
# before its index, as transformers' from_pretrained picks them (so the shapes checked are those it loads).
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def weight_files(folder):
    """The weight files of a transformers folder that from_pretrained loads ([] when it holds none)."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                return sorted({folder / shard for shard in json.loads(index.read_text())["weight_map"].values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return []  # a broken index: from_pretrained says what is wrong with it
    return []


def stored_shapes(folder):
    """{name: shape} of the tensors in a transformers folder's weight files, read from their headers (the data
    is not loaded); None when there is no weight file or one cannot be read (from_pretrained then says why)."""
    files, shapes = weight_files(folder), {}
    if not files:
        return None
    try:
        for path in files:
            if path.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(path), framework="pt") as f:
                    shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            else:  # memory-mapped: only what the shapes need is read
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                shapes.update({k: tuple(v.shape) for k, v in state.items()})
    except Exception:  # truncated or foreign files: from_pretrained's own error names them
        return None
    return shapes


def _shape_of_weights(shapes):
    """The config.json fields that the stored tensors fix, as far as their names and shapes tell."""
    held = {}
    layers = {int(m.group(1)) for m in (re.match(r"model\.layers\.(\d+)\.", n) for n in shapes) if m}
    if layers:
        held["num_hidden_layers"] = max(layers) + 1
    embedding = shapes.get("model.embed_tokens.weight")
    if embedding is not None and len(embedding) == 2:
        held["vocab_size"], held["hidden_size"] = embedding
    gate = shapes.get("model.layers.0.mlp.gate_proj.weight")
    if gate is not None and len(gate) == 2:
        held["intermediate_size"] = gate[0]
    return held


def weights_mismatch(hf_cfg, shapes):
    """None when the stored tensors (`shapes`, {name: shape}) are exactly the ones hf_cfg describes: every one
    used, each of the shape the model is built with. Else one line naming what config.json says and what the
    weights hold: a config that is smaller than its weights would drop weights, a different width would fail."""
    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = Transformer(config_from_hf(hf_cfg))
    expected = {name: tuple(t.shape) for name, t in hf_named_tensors(model).items()}
    # rotary tables (rotary_emb.inv_freq, which some transformers versions save) are computed from rope_theta, not
    # weights; a tied LM head saved beside the embedding is checked against it by value (checkpoint.py) when its
    # shape is the embedding's
    held = {n: s for n, s in shapes.items() if not n.endswith("rotary_emb.inv_freq")
            and not (n == "lm_head.weight" and s == expected["model.embed_tokens.weight"])}
    if held == expected:
        return None
    said = {"num_hidden_layers": hf_cfg.num_hidden_layers, "vocab_size": hf_cfg.vocab_size,
            "hidden_size": hf_cfg.hidden_size, "intermediate_size": hf_cfg.intermediate_size}
    fields = [f"{k}={said[k]} but the weights hold {v}" + (" layers" if k == "num_hidden_layers" else "")
              for k, v in _shape_of_weights(held).items() if said[k] != v]
    if not fields:  # the fields agree, the tensors do not: name the first few that differ
        extra = sorted(set(held) - set(expected))[:3]
        missing = sorted(set(expected) - set(held))[:3]
        wrong = [f"{n} is {held[n]} where config.json gives {expected[n]}" for n in expected
                 if n in held and held[n] != expected[n]][:3]
        fields = [f"the weights hold {', '.join(extra)}, which config.json has no place for"] * bool(extra) + \
                 [f"the weights lack {', '.join(missing)}"] * bool(missing) + wrong
        return f"its weights do not match config.json: {'; '.join(fields)}; export the folder again"
    return (f"config.json says {'; '.join(fields)}; make config.json match the weights (or export the "
            f"folder again)")
