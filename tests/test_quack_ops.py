"""model_kernels/quack_ops.py: loss_impl "quack_chunked" and mlp_impl "quack". quack's kernels need a Hopper GPU, so the
CPU tests what runs without them: the refusal elsewhere, the declaration, the shape rules, and the layout mapping, against quack's reference functions (quack/gemm_interface.py: gemm_ref, gemm_gated_ref,
gemm_dgated_ref; quack/linear_cross_entropy.py: linear_cross_entropy_func_ref) written out here in plain torch."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import configurator
import env
import model as model_lib
import settings
import train
from configurator import ConfigError
from model_kernels import quack_ops, registry
from model_kernels.swiglu import swiglu_down
from settings import TrainSettings
from trainer import Trainer
from tests.test_model import random_batch, relative_error, seeded_model, tiny_config
from tests.test_train import small_config
import plan

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- quack's reference semantics, in plain torch

GATED = {"swiglu": lambda gate, up: F.silu(gate) * up}  # gemm_interface.gated_to_pytorch_fn_map


def concat_interleave(t):
    """gemm_interface._concat_interleave: the halves [first; second] of t's non-contiguous dimension, interleaved
    (first_0, second_0, first_1, ...)."""
    dim = -2 if t.stride(-1) == 1 else -1
    return t.unflatten(dim, (2, t.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def gemm_ref(a, b, concat=()):
    """gemm_ref: a @ b, b read interleaved under concat "B", the output's rows put back as [first; second] under
    concat "out"."""
    out = a @ (concat_interleave(b) if "B" in concat else b)
    return torch.cat([out[..., ::2, :], out[..., 1::2, :]], dim=-2) if "out" in concat else out


def gemm_gated_ref(a, b, activation, concat=()):
    """gemm_gated_ref: (preact, postact), the gate and up columns of preact interleaved."""
    preact = gemm_ref(a, b, concat)
    return preact, GATED[activation](preact[..., ::2], preact[..., 1::2])


def gemm_dgated_ref(a, b, preact, activation):
    """gemm_dgated_ref: (dpreact, interleaved as preact; postact again) for the upstream gradient a @ b."""
    gate, up = (preact[..., i::2].detach().requires_grad_() for i in (0, 1))
    with torch.enable_grad():
        postact = GATED[activation](gate, up)
        dgate, dup = torch.autograd.grad(postact, [gate, up], a @ b)
    return torch.stack([dgate, dup], dim=-1).reshape(preact.shape), postact.detach()


class QuackMLPReference(torch.autograd.Function):
    """quack.mlp.mlp_func without recompute, call by call as it runs them: forward gemm_gated (concat "B") and a
    gemm; backward gemm_dgated, then dw2, dx (concat "B") and dw1 (concat "out")."""

    @staticmethod
    def forward(ctx, x, weight1, weight2, activation, concat_layout):
        batch_shape, x = x.shape[:-1], x.flatten(0, -2)
        preact, postact = gemm_gated_ref(x, weight1.T, activation, ("B",) if concat_layout else ())
        ctx.save_for_backward(x, weight1, weight2, preact)
        ctx.activation, ctx.concat_layout = activation, concat_layout
        return gemm_ref(postact, weight2.T).reshape(*batch_shape, weight2.shape[0])

    @staticmethod
    def backward(ctx, dout):
        x, weight1, weight2, preact = ctx.saved_tensors
        batch_shape, dout = dout.shape[:-1], dout.flatten(0, -2)
        dpreact, postact = gemm_dgated_ref(dout, weight2, preact, ctx.activation)
        dweight2 = gemm_ref(dout.T, postact)
        dx = gemm_ref(dpreact, weight1, ("B",) if ctx.concat_layout else ())
        dweight1 = gemm_ref(dpreact.T, x, ("out",) if ctx.concat_layout else ())
        return dx.reshape(*batch_shape, -1), dweight1, dweight2, None, None


def our_mlp(x, w13, w2):
    """FeedForward's math on the CPU: the w13 matmul, then silu(gate) * up and the down projection."""
    return swiglu_down(F.linear(x, w13), w2)


