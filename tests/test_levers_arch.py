"""The architecture levers (#38, model.py): each one's math against a plain reference written here (through the full
and fused losses), its parameters and FLOPs, training with a bitwise resume, compilation, DDP, the combinations
refused, and the export rule (hf.py); and the levers removed after their screens, refused by name.
tests/test_model.py holds the exported lever's parity with transformers."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import checkpoint
import hf
import model
import optim
import plan
import settings
import train
from configurator import ConfigError
from tests.test_train import assert_ddp_update_equals_one_process, checkpoint_parameters, small_config

# each lever on, as a recipe sets it
LEVERS = {"qk_norm": dict(qk_norm=True), "value_embeddings": dict(value_embeddings=1)}
ALL = {k: v for lever in LEVERS.values() for k, v in lever.items()}


def tiny(n_layers=2, **levers):
    return model.get_preset("20m", vocab_size=256, dim=32, n_layers=n_layers, n_heads=2, hidden_dim=64,
                            max_seq_len=32, **levers)


def perturbed(config, **kwargs):
    """A model whose every parameter is random (gains and mixes too), so that every lever's parameter takes part in
    the comparison."""
    torch.manual_seed(0)
    m = model.Transformer(config, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0.0, 0.1)
    return m


def batch(config, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    y = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    y[0, :3] = -100
    return x, y


# ---------------------------------------------------------------- the math, against a plain reference

def rms(x, gain, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rotate(x, theta):
    """transformers' rotate-half rotary embedding of x (B, T, H, D)."""
    T, D = x.shape[1], x.shape[-1]
    angles = torch.outer(torch.arange(T).float(), 1.0 / theta ** (torch.arange(0, D, 2).float() / D))
    cos, sin = (f(torch.cat((angles, angles), -1))[:, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attend(q, k, v):
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    T = q.shape[1]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


def reference_logits(m, idx):
    """The model's logits, each lever's math as model.py's docstrings declare it, written out plainly."""
    c, (B, T) = m.config, idx.shape
    x, eps = m.tok_embeddings.weight[idx], c.norm_eps
    ves = [table.weight[idx] for table in m.value_embeds]
    n, k = c.n_layers, c.value_embeddings
    for i, layer in enumerate(m.layers):
        a, ff = layer.attention, layer.feed_forward
        h = rms(x, layer.attention_norm.weight, eps)
        q, kk, v = (t.reshape(B, T, c.n_heads, c.head_dim) for t in (h @ a.wqkv.weight.t()).split(c.dim, -1))
        if c.qk_norm:
            q, kk = rms(q, a.q_norm.weight, eps), rms(kk, a.k_norm.weight, eps)
        table = i if i < k else i - (n - k) if i >= n - k else None
        if table is not None:
            v = a.value_lambdas[0] * v + a.value_lambdas[1] * ves[table].reshape(v.shape)
        x = x + attend(rotate(q, c.rope_theta), rotate(kk, c.rope_theta), v).reshape(B, T, c.dim) @ a.wo.weight.t()
        gate, up = (rms(x, layer.ffn_norm.weight, eps) @ ff.w13.weight.t()).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ ff.w2.weight.t()
    return rms(x, m.norm.weight, eps) @ m.tok_embeddings.weight.t()


# (blocks, levers): each lever, and both over 5 blocks (an odd middle block, which takes no value embedding)
MATH_CASES = {name: (2, lever) for name, lever in LEVERS.items()}
MATH_CASES["all"] = (5, dict(ALL, value_embeddings=2))


@pytest.mark.parametrize("n_layers, levers", MATH_CASES.values(), ids=MATH_CASES.keys())
def test_each_lever_computes_its_declared_math(n_layers, levers):
    config = tiny(n_layers=n_layers, **levers)
    x, y = batch(config)
    for impl in ("full", "fused"):
        m = perturbed(config, loss_impl=impl, loss_chunk_tokens=20)
        with torch.no_grad():
            expected = reference_logits(m, x)
            assert torch.allclose(m(x), expected, rtol=1e-5, atol=1e-5), impl
            loss = F.cross_entropy(expected.flatten(0, 1), y.flatten(), ignore_index=-100)
            assert torch.allclose(m(x, y), loss, rtol=1e-5), impl  # evaluation's losses-only op with fused
        assert torch.allclose(m(x, y), loss, rtol=1e-5), impl  # training's loss, with gradients


def test_the_levers_own_parameters_and_their_start():
    m = model.Transformer(tiny(n_layers=4, **dict(ALL, value_embeddings=2)))
    names = dict(m.named_parameters())
    assert m.output.weight is m.tok_embeddings.weight and "output.weight" not in names  # tied: counted once
    mixes = [f"layers.{i}.attention.value_lambdas" for i in range(4)]
    assert [n for n in names if n.endswith("value_lambdas")] == mixes
    assert all(torch.equal(names[f"layers.{i}.attention.value_lambdas"], torch.full((2,), 0.5)) for i in range(4))
    assert torch.equal(names["layers.1.attention.q_norm.weight"], torch.ones(16))  # a gain per head dimension
    assert model.value_embedding_layers(tiny(n_layers=5, value_embeddings=2)) == [0, 1, None, 0, 1]


@pytest.mark.parametrize("levers", [{}, *LEVERS.values(), dict(ALL, value_embeddings=2)],
                         ids=["none", *LEVERS, "all"])
def test_parameter_count_and_flops_follow_the_levers(levers):
    config = tiny(n_layers=4, **levers)
    assert model.parameter_count(config) == sum(p.numel() for p in model.Transformer(config).parameters())
    assert model.flops_per_token(config, 32) == model.flops_per_token(tiny(n_layers=4), 32)  # no lever adds a matmul


# the weights of tiny() under torch.manual_seed(0) as model.py made them before the levers (git d157bd4)
TODAYS_INIT = "08303d12505de202ff196f4cc061d2e8c45f0841726c678e327ef3463ead283f"


@pytest.mark.parametrize("levers", [{}, dict(ALL, value_embeddings=2)], ids=["none", "all"])
def test_the_initialisation_is_the_documented_one(levers):
    """reset_parameters draws, in the parameters' order, with the stds its docstring gives: the output projections
    (wo, w2) 0.02 / sqrt(2 x layers), every other matrix (the embedding, the value embeddings' tables, wqkv, w13)
    0.02, the norms' gains 1, the value-embedding mixes 0.5 each; and a new model is initialised so."""
    config = tiny(n_layers=4, **levers)
    m = model.Transformer(config)
    stds = {"wo": 0.02 / math.sqrt(8), "w2": 0.02 / math.sqrt(8)}
    matrices = {n for n, p in m.named_parameters() if p.dim() == 2}
    assert {n.split(".")[-2] for n in matrices} >= {"wo", "w2", "wqkv", "w13"}
    for name in matrices:  # a new model: each matrix's spread within 10% of its std (1,024 to 8,192 draws)
        assert m.get_parameter(name).std().item() == pytest.approx(stds.get(name.split(".")[-2], 0.02), rel=0.1)
    torch.manual_seed(0)
    m.reset_parameters()
    torch.manual_seed(0)
    for name, p in m.named_parameters():
        if name.endswith("value_lambdas"):
            expected = torch.full_like(p, 0.5)
        elif p.dim() == 1:
            expected = torch.ones_like(p)
        else:
            expected = torch.empty_like(p).normal_(0.0, stds.get(name.split(".")[-2], 0.02))
        assert torch.equal(p, expected), name


def test_every_lever_off_is_todays_model_and_identity():
    """Off, the levers leave the model as it was: its state_dict names, its weights under a seed, its model config's
    dict (what a recipe identity hashes and an old checkpoint holds)."""
    torch.manual_seed(0)
    m = model.Transformer(tiny())
    block = ["attention_norm.weight", "attention.wqkv.weight", "attention.wo.weight", "ffn_norm.weight",
             "feed_forward.w13.weight", "feed_forward.w2.weight"]
    assert list(m.state_dict()) == ["tok_embeddings.weight", *[f"layers.{i}.{n}" for i in range(2) for n in block],
                                    "norm.weight", "output.weight"]
    assert checkpoint.weights_sha256(m.state_dict()) == TODAYS_INIT
    assert not set(model.LEVERS) & set(tiny().to_dict())
    assert tiny(qk_norm=True).to_dict()["qk_norm"] is True
    assert model.ModelConfig(**tiny(qk_norm=True).to_dict()) == tiny(qk_norm=True)  # a checkpoint's dict


def test_value_embeddings_are_adamw_tables_under_muon():
    m = model.Transformer(tiny(**dict(ALL, value_embeddings=1)))
    opt = optim.build_optimizer(m, dict(settings.defaults(settings.TrainSettings), optimizer="muon"), "cpu")
    in_muon = {id(p) for group in opt.muon.param_groups for p in group["params"]}
    assert id(m.value_embeds[0].weight) not in in_muon and id(m.output.weight) not in in_muon
    assert id(m.layers[0].attention.wqkv.weight) in in_muon


# ---------------------------------------------------------------- training, resume, compile, DDP

@pytest.mark.parametrize("levers", LEVERS.values(), ids=LEVERS.keys())
def test_a_lever_trains_and_resumes_bitwise(text_cache, tmp_path, levers):
    """One epoch of 3 updates straight, and stopped after 2 then resumed: the same validation loss and weights, bit
    for bit; the recipe holds the lever (its identity), and the checkpoint's model config rebuilds it."""
    straight = train.train(small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"),
                                        epochs=1, **levers))
    cfg = small_config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), epochs=1, **levers)
    assert train.train(settings.Config(cfg, stop_after_updates=2))["status"] == "interrupted"
    resumed = train.train(settings.Config(cfg, resume=True))
    assert resumed["status"] == "complete" and resumed["sessions"] == 2
    assert resumed["final_validation"]["loss"] == straight["final_validation"]["loss"]
    a, b = checkpoint_parameters(tmp_path / "straight"), checkpoint_parameters(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    key, value = next(iter(levers.items()))
    assert resumed["recipe"][key] == value and resumed["recipe"]["model"][key] == value
    rebuilt, _ = checkpoint.load_model(tmp_path / "resumed" / "ckpt.pt")  # as sample.py and evaluate.py do
    assert getattr(rebuilt.config, key) == value


def test_all_levers_compile_to_the_eager_loss_and_gradients():
    """Every lever on, with the fused loss, under torch.compile in one graph (fullgraph). aot_eager: the
    capture and autograd that a lever could break; inductor's own code is the same on every model (and takes a
    minute on 2 CPU cores)."""
    config = tiny(**ALL)
    x, y = batch(config)
    eager, compiled = (perturbed(config, loss_impl="fused", loss_chunk_tokens=20) for _ in range(2))
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True, dynamic=False)
    losses = [run(x, y) for run in (eager, step)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[1], losses[0], rtol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-7), name


