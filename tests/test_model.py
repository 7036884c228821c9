"""model.py: preset sizes, exact parity with transformers' Llama (and Qwen3, for qk_norm), loss variants, FLOPs and
input errors."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from model_kernels import attention
from model_kernels import cross_entropy
from model_kernels import registry, swiglu
import hf
import model
from tests.conftest import flash_attn_4_installed


def tiny_config(**overrides):
    fields = dict(vocab_size=256, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_seq_len=64)
    fields.update(overrides)
    return model.get_preset("20m", **fields)


def seeded_model(config, seed=0, **kwargs):
    """A model with random weights whose RMSNorm gains are moved away from 1, so that they are tested too."""
    torch.manual_seed(seed)
    m = model.Transformer(config, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


def random_batch(config, batch, length, seed=1, ignore_fraction=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (batch, length), generator=g)
    y = torch.randint(0, config.vocab_size, (batch, length), generator=g)
    y[torch.rand(y.shape, generator=g) < ignore_fraction] = -100
    y[0, 0] = -100  # at least one ignored target whatever the draw
    return x, y


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- presets

def test_20m_preset_has_the_exact_reference_parameter_count():
    assert sum(p.numel() for p in model.Transformer(model.PRESETS["20m"]).parameters()) == 20403520


@pytest.mark.parametrize("name, target, documented", [("50m", 50e6, 50_473_472), ("90m", 90e6, 88_291_584)])
def test_larger_presets_are_near_their_names(name, target, documented):
    count = sum(p.numel() for p in model.Transformer(model.PRESETS[name]).parameters())
    assert abs(count - target) / target < 0.05 and count == documented  # the README's table


def test_embeddings_are_tied_and_counted_once():
    m = model.Transformer(tiny_config())
    assert m.output.weight is m.tok_embeddings.weight
    assert sum(1 for p in m.parameters() if p is m.tok_embeddings.weight) == 1


# ---------------------------------------------------------------- transformers parity

# 20m whole; 50m's and 90m's widths and heads in two blocks over a smaller vocabulary (the head's size adds nothing)
@pytest.mark.parametrize("name, overrides", [("20m", {}), ("50m", {"n_layers": 2, "vocab_size": 4096}),
                                             ("90m", {"n_layers": 2, "vocab_size": 4096})])
def test_loss_and_gradients_match_transformers_llama(name, overrides):
    assert_loss_and_gradients_match_transformers(model.get_preset(name, **overrides), 1024)


def test_qk_norm_matches_transformers_qwen3():
    """The architecture lever that exports (hf.py): qk_norm as Qwen3ForCausalLM (q_norm and k_norm per head before
    the rotary embedding, the embeddings tied): loss and every gradient."""
    reference = assert_loss_and_gradients_match_transformers(tiny_config(qk_norm=True), 64)
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    assert reference.config.hidden_act == "silu" and reference.config.tie_word_embeddings


def test_an_export_with_qk_norm_loads_in_transformers_and_comes_back_through_init_from(tmp_path):
    """sample.export's folder: AutoModelForCausalLM's logits are ours; read as init_from reads one, the same lever
    and every weight."""
    import checkpoint
    import sample
    from transformers import AutoModelForCausalLM
    config = tiny_config(qk_norm=True)
    ours = seeded_model(config).eval()
    no_tokenizer = type("NoTokenizer", (), {"save_pretrained": lambda self, folder: None})()
    sample.export(ours, no_tokenizer, tmp_path / "hf")  # --export_hf's, but for the tokenizer
    x, _ = random_batch(config, 2, 40)
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
        assert torch.allclose(loaded(input_ids=x).logits, ours(x), rtol=0, atol=1e-5)
    sample.check_export_folder(tmp_path / "hf")  # an earlier export, which --export_hf may replace
    initial = checkpoint.initial_weights(tmp_path / "hf")
    assert initial.config == config and initial.source == "transformers"
    assert all(torch.equal(initial.state[k], v) for k, v in ours.state_dict().items())


def assert_loss_and_gradients_match_transformers(config, length):
    """Our model of config with random weights and transformers' export of it (hf.to_hf): the same loss and every
    gradient in float32; returns the export."""
    ours = seeded_model(config)
    reference = hf.to_hf(ours)
    x, y = random_batch(config, 2, length)
    assert (y == -100).any() and (y != -100).sum() > length

    loss = ours(x, y)
    loss.backward()
    logits = reference(input_ids=x).logits
    # Not labels=: transformers shifts labels itself; our targets are already the next tokens.
    ref = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
    ref.backward()

    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    grads = hf.hf_named_tensors(ours, of=lambda p: p.grad)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    assert set(grads) == set(ref_grads)  # every HF parameter is one of ours (a tied lm_head is embed_tokens)
    for n, g_ref in ref_grads.items():
        assert g_ref is not None and g_ref.norm() > 0, n
        assert relative_error(grads[n], g_ref) < 1e-4, n
    return reference


# the rotary base and the norms' epsilon carried both ways (a Llama-3 base of 500,000; an epsilon that shows)
NOT_DEFAULT = dict(rope_theta=5e5, norm_eps=1e-2)


def test_loss_and_gradients_match_transformers_llama_at_another_rotary_base_and_epsilon():
    assert_loss_and_gradients_match_transformers(tiny_config(**NOT_DEFAULT), 64)


@pytest.mark.parametrize("fields", [{}, NOT_DEFAULT], ids=["defaults", "rope-theta-norm-eps"])
def test_from_hf_round_trip_and_save_pretrained(tmp_path, fields):
    from transformers import LlamaForCausalLM
    config = tiny_config(vocab_size=512, max_seq_len=128, **fields)
    ours = seeded_model(config).eval()
    x, _ = random_batch(config, 2, 100)
    with torch.no_grad():
        logits = ours(x)

        back = hf.from_hf(hf.to_hf(ours)).eval()
        assert back.config == config
        assert torch.allclose(back(x), logits, rtol=0, atol=1e-6)

        hf.to_hf(ours).save_pretrained(tmp_path / "hf")
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
        assert torch.allclose(loaded(input_ids=x).logits, logits, rtol=0, atol=1e-5)
        # and the saved checkpoint comes back into our model
        assert torch.allclose(hf.from_hf(loaded).eval()(x), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("field, value, words", [
    ("num_key_value_heads", 1, "grouped-query"),
    # it loaded, and its logits differed from transformers' by 1e-2
    ("hidden_act", "gelu", "activation 'gelu' (SwiGLU needs silu)"),
    ("hidden_act", "relu2", "activation 'relu2' (SwiGLU needs silu)"),
    ("tie_word_embeddings", False, "untied input and output embeddings")])
def test_from_hf_refuses_checkpoints_outside_the_family(field, value, words):
    reference = hf.to_hf(model.Transformer(tiny_config()))
    setattr(reference.config, field, value)
    with pytest.raises(ValueError, match=re.escape(words)):
        hf.from_hf(reference)


# ---------------------------------------------------------------- loss variants

def test_the_fused_loss_equals_the_full_loss_and_its_gradients():
    config = tiny_config()
    x, y = random_batch(config, 2, 50)  # 100 tokens; slices of 37 do not divide them
    results = {}
    for name in ("full", "fused"):
        m = seeded_model(config, loss_impl=name, loss_chunk_tokens=37)
        for reduction in ("sum", "mean"):
            m.zero_grad()
            loss = m(x, y, reduction=reduction)
            (loss * 0.37).backward()  # an upstream gradient other than 1, as the training step's scale
            results[name, reduction] = loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}
    for reduction in ("sum", "mean"):
        (full, full_grads), (other, other_grads) = results["full", reduction], results["fused", reduction]
        assert torch.allclose(other, full, rtol=1e-5, atol=0)
        for n in full_grads:
            assert relative_error(other_grads[n], full_grads[n]) < 1e-5, n


def test_fused_loss_holds_one_slice_of_logits_at_a_time():
    """The fused op's memory is one slice of logits: the next slice's logits are never computed while the
    last slice's are still held (that doubled the op's peak on the GPU, 0.5 GB at 8,192-token slices)."""
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    config = tiny_config()
    _, y = random_batch(config, 2, 50)
    chunk = 16

    class LiveLogits(TorchDispatchMode):
        live, most = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and out.shape == (chunk, config.vocab_size):  # a slice's logits
                self.live = [r for r in self.live if r() is not None] + [weakref.ref(out)]
                self.most = max(self.most, len(self.live))
            return out

    h = torch.randn(y.numel(), config.dim)
    weight = torch.randn(config.vocab_size, config.dim)
    with LiveLogits() as live:  # the op's body: a mode sees the custom op itself only as one call
        cross_entropy._linear_cross_entropy_impl(h, weight, y.flatten(), chunk)
    assert live.most == 1


def test_fused_evaluation_gives_each_tokens_loss_as_full_does():
    config = tiny_config()
    x, y = random_batch(config, 2, 50, ignore_fraction=0.3)
    full, fused = (seeded_model(config, loss_impl=impl, loss_chunk_tokens=37) for impl in ("full", "fused"))
    with torch.no_grad():
        for reduction in ("none", "sum", "mean"):
            expected, got = full(x, y, reduction=reduction), fused(x, y, reduction=reduction)
            assert got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-6), reduction
    assert (fused(x, y, reduction="none")[y.flatten() == -100] == 0).all()


def test_custom_ops_pass_torch_library_opcheck():
    """PyTorch's own check of a custom op: the fake function's shapes and strides, autograd registration,
    schema, and the same results under torch.compile's tracing."""
    config = tiny_config()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, config.dim, generator=g).t().contiguous().t()  # a non-contiguous h too
    weight = torch.randn(config.vocab_size, config.dim, generator=g, requires_grad=True) * 0.1
    targets = torch.randint(0, config.vocab_size, (50,), generator=g)
    targets[3] = -100
    for args in ((h.requires_grad_(), weight, targets, 16), (h.detach(), weight.detach(), targets, 64)):
        torch.library.opcheck(cross_entropy._linear_cross_entropy_op, args)
        torch.library.opcheck(cross_entropy._linear_cross_entropy_losses_op, tuple(a.detach() if torch.is_tensor(a) else a
                                                                           for a in args))


