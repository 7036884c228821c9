"""The model's and the transformers bridge's bounds: the documented preset constants, the config's checks, targets
below zero, the residual dtype outside autocast, a Llama config outside the family in each way hf.config_from_hf
names, the weight files init_from reads, and the export's own check that every weight is set."""
import json
import re
from pathlib import Path

import pytest
import torch

import checkpoint
import hf
import model
from model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**overrides):
    fields = dict(vocab_size=256, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_seq_len=32)
    return ModelConfig(**dict(fields, **overrides))


def seeded(config, seed=0, **kwargs):
    torch.manual_seed(seed)
    return Transformer(config, **kwargs)


def tokens(config, batch=2, length=16, seed=1):
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- model.py: presets and config checks

def test_every_preset_has_the_norm_epsilon_rotary_base_heads_and_context_the_readme_gives():
    """The README's preset section says what every preset shares; a preset default drifting from it changes the
    model of every run that does not set the field (and its recipe identity), with nothing else noticing."""
    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"All have heads of (\d+), SwiGLU, RMSNorm \(eps ([0-9.e+-]+)\), rotary positions \(theta "
                     r"(\d+)\), tied embeddings, no biases, context (\d+) by default", text)
    assert said, "the README's preset paragraph moved: update this test's pattern"
    head_dim, eps, theta, context = int(said[1]), float(said[2]), float(said[3]), int(said[4])
    for name, preset in model.PRESETS.items():
        assert (preset.head_dim, preset.norm_eps, preset.rope_theta, preset.max_seq_len) == \
            (head_dim, eps, theta, context), name
    assert ModelConfig().norm_eps == eps and ModelConfig().rope_theta == theta  # a hand-made config's too


@pytest.mark.parametrize("field", ["vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len"])
def test_a_size_of_zero_is_refused_naming_the_field(field):
    """Zero is no size: a zero width or vocabulary built an empty model, zero heads a ZeroDivisionError."""
    with pytest.raises(ValueError, match=f"model {field} must be a positive integer, got 0"):
        tiny_config(**{field: 0})


def test_an_odd_head_size_is_refused_for_the_rotary_halves():
    """Rotary positions rotate a head's two halves against each other: a head of 3 has none, and failed in the
    first forward with a shape error instead of at the config."""
    with pytest.raises(ValueError, match=r"head size 3 \(width / heads\) must be even for rotary positions"):
        tiny_config(dim=6, n_heads=2)


def test_a_norm_epsilon_of_zero_is_the_bound_the_refusal_names_and_gives_finite_logits():
    """'at least 0': zero itself is a model (RMSNorm without its epsilon), finite on non-zero embeddings."""
    config = tiny_config(norm_eps=0.0)
    with torch.no_grad():
        logits = seeded(config)(tokens(config))
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="norm_eps must be a finite number of at least 0, got -1e-06"):
        tiny_config(norm_eps=-1e-6)


def test_a_target_below_zero_other_than_minus_100_is_one_clear_error():
    """-100 is the ignored target; any other negative id reached the cross-entropy kernel, whose error (an
    IndexError on the CPU, a device assert on a GPU) names neither the targets nor the range."""
    config = tiny_config()
    m = seeded(config)
    x = tokens(config, 1, 10)
    y = tokens(config, 1, 10, seed=2)
    y[0, 0] = -100  # ignored: accepted
    m(x, y)
    y[0, 3] = -1
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 256\) or be -100 \(ignored\), got -1 to "):
        m(x, y)


def test_a_bf16_residual_stream_is_declared_for_autocast_only():
    """residual_dtype=bfloat16 rounds the stream under autocast; outside it (an evaluation or sampling in float32)
    the model is the float32 one, exactly."""
    config = tiny_config()
    x = tokens(config)
    with torch.no_grad():
        plain = seeded(config)(x)
        declared = seeded(config, residual_dtype="bfloat16")(x)
    assert declared.dtype == torch.float32 and torch.equal(declared, plain)


def test_an_fp8_head_with_a_loss_that_has_no_fp8_form_is_refused_at_construction():
    """The settings refuse it for train.py; a model built by hand must too, or its first training forward calls
    None."""
    with pytest.raises(ValueError, match="lm_head_fp8 runs inside a loss with an FP8 form; loss_impl 'full' has none"):
        Transformer(tiny_config(), loss_impl="full", lm_head_fp8=True)


# ---------------------------------------------------------------- hf.py: the family's bounds