def outputs_and_gradients(fn, inputs, probe):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out * probe).sum().backward()
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.fixture
def quack_stand_in(monkeypatch):
    """quack's two entry points as its reference functions (its kernels need a Hopper GPU), recording the
    arguments each call gets."""
    calls = []

    def mlp_func(x, weight1, weight2, activation, bias1=None, bias2=None, fuse_grad_accum=False, tuned=True,
                 recompute=False, concat_layout=False):
        calls.append(dict(fn="mlp_func", activation=activation, bias1=bias1, bias2=bias2, tuned=tuned,
                          concat_layout=concat_layout))
        return QuackMLPReference.apply(x, weight1, weight2, activation, concat_layout)

    def chunked_linear_cross_entropy(x, weight, target, chunk_size=4096, ignore_index=-100, reduction="mean",
                                     tuned=True, use_scaled_exp=None):
        calls.append(dict(fn="chunked_linear_cross_entropy", chunk_size=chunk_size, ignore_index=ignore_index,
                          reduction=reduction, use_scaled_exp=use_scaled_exp))
        return F.cross_entropy(F.linear(x, weight), target, ignore_index=ignore_index, reduction=reduction)

    modules = {"quack": {}, "quack.mlp": dict(mlp_func=mlp_func),
               "quack.linear_cross_entropy": dict(chunked_linear_cross_entropy=chunked_linear_cross_entropy)}
    for name, functions in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, name, module)
    return calls


# ---------------------------------------------------------------- the layout mapping

def test_quack_concat_layout_on_our_w13_is_our_mlp_math_forward_and_backward():
    """Our w13 stacks [gate; up]; quack's mlp_func with MLP_ARGUMENTS reads it so, and its backward writes dw13
    back in that layout: output and the gradients of x, w13 and w2 equal FeedForward's, in float64. Its default
    interleaved layout would not."""
    torch.manual_seed(0)
    dim, hidden = 24, 40
    inputs = [torch.randn(2, 5, dim, dtype=torch.float64), torch.randn(2 * hidden, dim, dtype=torch.float64),
              torch.randn(dim, hidden, dtype=torch.float64)]
    probe = torch.randn(2, 5, dim, dtype=torch.float64)
    expected = outputs_and_gradients(our_mlp, inputs, probe)
    args = quack_ops.MLP_ARGUMENTS
    got = outputs_and_gradients(lambda x, w13, w2: QuackMLPReference.apply(x, w13, w2, args["activation"],
                                                                           args["concat_layout"]), inputs, probe)
    for name, a, b in zip(("out", "grad_x", "grad_w13", "grad_w2"), got, expected):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name
    interleaved = outputs_and_gradients(lambda x, w13, w2: QuackMLPReference.apply(x, w13, w2, "swiglu", False),
                                        inputs, probe)
    assert not torch.allclose(interleaved[0], expected[0], rtol=1e-3)


def test_the_model_with_both_quack_choices_trains_the_same_math(quack_stand_in):
    """Transformer(loss_impl="quack_chunked", mlp_impl="quack") through quack's entry points (as their references)
    has the full loss's value and every parameter's gradient; evaluation's per-token losses too. The model is in
    float64, but the full loss takes float32 logits: agreement to float32's precision. Each call gets what quack_ops
    says: the loss summed with -100 ignored over loss_chunk_tokens slices on quack's chunked path, the MLP on our
    [gate; up] w13, no biases."""
    config = tiny_config()
    x, y = random_batch(config, 2, 50)
    reference = seeded_model(config, loss_impl="full").double()
    quack = seeded_model(config, loss_impl="quack_chunked", mlp_impl="quack", loss_chunk_tokens=37).double()
    for reduction in ("sum", "mean"):
        losses = []
        for m in (reference, quack):
            m.zero_grad()
            loss = m(x, y, reduction=reduction)
            (loss * 0.37).backward()
            losses.append(loss.detach().double())
        assert torch.allclose(losses[1], losses[0], rtol=1e-6, atol=0), reduction
        for (name, p), q in zip(reference.named_parameters(), quack.parameters()):
            assert relative_error(q.grad, p.grad) < 1e-5, name
    with torch.no_grad():
        assert torch.allclose(quack(x, y, reduction="none"), reference(x, y, reduction="none"), rtol=1e-6)
    mlp_calls = [c for c in quack_stand_in if c["fn"] == "mlp_func"]
    loss_calls = [c for c in quack_stand_in if c["fn"] != "mlp_func"]
    assert mlp_calls and all(c == dict(fn="mlp_func", activation="swiglu", bias1=None, bias2=None,
                                       tuned=quack_ops.TUNED, concat_layout=True) for c in mlp_calls)
    assert loss_calls == 2 * [dict(fn="chunked_linear_cross_entropy", chunk_size=37, ignore_index=-100,
                                   reduction="sum", use_scaled_exp=False)]  # evaluation uses our losses op