def test_fused_loss_under_cpu_autocast_is_as_close_to_float32_as_full():
    """Under autocast the fused op sees h in bf16, as F.linear would. Against float32 without autocast, its
    gradients must be no further off than the full loss's own bf16 rounding (and float32 in dtype)."""
    config = tiny_config()
    x, y = random_batch(config, 2, 50)
    results = {}
    for name, impl, autocast in (("float32", "full", False), ("full", "full", True), ("fused", "fused", True)):
        m = seeded_model(config, loss_impl=impl, loss_chunk_tokens=37)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(x, y, reduction="mean")
        loss.backward()
        results[name] = loss.detach(), {n: p.grad for n, p in m.named_parameters()}
    reference, reference_grads = results["float32"]
    assert torch.allclose(results["fused"][0], results["full"][0], rtol=1e-3)
    assert all(g.dtype == torch.float32 for g in results["fused"][1].values())
    flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(grads)])
    own_rounding = relative_error(flat(results["full"][1]), flat(reference_grads))
    assert relative_error(flat(results["fused"][1]), flat(reference_grads)) < 1.25 * own_rounding


def test_out_of_range_targets_are_one_clear_error():
    config = tiny_config()
    m = model.Transformer(config, loss_impl="fused")
    x, y = random_batch(config, 1, 10)
    y[0, 1] = config.vocab_size
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 256\) or be -100"):
        m(x, y)
    with pytest.raises(ValueError, match="targets must have the input's shape"):
        m(x, y[:, :5])


