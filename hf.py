"""transformers interop: our model as a LlamaForCausalLM and back, weight for weight.

The tiny-llm family is Llama with heads that are all query heads (no grouped-query attention), tied
embeddings, no biases, SwiGLU and default rotary positions; a Llama outside it is refused in one sentence.
"""
import torch

from model import ModelConfig, Transformer


def hf_config(config, bos_token_id=None, eos_token_id=None, pad_token_id=None):
    """transformers' LlamaConfig of our ModelConfig; the special token ids come from the token cache the model
    was trained on (None where the caller has none)."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def hf_named_tensors(model, of=lambda p: p):
    """Our weights (or, with of=lambda p: p.grad, their gradients) under transformers' Llama names.

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
    return out


def to_hf(model, bos_token_id=None, eos_token_id=None, pad_token_id=None):
    """A transformers LlamaForCausalLM with this model's weights (float32, on the CPU); the token ids go into its
    config and generation config (eos_token_id is where generate() stops)."""
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM(hf_config(model.config, bos_token_id, eos_token_id, pad_token_id))
    state = {k: v.detach().float().cpu().clone() for k, v in hf_named_tensors(model).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


def config_from_hf(hf_cfg):
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    problems = []
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
    if getattr(hf_cfg, "hidden_act", "silu") not in ("silu", "swish"):  # SwiGLU's gate; the same function
        problems.append(f"activation {hf_cfg.hidden_act!r} (SwiGLU needs silu)")
    if problems:
        raise ValueError("this Llama checkpoint is outside the tiny-llm family: " + ", ".join(problems))
    return ModelConfig(vocab_size=hf_cfg.vocab_size, dim=hf_cfg.hidden_size, n_layers=hf_cfg.num_hidden_layers,
                       n_heads=hf_cfg.num_attention_heads, hidden_dim=hf_cfg.intermediate_size,
                       max_seq_len=hf_cfg.max_position_embeddings, norm_eps=hf_cfg.rms_norm_eps,
                       rope_theta=float(theta))


def from_hf(hf_model):
    """A Transformer with the weights of a transformers LlamaForCausalLM of the tiny-llm family."""
    model = Transformer(config_from_hf(hf_model.config))
    src = hf_model.state_dict()
    with torch.no_grad():
        for name, target in hf_named_tensors(model).items():
            target.copy_(src[name])
    return model