def test_the_trainer_builds_the_model_with_the_configured_quack_choices(quack_stand_in):
    """loss_impl and mlp_impl reach the model the Trainer trains: its update calls quack's loss and its MLP in
    every layer (the settings that refuse them on a CPU are checked before a Trainer is built)."""
    from tests.test_update_graph import run_updates
    cfg = settings.Config(dict(train.DEFAULTS, preset="20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, seq_len=32,
                            device="cpu", cpu_threads=1, tokens_per_update=4 * 32, micro_batch_size=4,
                            loss_impl="quack_chunked", mlp_impl="quack", loss_chunk_tokens=64))
    mcfg = model_lib.get_preset("20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=256, max_seq_len=32)
    trainer = Trainer(cfg, mcfg, "cpu", total_updates=1)
    run_updates(trainer, 1)
    assert [c["fn"] for c in quack_stand_in].count("mlp_func") == mcfg.n_layers
    assert [c for c in quack_stand_in if c["fn"] == "chunked_linear_cross_entropy"] == [dict(
        fn="chunked_linear_cross_entropy", chunk_size=64, ignore_index=-100, reduction="sum", use_scaled_exp=False)]


def test_the_wrappers_trace_into_one_compiled_graph(quack_stand_in):
    """torch.compile traces our wrappers whole (fullgraph: a graph break is an error), quack's import included, so
    that the compiled model and its CUDA graphs keep quack's calls inside; same results as eager."""
    torch.manual_seed(0)
    x, w13, w2 = torch.randn(2, 5, 8), torch.randn(12, 8), torch.randn(8, 6)
    h, weight, targets = torch.randn(10, 8), torch.randn(16, 8), torch.tensor([1, -100, 3, 4, 5, 6, 7, 8, 9, 0])
    for fn, args in ((quack_ops.swiglu_mlp, (x, w13, w2)),
                     (quack_ops.linear_cross_entropy, (h, weight, targets, 128))):
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        assert torch.allclose(compiled(*args), fn(*args)), fn.__name__


def test_an_unknown_mlp_impl_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown mlp_impl 'triton'; valid: torch, quack"):
        model_lib.Transformer(tiny_config(), mlp_impl="triton")


# ---------------------------------------------------------------- settings, device and shapes

@pytest.mark.parametrize("key, value, others", [("loss_impl", "quack_chunked", "full or fused"),
                                                ("mlp_impl", "quack", "torch")])
def test_quack_is_refused_on_the_cpu_in_one_sentence_naming_the_setting_and_what_runs_it(key, value, others):
    cfg = settings.Config(train.DEFAULTS, **{key: value})
    with pytest.raises(ConfigError) as refused:
        plan.check_device(cfg, torch.device("cpu"))
    message = str(refused.value)
    assert message == (f"{key} '{value}' needs a CUDA GPU of compute capability 9.0 and the quack-kernels package "
                       f"(pip install -r requirements-gpu.txt), but this run's device is the cpu; choose {others} "
                       f"instead")


def test_quack_is_refused_on_another_gpu_and_without_the_package(monkeypatch, fake_gpu):
    """The GPU's own rules, with the GPU's answers stood in: none, another capability, then Hopper without quack."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quack_ops.quack_problem(cuda) == "PyTorch sees no CUDA GPU here"
    fake_gpu((8, 0), "NVIDIA A100")
    assert quack_ops.quack_problem(cuda) == "NVIDIA A100 has compute capability 8.0"
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setitem(sys.modules, "quack", None)  # not installed: import quack raises ImportError
    assert quack_ops.quack_problem(cuda).startswith("quack did not import (ModuleNotFoundError")
    with pytest.raises(ConfigError, match=r"^mlp_impl 'quack' needs .* but quack did not import"):
        plan.check_device(settings.Config(train.DEFAULTS, mlp_impl="quack"), cuda)


def test_quack_installed_outside_site_packages_is_named_with_what_to_do(monkeypatch, fake_gpu):
    """quack 0.6.5 installed with pip --target outside a site-packages folder fails its import with a TypeError
    about a semantic key (as it did on the H200); the refusal says where to install it instead."""
    cuda = torch.device("cuda")
    fake_gpu((9, 0))

    class Quack(types.ModuleType):
        def __getattr__(self, name):
            raise TypeError("epilogue fn depends on <ContextVar name='_LOC_TRANSFORMS'>, which has no fail-closed "
                            "semantic key")
    monkeypatch.setitem(sys.modules, "quack", Quack("quack"))
    for name in ("quack.linear_cross_entropy", "quack.mlp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    problem = quack_ops.quack_problem(cuda)
    assert problem.startswith("quack did not import (")
    assert problem.endswith("install requirements-gpu.txt into a site-packages folder (a virtual environment's), "
                            "not with pip install --target into another")
    monkeypatch.setitem(sys.modules, "quack", None)  # any other failure gets no such advice
    assert "site-packages" not in quack_ops.quack_problem(cuda)


def test_mlp_impl_is_declared_in_help_as_an_execution_key_outside_the_recipe(capsys):
    with pytest.raises(SystemExit):
        configurator.load_config(TrainSettings, ["--help"])
    help_line = next(line for line in capsys.readouterr().out.splitlines() if "--mlp_impl=" in line)
    assert "--mlp_impl='torch'" in help_line and "[torch | quack]" in help_line
    assert {"mlp_impl", "loss_impl"} <= settings.execution_keys()
    mcfg = model_lib.get_preset("20m", vocab_size=256)
    recipe = lambda **change: env.hash_json(settings.recipe(settings.Config(train.DEFAULTS, **change), mcfg, "c"))
    assert recipe(mlp_impl="quack", loss_impl="quack_chunked") == recipe()


def test_the_quack_loss_takes_slices_of_rows_its_matmuls_load_whole():
    with pytest.raises(ConfigError, match=r"^loss_impl quack_chunked needs loss_chunk_tokens to be a multiple of 8 "
                                          r".*1001$"):
        settings.check(TrainSettings, settings.Config(train.DEFAULTS, loss_impl="quack_chunked", loss_chunk_tokens=1001))
    settings.check(TrainSettings, settings.Config(train.DEFAULTS, loss_impl="quack_chunked", loss_chunk_tokens=1000))
    # a micro-step's token count too, which quack's loss asserts (a bare AssertionError on the GPU, mid-run)
    with pytest.raises(ConfigError, match=r"needs micro_batch_size x seq_len to be a multiple of 8 tokens, got 100$"):
        settings.check(TrainSettings, settings.Config(train.DEFAULTS, loss_impl="quack_chunked", micro_batch_size=1,
                                                      seq_len=100, tokens_per_update=100))


@pytest.mark.parametrize("change, words", [
    (dict(dim=100, n_heads=2, loss_impl="quack_chunked"), "loss_impl quack_chunked needs the model's width to be "
                                                          "a multiple of 8"),
    (dict(hidden_dim=900, mlp_impl="quack"), "mlp_impl quack needs the model's width and hidden width"),
])
def test_shapes_the_quack_kernels_do_not_take_are_named(change, words):
    cfg = settings.Config(train.DEFAULTS, **{k: change.pop(k) for k in ("loss_impl", "mlp_impl") if k in change})
    assert words in registry.problem(cfg, model_config=model_lib.get_preset("20m", **change))


def test_a_shape_quack_does_not_take_is_refused_with_the_data_before_the_model(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path, mlp_impl="quack", hidden_dim=100)
    from data.loader import TokenCache
    with pytest.raises(ConfigError, match="mlp_impl quack needs the model's width and hidden width .* got 64 and 100"):
        plan.model_of(cfg, TokenCache(cfg.data_dir), None)  # the plan's shape step (a CPU refuses quack before it)


@pytest.mark.parametrize("preset", ["20m", "50m", "90m"])
def test_every_preset_has_a_shape_the_quack_kernels_take(preset):
    cfg = settings.Config(train.DEFAULTS, loss_impl="quack_chunked", mlp_impl="quack")
    assert registry.problem(cfg, model_config=model_lib.get_preset(preset)) is None


def test_the_mlp_microbench_says_in_one_line_that_it_needs_a_gpu(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "mlp_microbench.py"),
                             f"--results_file={tmp_path / 'r.json'}"], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("PyTorch sees no CUDA GPU here")
    assert not (tmp_path / "r.json").exists()