@pytest.mark.parametrize("args, words", [
    (["--preset=20m", "--tokens=30"], "less than one sequence"),
    (["--checkpoint=missing.pt"], "no checkpoint at missing.pt"),
    (["--checkpoint=garbage.pt"], "is it a train.py checkpoint"),
    (["--preset=20m", "--results_file=garbage.json"], "garbage.json"),
    (["--preset=nope"], "unknown model preset 'nope'"),
])
def test_parity_cli_mistakes_are_one_line_errors(tmp_path, monkeypatch, capsys, args, words):
    from scripts import parity
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "garbage.json").write_text("{not json")
    assert parity.main(args + ["--device=cpu", "--seq_len=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


def test_fused_loss_traces_under_torch_compile():
    """The custom op's fake (shape) function and autograd registration, as torch.compile uses them."""
    config = tiny_config()
    x, y = random_batch(config, 2, 24)
    eager, compiled = (seeded_model(config, loss_impl="fused", loss_chunk_tokens=16) for _ in range(2))
    step = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    for m, run in ((eager, eager), (compiled, step)):
        run(x, y, reduction="mean").backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert relative_error(q.grad, p.grad) < 1e-6, name


TRITON_ROWS_CHECK = """
import torch, torch.nn.functional as F, model
from model_kernels import cross_entropy, swiglu
from tests.conftest import assert_loss_and_gradients_match_cross_entropy
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    # one block per row, and several (online log-sum-exp), each at the default launch and another
    for vocab, rows, block in ((1000, 5, None), (1000, 5, 256), (40000, 3, None), (40000, 3, 65536)):
        logits = (torch.randn(rows, vocab) * 4).to(dtype)
        targets = torch.randint(0, vocab, (rows,))
        targets[1] = -100
        reference = logits.float().requires_grad_()
        F.cross_entropy(reference, targets, reduction="sum").backward()
        expected_losses = F.cross_entropy(reference.detach(), targets, reduction="none")
        losses = cross_entropy._cross_entropy_rows_triton(logits, targets, block=block)  # the gradient goes into logits
        assert torch.allclose(losses, expected_losses, rtol=1e-5, atol=1e-5), (dtype, vocab, block)
        tolerance = 1e-5 if dtype == torch.float32 else 4e-3  # bf16 keeps 8 bits of the gradient
        assert (logits.float() - reference.grad).abs().max() < tolerance, (dtype, vocab, block)
        assert logits[1].abs().max() == 0  # an ignored target has no gradient
        untouched = (torch.randn(rows, vocab) * 4).to(dtype)
        copy = untouched.clone()
        expected = F.cross_entropy(untouched.float(), targets, reduction="none")
        assert torch.allclose(cross_entropy._cross_entropy_rows_triton(untouched, targets, write_grad=False, block=block),
                              expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(untouched, copy)  # evaluation's variant leaves the logits alone
# the whole op with the kernel in it, as on the GPU: loss and both gradients against F.cross_entropy
cross_entropy._cross_entropy_rows = lambda device: cross_entropy._cross_entropy_rows_triton
h = torch.randn(70, 16, requires_grad=True)
w = (torch.randn(300, 16) * 0.3).requires_grad_()
targets = torch.randint(0, 300, (70,))
targets[5] = -100
# 70 tokens: slices of 32, 32 and 6
assert_loss_and_gradients_match_cross_entropy(lambda h, w, t: cross_entropy.linear_cross_entropy(h, w, t, 32),
                                              h, w, targets)
assert torch.allclose(cross_entropy.linear_cross_entropy_losses(h.detach(), w.detach(), targets, 32),
                      F.cross_entropy(h @ w.t(), targets, reduction="none"), rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_triton_cross_entropy_kernel_in_the_interpreter():
    """The GPU kernel itself, run on the CPU by Triton's interpreter (TRITON_INTERPRET is read when the
    kernel is defined, hence a fresh process)."""
    pytest.importorskip("triton")
    root = Path(model.__file__).parent
    result = subprocess.run([sys.executable, "-c", TRITON_ROWS_CHECK], cwd=root, capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root)), timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


SWIGLU_CHECK = """
import torch, torch.nn.functional as F, model
from model_kernels import cross_entropy, swiglu
torch.manual_seed(0)
def run(fn, x, weight, grad_out):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = fn(x, weight)
    out.backward(grad_out)
    return out.float(), x.grad.float(), weight.grad.float()
def reference(x, weight):  # in float32, as the kernels compute
    gate, up = x.float().chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, weight.float())