def test_all_levers_under_bf16_autocast_keep_the_kernels_dtypes_and_the_loss(monkeypatch):
    """As the GPU trains (bf16 autocast): q, k and v reach attention in bf16 whatever the levers add in float32
    (gains, mixes, tables; the fa4 backend's op is outside autocast's reach), and the loss stays within bf16's
    rounding of float32's."""
    config = tiny(**ALL)
    x, y = batch(config)
    m = perturbed(config, loss_impl="fused", loss_chunk_tokens=20)
    dtypes = []
    attention = model.causal_attention
    monkeypatch.setattr(model, "causal_attention", lambda q, k, v, b, windows=None:
                        dtypes.append((q.dtype, k.dtype, v.dtype)) or attention(q, k, v, b, windows))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x, y)
    loss.backward()
    assert dtypes == [(torch.bfloat16,) * 3] * config.n_layers
    assert loss.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in m.parameters())
    assert loss.item() == pytest.approx(m(x, y).item(), rel=2e-2)


def test_all_levers_under_ddp_equal_one_process(text_cache, tmp_path):
    """Two gloo processes with every lever on: one process's losses and weights."""
    assert_ddp_update_equals_one_process(small_config(text_cache, tmp_path, micro_batch_size=2, **ALL), tmp_path)


# ---------------------------------------------------------------- combinations refused, and the export rule