def llama_config(**changes):
    """transformers' config of a tiny model of the family (Qwen3's with qk_norm=True), then `changes` set on it."""
    qk_norm = changes.pop("qk_norm", False)
    cfg = hf.hf_config(tiny_config(qk_norm=qk_norm))
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize("changes, words", [
    # a head size of its own (Gemma's, some Qwen3's): our model derives it from the width, so the weights misfit
    (dict(head_dim=16), "head_dim x heads != hidden_size"),
    (dict(attention_bias=True), "biases"),
    (dict(mlp_bias=True), "biases"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope scaling 'linear'"),
    (dict(qk_norm=True, use_sliding_window=True, sliding_window=16), "sliding-window attention"),
], ids=["head_dim", "attention_bias", "mlp_bias", "rope_scaling", "sliding_window"])
def test_a_llama_config_outside_the_family_is_refused_naming_what(changes, words):
    """Each of these loads into our model with the wrong function (no biases, unscaled rotary, full attention) or
    not at all: refused in one sentence saying which."""
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        hf.config_from_hf(llama_config(**changes))
    assert str(refused.value).startswith("this Llama checkpoint is outside the tiny-llm family: ")


def test_a_swish_activation_is_silu_and_computes_transformers_logits():
    """transformers names SiLU both silu and swish; a checkpoint saying swish is the family's SwiGLU."""
    from transformers import LlamaForCausalLM
    config = tiny_config()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(llama_config(hidden_act="swish")).eval()
    ours = hf.from_hf(reference).eval()
    x = tokens(config)
    with torch.no_grad():
        assert torch.allclose(ours(x), reference(input_ids=x).logits, rtol=0, atol=1e-5)


def test_the_export_keeps_bos_and_eos_apart():
    """to_hf's bos and eos go where transformers reads them: generate() stops at eos_token_id."""
    exported = hf.to_hf(seeded(tiny_config()), bos_token_id=1, eos_token_id=2)
    assert (exported.config.bos_token_id, exported.config.eos_token_id) == (1, 2)
    assert (exported.generation_config.bos_token_id, exported.generation_config.eos_token_id) == (1, 2)


# ---------------------------------------------------------------- hf.py: the weight files init_from reads

def export(folder, config=None):
    m = seeded(config or tiny_config())
    hf.to_hf(m).save_pretrained(folder)
    return m


def test_safetensors_are_the_weights_read_beside_a_pytorch_bin(tmp_path):
    """from_pretrained loads model.safetensors when a pytorch_model.bin lies beside it, so the shapes checked
    against config.json are the safetensors': a stale .bin of another model must not refuse a good folder."""
    folder = tmp_path / "hf"
    m = export(folder)
    stale = hf.to_hf(seeded(tiny_config(n_layers=3)))
    torch.save({k: v for k, v in stale.state_dict().items() if k != "lm_head.weight"}, folder / "pytorch_model.bin")
    loaded = checkpoint.initial_weights(folder)
    assert loaded.config == m.config
    assert all(torch.equal(loaded.state[k], v) for k, v in m.state_dict().items())


def test_a_pytorch_bin_folder_is_checked_and_loaded_as_a_safetensors_one(tmp_path):
    """A folder holding pytorch_model.bin (older transformers' format): its shapes are read from it, so a good one
    loads and a config.json that disagrees with it is refused naming the field."""
    m = seeded(tiny_config())
    exported = hf.to_hf(m)
    folder = tmp_path / "bin"
    exported.config.save_pretrained(folder)
    torch.save({k: v.clone() for k, v in exported.state_dict().items() if k != "lm_head.weight"},
               folder / "pytorch_model.bin")
    loaded = checkpoint.initial_weights(folder)
    assert all(torch.equal(loaded.state[k], v) for k, v in m.state_dict().items())
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(saved, intermediate_size=256)))
    with pytest.raises(ValueError, match="config.json says intermediate_size=256 but the weights hold 128"):
        checkpoint.initial_weights(folder)


def test_rotary_tables_saved_beside_the_weights_are_not_weights(tmp_path):
    """Some transformers versions saved each layer's rotary_emb.inv_freq: it is computed from rope_theta, so a
    folder holding it is the same model, not one with tensors config.json has no place for."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "hf"
    m = export(folder)
    weights = load_file(folder / "model.safetensors")
    inv_freq = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(16) for i in range(2)}
    save_file(dict(weights, **inv_freq), folder / "model.safetensors", metadata={"format": "pt"})
    loaded = checkpoint.initial_weights(folder)
    assert all(torch.equal(loaded.state[k], v) for k, v in m.state_dict().items())


def test_a_broken_weight_index_is_one_line_naming_the_folder(tmp_path):
    """An index that is not JSON: from_pretrained says what is wrong with it, through init_from's one line, not
    a JSONDecodeError from reading the shapes."""
    folder = tmp_path / "hf"
    export(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError) as refused:
        checkpoint.initial_weights(folder)
    message = str(refused.value)
    assert message.startswith(f"init_from {str(folder)!r}: its weights could not be loaded") and "\n" not in message


def test_a_transformers_weight_the_export_leaves_unset_is_refused(monkeypatch):
    """to_hf's check that every weight of the transformers model gets one of ours: a mapping that missed one
    would export that weight at its random initialization."""
    named = hf.hf_named_tensors
    monkeypatch.setattr(hf, "hf_named_tensors", lambda m, of=lambda p: p: {
        k: v for k, v in named(m, of).items() if k != "model.layers.1.mlp.down_proj.weight"})
    with pytest.raises(RuntimeError, match=r"weights do not map onto LlamaForCausalLM: missing "
                                           r"\['model.layers.1.mlp.down_proj.weight'\], unexpected \[\]"):
        hf.to_hf(seeded(tiny_config()))