# one piece per row, and a row in two pieces (1,500 > the 1,024 a program takes); bf16 rounds each product
cases = ((torch.float32, 24, 1e-6), (torch.float32, 1500, 1e-6), (torch.bfloat16, 40, 2e-2))
def check(fn):
    for dtype, hidden, tolerance in cases:
        x = (torch.randn(3, 5, 2 * hidden) * 3).to(dtype)
        weight = (torch.randn(7, hidden) / hidden ** 0.5).to(dtype)
        grad_out = torch.randn(3, 5, 7).to(dtype)
        expected = run(reference, x.float(), weight.float(), grad_out.float())
        got = run(fn, x, weight, grad_out)
        for name, a, b in zip(("out", "grad x", "grad weight"), got, expected):
            assert a.shape == b.shape and ((a - b).norm() / b.norm()).item() < tolerance, (name, dtype, hidden, fn)
    # backward's recomputed product is forward's, bit for bit
    x = torch.randn(4, 2 * 1500).to(torch.bfloat16)
    _, product = swiglu._swiglu_backward_op(torch.randn(4, 1500).to(torch.bfloat16), x)
    assert torch.equal(product, swiglu._swiglu_down_op(x, torch.eye(1500, dtype=torch.bfloat16)))
# the op's autograd and shapes under torch.compile (on the CPU its body is the torch reference)
check(torch.compile(swiglu._swiglu_down_op, backend="aot_eager", fullgraph=True))
# the CUDA path's Triton kernel, here in the interpreter (which torch.compile cannot trace into)
swiglu.uses_triton = lambda device: True
check(swiglu._swiglu_down_op)
print("ok")
"""


def test_triton_swiglu_kernels_in_the_interpreter():
    """The fused SwiGLU-and-down-projection op, its Triton kernel both ways and its autograd under
    torch.compile, against autograd of F.linear(silu(gate) * up, weight)."""
    pytest.importorskip("triton")
    root = Path(model.__file__).parent
    result = subprocess.run([sys.executable, "-c", SWIGLU_CHECK], cwd=root, capture_output=True, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root)), timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_swiglu_takes_the_fused_op_only_in_compiled_code_on_the_triton_path(monkeypatch):
    """Where Triton kernels run (CUDA), compiled code calls the fused op and eager keeps torch's kernels: the
    op's dispatch made eager 12.5% slower on the H200. Traced on the CPU with the op's torch reference."""
    calls = []

    def spy(x, weight):
        calls.append((x.shape, weight.shape))
        return F.linear(swiglu._swiglu_torch(x), weight)

    monkeypatch.setattr(swiglu, "uses_triton", lambda device: True)
    monkeypatch.setattr(swiglu, "_swiglu_down_op", spy)
    config = tiny_config()
    ffn = model.FeedForward(config)
    x = torch.randn(2, 3, config.dim)
    eager = ffn(x)
    assert calls == []
    torch._dynamo.reset()
    compiled = torch.compile(ffn, backend="eager", fullgraph=True)(x)
    assert calls == [((2, 3, 2 * config.hidden_dim), (config.dim, config.hidden_dim))]
    assert torch.allclose(compiled, eager, rtol=1e-5, atol=1e-6)


# The Triton kernel's stand-ins on the CPU (no Triton driver here): opaque ops, as the kernel's launches are to
# the compiler, so that it cannot merge backward's recomputed product with forward's as it would plain torch.
@torch.library.custom_op("tiny_llm_test::swiglu", mutates_args=())
def _swiglu_forward_stand_in(x: torch.Tensor) -> torch.Tensor:
    return swiglu._swiglu_torch(x)


@torch.library.custom_op("tiny_llm_test::swiglu_backward", mutates_args=())
def _swiglu_backward_stand_in(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu._swiglu_backward_torch(grad_out, x)


_swiglu_forward_stand_in.register_fake(lambda x: x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,)))
_swiglu_backward_stand_in.register_fake(lambda grad_out, x: (torch.empty_like(x), torch.empty_like(grad_out)))


def _swiglu_kernel_stand_in(x, grad_out=None):
    return (_swiglu_forward_stand_in(x),) if grad_out is None else _swiglu_backward_stand_in(grad_out, x)


def test_compiled_feed_forward_keeps_no_swiglu_product_for_backward(monkeypatch):
    """The fused op saves w13's output and the weights, not silu(gate) * up (hidden_dim values per token that
    w2's weight gradient needs): backward recomputes it. Same output and gradients as eager."""
    monkeypatch.setattr(swiglu, "uses_triton", lambda device: True)
    monkeypatch.setattr(swiglu, "_swiglu_launch", _swiglu_kernel_stand_in)
    config = tiny_config()
    torch.manual_seed(0)
    ffn = model.FeedForward(config)
    x = torch.randn(2, 3, config.dim)
    results = {}
    for name, fn in (("eager", ffn), ("compiled", torch.compile(ffn, backend="aot_eager", fullgraph=True))):
        torch._dynamo.reset()
        ffn.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            out = fn(x.requires_grad_())
        out.square().sum().backward()
        results[name] = out, ffn.w13.weight.grad.clone(), ffn.w2.weight.grad.clone(), saved
    product = (2, 3, config.hidden_dim)
    assert product in results["eager"][3]  # what plain autograd keeps, and the op does not
    assert product not in results["compiled"][3] and (2, 3, 2 * config.hidden_dim) in results["compiled"][3]
    for a, b in zip(results["compiled"][:3], results["eager"][:3]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_swiglu_is_plain_torch_off_cuda():
    """On the CPU the feed-forward keeps F.linear(F.silu(gate) * up, w2), exactly (the CPU tests' reference)."""
    x, weight = torch.randn(2, 3, 16, requires_grad=True), torch.randn(5, 8)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(swiglu.swiglu_down(x, weight), F.linear(F.silu(gate) * up, weight))


def test_reductions_agree_and_ignore_minus_100():
    config = tiny_config()
    m = seeded_model(config)
    x, y = random_batch(config, 2, 40, ignore_fraction=0.3)
    counted = y != -100
    with torch.no_grad():
        per_token = m(x, y, reduction="none")
        total = m(x, y, reduction="sum")
        mean = m(x, y, reduction="mean")
        logits = m(x)
    assert per_token.shape == (x.numel(),)
    assert torch.all(per_token[~counted.flatten()] == 0)
    # the losses of counted positions are -log p(target) from the logits
    logp = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)
    manual = -logp[counted.flatten()].gather(1, y.flatten()[counted.flatten()][:, None]).squeeze(1)
    assert torch.allclose(per_token[counted.flatten()], manual, rtol=1e-5, atol=1e-6)
    assert torch.allclose(total, per_token.sum(), rtol=1e-5)
    assert torch.allclose(mean, total / counted.sum(), rtol=1e-5)
    # ignoring one more target removes exactly that position's loss from the sum
    position = int(counted.flatten().nonzero()[0])
    y2 = y.clone()
    y2.view(-1)[position] = -100
    with torch.no_grad():
        assert torch.allclose(m(x, y2, reduction="sum"), total - per_token[position], rtol=1e-5)
    # all targets ignored: zero, not NaN
    with torch.no_grad():
        assert m(x, torch.full_like(y, -100)).item() == 0.0