@pytest.mark.parametrize("change, words", [
    (dict(value_embeddings=2, n_layers=3), "value_embeddings 2 needs 2 x 2 blocks"),
    (dict(value_embeddings=-1), "value_embeddings must be 0 or more")])
def test_a_lever_that_cannot_be_right_is_one_config_error(change, words):
    cfg = settings.Config(settings.defaults(settings.TrainSettings), **change)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        settings.check(settings.TrainSettings, cfg)
        plan.model_config(cfg, 256)


def test_init_from_takes_the_weights_levers_and_refuses_a_contradiction(tmp_path):
    """The weights' levers are the run's (those the settings leave off too); a lever set to another value than
    theirs is refused."""
    weights = tiny(qk_norm=True, value_embeddings=1)
    initial = checkpoint.InitialWeights(weights, {}, "sha", "checkpoint")
    cfg = small_config(tmp_path, tmp_path, dim=0, n_layers=0, n_heads=0, hidden_dim=0, qk_norm=True)
    assert plan.initial_model_config(cfg, initial) == dataclasses.replace(weights, max_seq_len=cfg.seq_len)
    with pytest.raises(ConfigError, match=r"value_embeddings=2 \(the weights' model has 1\)"):
        plan.initial_model_config(settings.Config(cfg, value_embeddings=2), initial)