def test_unknown_reduction_is_an_error():
    m = model.Transformer(tiny_config())
    x, y = random_batch(m.config, 1, 8)
    with pytest.raises(ValueError, match=r"'avg'.*mean, sum, none"):
        m(x, y, reduction="avg")


# ---------------------------------------------------------------- FLOPs

@pytest.mark.parametrize("name", ["20m", "50m", "90m"])
@pytest.mark.parametrize("seq_len", [256, 1024])
def test_flops_per_token_counts_every_matmul_and_attention(name, seq_len):
    config = model.PRESETS[name]
    m = model.Transformer(model.get_preset(name, n_layers=2))  # the count is per layer; check the shape math
    linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, nn.Linear))  # includes the LM head
    assert m.output.weight.numel() == config.vocab_size * config.dim
    expected = 6 * linear + 12 * 2 * config.dim * seq_len
    assert model.flops_per_token(m.config, seq_len) == expected
    # and the full-depth preset: layers scale the per-layer part
    per_layer = sum(mod.weight.numel() for mod in m.layers[0].modules() if isinstance(mod, nn.Linear))
    full = 6 * (config.n_layers * per_layer + config.vocab_size * config.dim) + 12 * config.n_layers * config.dim * seq_len
    assert model.flops_per_token(config, seq_len) == full


def test_a_context_schedule_counts_each_context_by_its_share_of_the_tokens():
    """The entry's FLOPs (and so its MFU) counted attention at seq_len for every token of a schedule's run, whose
    first 30% of the tokens trained at 256 and the next 30% at 512."""
    config = model.PRESETS["20m"]
    at = lambda t: model.flops_per_token(config, t)
    scheduled = model.flops_per_token(config, 1024, ((256, 0.3), (512, 0.6)))
    assert scheduled == pytest.approx(0.3 * at(256) + 0.3 * at(512) + 0.4 * at(1024))
    assert model.flops_per_token(config, 1024, ()) == at(1024)


# ---------------------------------------------------------------- errors

def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError) as info:
        model.get_preset("30m")
    assert "30m" in str(info.value)
    for name in ("20m", "50m", "90m"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="30m"):
        model.Transformer("30m")


def test_width_not_divisible_by_heads():
    with pytest.raises(ValueError) as info:
        model.get_preset("20m", dim=100, n_heads=3)
    message = str(info.value)
    assert "100" in message and "3" in message and "multiple of n_heads" in message


def test_sequence_longer_than_context():
    m = model.Transformer(tiny_config(max_seq_len=16))
    with pytest.raises(ValueError) as info:
        m(torch.zeros(1, 17, dtype=torch.long))
    assert "17" in str(info.value) and "16" in str(info.value)
    m(torch.zeros(1, 16, dtype=torch.long))  # the full context is fine


@pytest.mark.parametrize("bad", [256, 1000, -1])
def test_token_ids_outside_the_vocabulary(bad):
    m = model.Transformer(tiny_config(vocab_size=256))
    x = torch.zeros(1, 8, dtype=torch.long)
    x[0, 3] = bad
    with pytest.raises(ValueError) as info:
        m(x)
    assert str(bad) in str(info.value) and "[0, 256)" in str(info.value)


def test_unknown_attention_backend_and_loss_impl():
    with pytest.raises(ValueError) as info:
        model.Transformer(tiny_config(), attention_backend="fast")
    assert "'fast'" in str(info.value)
    for name in registry.ATTENTION:
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"'liger'.*full, fused, quack_chunked"):
        model.Transformer(tiny_config(), loss_impl="liger")


def test_bad_input_shape():
    m = model.Transformer(tiny_config())
    with pytest.raises(ValueError, match="batch, sequence"):
        m(torch.zeros(8, dtype=torch.long))


# ---------------------------------------------------------------- attention backends

@pytest.mark.skipif(flash_attn_4_installed(), reason="flash-attn-4 is installed here")
def test_fa4_backend_without_flash_attn_4_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'fa4' needs the flash-attn-4 package \(pip install flash-attn-4\)"):
        model.Transformer(tiny_config(), attention_backend="fa4")
    m = model.Transformer(tiny_config())
    with pytest.raises(ValueError, match="flash-attn-4"):
        m.set_attention_backend("fa4")
    assert m.attention_backend == "auto"


@pytest.mark.parametrize("lacking", ["_flash_attn_bwd", "_flash_attn_fwd"])
def test_fa4_with_a_flash_attn_4_lacking_its_functions_is_a_clear_error(flash_attn_4_stand_in, monkeypatch, lacking):
    """The check named the backward only; one without the variable-length forward (context_windows') passed every
    check and failed at the first update."""
    monkeypatch.delattr(flash_attn_4_stand_in, lacking)
    with pytest.raises(ValueError, match=rf"no {lacking}; 4.0.0b36 is the version measured"):
        model.Transformer(tiny_config(), attention_backend="fa4")


def test_a_flash_attn_4_that_fails_as_it_imports_leaves_auto_on_sdpa_and_refuses_fa4(monkeypatch, fake_gpu):
    """It loads the CUTLASS DSL as it imports, so a version clash there is a RuntimeError, say, not an ImportError:
    the default (auto), which the user never pointed at fa4, failed with a traceback."""
    import importlib
    real = importlib.import_module

    def clash(name, *args, **kwargs):
        if name == "flash_attn.cute.interface":
            raise RuntimeError("nvidia-cutlass-dsl 4.1 is not supported; need >= 4.2")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(attention.importlib, "import_module", clash)
    fake_gpu((9, 0))
    backend, why = attention.resolve_backend("auto", "cuda")
    assert backend == "sdpa" and "did not import (RuntimeError: nvidia-cutlass-dsl 4.1" in why
    with pytest.raises(ValueError, match="did not import"):
        model.Transformer(tiny_config(), attention_backend="fa4")