@pytest.mark.parametrize("lever", hf.NOT_EXPORTED)
def test_export_refuses_a_lever_no_transformers_class_computes(tmp_path, lever):
    import sample
    m = model.Transformer(tiny(**{lever: ALL[lever]}))
    with pytest.raises(sample.SampleError, match=f"--export_hf cannot export {lever}=") as refused:
        sample.export(m, None, tmp_path / "hf")
    assert "\n" not in str(refused.value) and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------- the levers removed after their screens

REMOVED_ON = {"mlp_activation": "relu2", "zero_init_proj": True, "logit_softcap": 15.0, "tie_embeddings": False,
              "unet_skips": True, "bigram_embeddings": 32000, "smear": True}
REMOVED_AT = {"bigram_embeddings": "6921dcb", "smear": "6921dcb", "dropout": "4e6b149"}  # the others left at 94da7b6


def removed_sentence(named):
    key = named.split("=")[0]
    return (f"{named} was a time-to-quality lever removed after its screen (docs/TIME_TO_QUALITY.md); the code that "
            f"ran it is in commit {REMOVED_AT.get(key, '94da7b6')}")


def test_a_checkpoint_with_a_removed_lever_off_loads_and_one_on_is_refused_naming_it(tmp_path):
    """A model config saved while the removed levers existed may hold them at their off values: it is the model as
    it is now, and loads; one switched on is refused in one sentence naming the lever and the commit that ran it."""
    saved = dict(tiny(qk_norm=True).to_dict(), **{k: model.REMOVED_LEVERS[k] for k in REMOVED_ON})
    assert model.ModelConfig.from_dict(saved) == tiny(qk_norm=True)
    for key, on in REMOVED_ON.items():
        with pytest.raises(ValueError) as refused:
            model.ModelConfig.from_dict(dict(saved, **{key: on}))
        assert str(refused.value) == removed_sentence(f"{key}={on}")
    weights, path = model.Transformer(tiny(qk_norm=True)), tmp_path / "ckpt.pt"
    save = lambda config: torch.save(dict(model=weights.state_dict(), model_config=config, step=1,
                                          config={"data_dir": "data"}), path)
    save(saved)
    loaded, _ = checkpoint.load_model(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), weights.state_dict().values()))
    save(dict(saved, logit_softcap=15.0))
    with pytest.raises(ValueError) as refused:
        checkpoint.load_model(path)
    assert str(refused.value) == f"checkpoint {path}: " + removed_sentence("logit_softcap=15.0")


@pytest.mark.parametrize("key", model.REMOVED_LEVERS)
def test_a_removed_lever_s_key_is_refused_naming_the_commit_that_ran_it(tmp_path, key):
    config_file = tmp_path / "recipe.py"
    config_file.write_text(f"{key} = {model.REMOVED_LEVERS[key]!r}\n")
    for args, where in (([f"--{key}=1"], f"--{key}"), ([str(config_file)], f"config file {config_file}")):
        with pytest.raises(ConfigError) as refused:
            settings.load(settings.TrainSettings, args)
        assert str(refused.value) == (f"{where}: {removed_sentence(key)}; leave the key out (the run is then the "
                                      f"lever off)")