@pytest.mark.parametrize("choice", [dict(loss_impl="quack_chunked"), dict(mlp_impl="quack")])
def test_a_quack_choice_without_quack_fails_at_construction_in_one_sentence(monkeypatch, choice):
    """They had no load: the model was built, and the first forward failed with a ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "quack", None)
    with pytest.raises(ValueError, match="quack-kernels did not import"):
        model.Transformer(tiny_config(), **choice)


def test_token_ids_of_another_dtype_are_one_clear_error():
    m = model.Transformer(tiny_config())
    x = torch.randint(0, 10, (2, 8))
    for idx, targets in ((x.float(), None), (x.bool(), None), (x, x.int())):
        with pytest.raises(ValueError, match="token ids must be int64 or int32 and targets int64"):
            m(idx, targets)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fa4_op_gives_sdpa_loss_and_gradients(flash_attn_4_stand_in, compiled):
    """Our op pair, with cuDNN's forward and flash-attn-4's backward written out by hand: the model's loss and
    every gradient equal SDPA's. This checks what the ops hand them (layouts, the saved output and log-sum-exp,
    the order of backward's arguments) and, compiled, that the fakes' outputs match the real ones."""
    config = tiny_config()
    x, y = random_batch(config, 2, 48)
    results = {}
    for backend in ("math", "fa4"):
        m = seeded_model(config)
        m.set_attention_backend(backend)
        run = torch.compile(m, backend="inductor", dynamic=False) if compiled else m
        loss = run(x, y)
        loss.backward()
        results[backend] = loss.detach(), {n: p.grad for n, p in m.named_parameters()}
    (sdpa_loss, sdpa_grads), (fa4_loss, fa4_grads) = results["math"], results["fa4"]
    assert torch.allclose(fa4_loss, sdpa_loss, rtol=1e-5, atol=0)
    for name, grad in sdpa_grads.items():
        assert torch.allclose(fa4_grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_fa4_leaves_forward_only_passes_to_sdpa(flash_attn_4_stand_in, monkeypatch):
    """Evaluation and sampling want no gradients: they take SDPA's choice, and save no log-sum-exp."""
    calls = []
    forward = attention.cudnn_attention_forward
    monkeypatch.setattr(attention, "cudnn_attention_forward", lambda *a: calls.append(1) or forward(*a))
    config = tiny_config()
    x, y = random_batch(config, 2, 32)
    m = seeded_model(config)
    with torch.no_grad():
        sdpa_logits = m(x)
        m.set_attention_backend("fa4")
        assert torch.equal(m(x), sdpa_logits) and not calls
    m(x, y).backward()
    assert len(calls) == config.n_layers


def test_pinned_attention_backends_on_cpu():
    config = tiny_config()
    m = seeded_model(config)
    x, y = random_batch(config, 2, 64)
    with torch.no_grad():
        auto = m(x, y)
        m.set_attention_backend("math")
        assert m.attention_backend == "math"
        math_loss = m(x, y)
        assert torch.allclose(math_loss, auto, rtol=1e-5, atol=0)
        # the cuDNN kernel exists only on CUDA: pinning it on CPU fails loudly (settings refuse it before)
        m.set_attention_backend("cudnn")
        with pytest.raises(RuntimeError, match="No viable backend"):
            m(x, y)
    m.set_attention_backend("auto")
    with torch.no_grad():
        assert m(x, y) == auto


# ---------------------------------------------------------------- rotary tables

def test_rotary_tables_are_computed_once_as_buffers(monkeypatch):
    calls = []
    original = model.rotary_tables
    monkeypatch.setattr(model, "rotary_tables", lambda *a, **k: calls.append(1) or original(*a, **k))
    m = model.Transformer(tiny_config())
    assert len(calls) == 1
    calls.clear()
    x, y = random_batch(m.config, 2, 32)
    for _ in range(3):
        m(x, y).backward()
    assert calls == []
    buffers = dict(m.named_buffers())
    assert set(buffers) == {"rope_cos", "rope_sin_signed"}
    assert buffers["rope_cos"].shape == (m.config.max_seq_len, m.config.head_dim)
    assert "rope_cos" not in m.state_dict()  # derived, not saved
    cos, sin = original(m.config)
    assert torch.equal(buffers["rope_cos"], cos) and torch.equal(buffers["rope_sin_signed"], model.signed_sin(sin))
    # they travel with the module
    m.double()
    assert m.rope_cos.dtype == torch.float64


def test_a_bf16_residual_stream_is_bf16_between_blocks_and_close_to_float32():
    """The declared residual_dtype=bfloat16: under autocast every block reads and returns bf16 (the weights stay
    float32), and the loss stays within bf16's rounding of the float32 stream's."""
    config = tiny_config()
    x, y = random_batch(config, 2, 24)
    seen = []
    losses = {}
    for dtype in ("float32", "bfloat16"):
        m = seeded_model(config, residual_dtype=dtype)
        hook = m.layers[1].register_forward_pre_hook(lambda mod, args: seen.append((dtype, args[0].dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[dtype] = m(x, y).item()
        hook.remove()
        assert all(p.dtype == torch.float32 for p in m.parameters())
    assert seen == [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)
    with pytest.raises(ValueError, match="unknown residual_dtype 'float16'"):
        model.Transformer(config, residual_dtype="float16")


def test_auto_attention_is_fa4_where_it_runs_and_sdpa_elsewhere_saying_why(flash_attn_4_stand_in, monkeypatch,
                                                                          fake_gpu):
    """The default: flash-attn-4's backward on a Hopper/Blackwell GPU with the package, SDPA everywhere else."""
    assert attention.resolve_backend("auto", "cpu") == ("sdpa", "the default; fa4 runs on Hopper and Blackwell GPUs "
                                                                "only, not on the cpu")
    assert attention.resolve_backend("cudnn", "cpu") == ("cudnn", "as set")
    fake_gpu((9, 0))
    assert attention.resolve_backend("auto", "cuda")[0] == "fa4"
    fake_gpu((8, 0), "NVIDIA A100")
    assert attention.resolve_backend("auto", "cuda") == ("sdpa", "the default; fa4 runs on Hopper and Blackwell "
                                                                 "GPUs only, not on NVIDIA A100")
    fake_gpu((9, 0))
    monkeypatch.delitem(sys.modules, "flash_attn.cute.interface")
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # not installed
    backend, why = attention.resolve_backend("auto", "cuda")
    assert backend == "sdpa" and "needs the flash-attn-4 package" in why


def test_auto_attention_on_the_cpu_computes_what_sdpa_does():
    from model_kernels.attention import resolve_backend
    assert resolve_backend("auto", "cpu")[0] == "sdpa"  # the choice itself: math computes the same on a CPU
    config = tiny_config()
    x, y = random_batch(config, 2, 24)
    auto, sdpa = seeded_model(config, attention_backend="auto"), seeded_model(config, attention_backend="sdpa")
    for m in (auto, sdpa):
        m(x, y).backward()
    assert torch.equal(auto(x), sdpa(x))
    for (name, p), q in zip(auto.named_parameters(), sdpa.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("change, words", [(dict(rope_theta=0.0), "rope_theta must be a finite number"),
                                           (dict(rope_theta=-1e4), "rope_theta must be"),
                                           (dict(norm_eps=-1.0), "norm_eps must be a finite number of at least 0"),
                                           (dict(norm_eps=float("nan")), "norm_eps must be")])
def test_a_config_whose_floats_give_nan_logits_is_refused(change, words):
    """rope_theta 0 or below, or a negative or NaN norm_eps (a hand-made or corrupt Llama config) built a model whose
    logits were all NaN."""
    with pytest.raises(ValueError, match=words):
        model.ModelConfig(**change)


def test_another_family_s_config_is_named_not_a_traceback():
    """GPT-2's config has no num_key_value_heads: reading it after noting the model_type was an AttributeError."""
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="model_type 'gpt2' is outside the tiny-llm family"):
        hf.config_from_hf(GPT2Config())


def test_the_fused_loss_reads_strided_targets_and_scores_an_empty_batch(monkeypatch):
    """The Triton rows kernel read targets as contiguous (a (B, 1) slice's flatten is a strided view: wrong losses
    and gradients on a GPU); the evaluation op's torch.cat failed on an empty batch, where the plain loss gives 0."""
    logits = torch.randn(8, 16)
    targets = torch.randint(0, 16, (8, 2))[:, 1]  # stride 2
    launched = []
    monkeypatch.setattr(cross_entropy, "_rows_kernel", lambda: _Launch(launched))
    monkeypatch.setattr(cross_entropy.first_calls, "wait", lambda kernel: None)
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    cross_entropy._cross_entropy_rows_triton(logits.clone(), targets)
    assert launched[0].is_contiguous() and torch.equal(launched[0], targets)
    h, w = torch.zeros(0, 8), torch.randn(16, 8)
    with torch.no_grad():
        assert cross_entropy._linear_cross_entropy_losses_op(h, w, torch.zeros(0, dtype=torch.long), 4).shape == (0,)


class _Launch:
    """A stand-in for the Triton kernel: keeps the targets it was given."""
    def __init__(self, launched):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda logits, stride, targets, *args, **kwargs: self.launched.append(targets)
