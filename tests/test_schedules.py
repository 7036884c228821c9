"""The data schedule (#38): a context that grows during the run. Every target stays scored once per epoch, each update
keeps its tokens and targets, a stopped run resumes bitwise, two processes train as one, and each shape compiles
once."""
import os

import numpy as np
import pytest
import torch

import configurator
import plan
import settings
import train
import model as model_lib
from tests.conftest import attention_backward_by_hand, attention_forward_by_hand
from data.loader import IGNORE, TokenCache, TrainData, split_context, window_tensors
from tests.test_train import (assert_close_parameters, checkpoint_parameters, free_port, make_trainer,
                              parameters, recipe_id, small_config)
from tests.test_train import restore_threads  # noqa: F401 (autouse: the trainer's cpu_threads=1 is undone)

T = 32
N = 45          # sequences of the training subset: 6 updates of 8 an epoch, the last of 5
CONTEXT = "8:0.3,16:0.6"    # windows of 8 targets until 30% of the run's tokens, 16 until 60%, then 32
# each update's context over 2 epochs (90 sequences), by hand: 8 while the sequences before it are below 27, 16
# below 54, then 32
CONTEXTS = [8] * 4 + [16] * 4 + [32] * 4


def config(cache, tmp_path, **overrides):
    """A tiny run: width 32, 2 layers, 45 sequences of 32 (and 7 tokens that are never targets), 2 epochs."""
    return small_config(cache, tmp_path, **{**dict(dim=32, hidden_dim=64, seq_len=T, train_subset_tokens=N * T + 8,
                                                   val_subset_tokens=4 * T, tokens_per_update=8 * T,
                                                   micro_batch_size=2, eval_batch_size=4, full_validation=False,
                                                   warmup_updates=2), **overrides})


def positions_data(context="", seed=0):
    """TrainData over tokens whose values are their positions, with the schedule's steps as plan.py gives them."""
    tokens = np.arange(N * T + 8, dtype=np.int64)
    return TrainData(tokens, T, 8, seed, epochs=2, context_steps=settings.schedule_steps(context))


def sequences_of(batches):
    """The sequence index of each real row of micro-batches, read back through the context split."""
    found = []
    for x, y in batches:
        for row_x, row_y in zip(x.reshape(-1, T), y.reshape(-1, T)):  # a row's windows are consecutive rows
            if not (row_y == IGNORE).all():
                assert not (row_y == IGNORE).any() and int(row_x[0]) % T == 0
                found.append(int(row_x[0]) // T)
    return found


@pytest.mark.parametrize("context", ["", CONTEXT], ids=["none", "seq_len"])
def test_every_token_after_the_first_is_a_target_once_per_epoch_under_the_schedule(context):
    data = positions_data(context)
    for epoch in range(2):
        for micro in (1, 2):
            targets, shapes = [], set()
            for u in range(data.updates_per_epoch):
                batches, n_tokens = data.micro_batches(epoch, u, micro)
                got = [int(t) for _, y in batches for t in y.flatten() if t != IGNORE]
                assert n_tokens == len(got)
                targets += got
                shapes |= {tuple(x.shape) for x, _ in batches} | {tuple(y.shape) for _, y in batches}
            assert sorted(targets) == list(range(1, N * T + 1))  # the last 7 positions are never targets
            assert shapes <= {(micro * T // c, c) for c in data.contexts()}  # one shape per context
    assert data.contexts() == ([8, 16, 32] if context else [32])


def test_a_step_ends_at_its_until_share():
    """8:0.5 is 8 below half the run's sequences: the second epoch's first update starts at 45 of 90, exactly half,
    and takes the next context."""
    data = positions_data("8:0.5")
    assert [data.context(e, u) for e in range(2) for u in range(data.updates_per_epoch)] == [8] * 6 + [32] * 6


def test_the_context_split_leaves_each_update_s_tokens_and_targets_as_without_it():
    plain, split = positions_data(), positions_data(CONTEXT)
    assert [split.context(e, u) for e in range(2) for u in range(split.updates_per_epoch)] == CONTEXTS
    for epoch in range(2):
        for u in range(plain.updates_per_epoch):
            assert plain.context(epoch, u) == T
            assert np.array_equal(plain.update_sequences(epoch, u), split.update_sequences(epoch, u))
            (a, n_a), (b, n_b) = plain.micro_batches(epoch, u, 2), split.micro_batches(epoch, u, 2)
            assert n_a == n_b and len(a) == len(b)
            for (xa, ya), (xb, yb) in zip(a, b):  # the same targets in the same order, and the same inputs
                assert torch.equal(xa.flatten(), xb.flatten()) and torch.equal(ya.flatten(), yb.flatten())
                per_row = T // xb.shape[1]
                for i in range(len(xb)):
                    if (yb[i] == IGNORE).all():  # padding
                        continue
                    assert torch.equal(xb[i, 1:], yb[i, :-1])  # a window of c + 1 tokens: inputs, then targets
                    if (i + 1) % per_row:  # the next window of the sequence starts at this one's last token
                        assert xb[i + 1, 0] == yb[i, -1]


@pytest.mark.parametrize("change, words", [
    (dict(seq_len_schedule="8-0.2"), "is not VALUE:UNTIL"),
    (dict(seq_len_schedule=","), "has an empty step"),
    (dict(seq_len_schedule=" "), "has an empty step"),
    (dict(seq_len_schedule="8:0.5,"), "has an empty step (a comma too many"),
    (dict(seq_len_schedule="16:0.2,8:0.5"), "must be positive and grow, got 8 after 16"),
    (dict(seq_len_schedule="8:0.5,16:0.2"), "must grow within (0, 1), got 0.2 after 0.5"),
    (dict(seq_len_schedule="8:1.0"), "must grow within (0, 1), got 1"),
    (dict(seq_len_schedule="12:0.2"), "context 12 must divide seq_len 32"),
    (dict(seq_len_schedule="32:0.5"), "context 32 must divide seq_len 32 and be shorter"),  # a step that does nothing
    (dict(seq_len_schedule="1:0.1,2:0.2,4:0.3,8:0.4,16:0.5"), "has 5 steps; at most 4")])
def test_a_schedule_that_cannot_be_right_is_one_line_before_any_work(text_cache, tmp_path, capsys, change, words):
    cfg = config(text_cache, tmp_path, **change)
    with pytest.raises(configurator.ConfigError) as info:
        plan.resolve(cfg, world=(0, 0, 1))
    assert words in str(info.value) and "\n" not in str(info.value)
    assert train.main([f"--{k}={v}" for k, v in cfg.items()]) == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_schedule_is_a_recipe_key_that_leaves_an_unscheduled_run_s_identity_as_it_was(text_cache, tmp_path):
    cfg = config(text_cache, tmp_path)
    changes = ({}, dict(seq_len_schedule=CONTEXT), dict(seq_len_schedule="8:0.3"))
    assert len({recipe_id(settings.Config(cfg, **change)) for change in changes}) == len(changes)
    mcfg = plan.model_config(cfg, 256)
    assert "seq_len_schedule" not in settings.recipe(cfg, mcfg, "cache")


def test_bench_refuses_the_schedule_it_would_not_time():
    """Its hint clears the schedule: followed without it (--seq_len=256), the schedule's own rule answered that 256
    must be shorter than seq_len, a change bench would refuse anyway."""
    cfg = settings.Config(settings.defaults(settings.BenchSettings), seq_len_schedule="256:0.5")
    for changes in ({}, dict(seq_len=256, micro_batch_size=128)):
        with pytest.raises(configurator.ConfigError, match="seq_len_schedule makes updates of other shapes.*"
                                                            "alone without it \\(--seq_len_schedule= --seq_len=C"):
            settings.check(settings.BenchSettings, settings.Config(cfg, **changes))
    settings.check(settings.BenchSettings, settings.Config(cfg, seq_len_schedule="", seq_len=256, micro_batch_size=128))


@pytest.mark.parametrize("context_windows", [False, True])
def test_stop_and_resume_across_the_context_steps_is_bitwise_identical(text_cache, tmp_path, context_windows):
    """Stopped in the first context, resumed across both step changes, finished: the uninterrupted run's curve and
    weights, bit for bit; the learning rate's schedule spans the run's 12 updates (the windows split or in whole
    rows)."""
    recipe = dict(seq_len_schedule=CONTEXT, lr_schedule="wsd", cooldown_fraction=0.5, context_windows=context_windows)
    full = train.train(config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"), **recipe))
    assert full["step"] == full["total_updates"] == 12 and full["tokens"] == 2 * N * T
    curve = lambda entry: [(p["update"], p["tokens"], p["loss"], p["lr"], p["grad_norm"])
                           for p in entry["training_curve"]]
    assert curve(full)[-1][3] == full["config"]["min_lr"]  # wsd reaches its floor at the run's last update
    assert [p[1] for p in curve(full)][:7] == [8 * T * (u + 1) for u in range(5)] + [N * T, (N + 8) * T]

    cfg = config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), **recipe)
    first = train.train(settings.Config(cfg, stop_after_updates=3))
    assert first["status"] == "interrupted" and first["tokens"] == 3 * 8 * T
    second = train.train(settings.Config(cfg, resume=True, stop_after_updates=6))
    assert second["status"] == "interrupted" and second["step"] == 9
    last = train.train(settings.Config(cfg, resume=True))
    assert last["status"] == "complete" and last["sessions"] == 3
    assert curve(last) == curve(full)
    assert [p["loss"] for p in last["validation_curve"]] == [p["loss"] for p in full["validation_curve"]]
    a, b = checkpoint_parameters(tmp_path / "straight"), checkpoint_parameters(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


# an 8-sequence update in windows of 8, the 5-sequence last of epoch 0 (padded on one rank) in windows of 16, and an
# 8-sequence one in windows of 32
UPDATES = ((0, 0), (0, 5), (1, 3))


def run_data(cfg):
    cache = TokenCache(cfg.data_dir)
    return TrainData(cache.train, cfg.seq_len, cfg.tokens_per_update // cfg.seq_len, cfg.seed,
                     cfg.train_subset_tokens, cfg.epochs, settings.schedule_steps(cfg.seq_len_schedule),
                     cfg.context_windows)


def ddp_worker(rank, cfg, port, out):
    """One of two gloo processes, forked from the test's (its modules already imported): UPDATES, then rank 0
    saves the losses and the weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import distributed
    _, _, world_size = distributed.distributed()
    data, trainer, losses = run_data(cfg), make_trainer(cfg, world_size=2), []
    for epoch, u in UPDATES:
        batches, n_tokens = data.micro_batches(epoch, u, cfg.micro_batch_size, rank, world_size)
        loss_sum, _ = trainer.update(batches, n_tokens)
        losses.append(distributed.all_reduce_sum(loss_sum, world_size).item() / n_tokens)
    if rank == 0:
        torch.save({"losses": losses, "params": parameters(trainer.raw_model)}, out)
    del trainer  # the DDP wrapper before the process group, as train.main does
    import gc
    gc.collect()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("context_windows", [False, True])
def test_ddp_with_the_schedule_equals_one_process(text_cache, tmp_path, context_windows):
    import multiprocessing
    cfg = config(text_cache, tmp_path, micro_batch_size=1, seq_len_schedule=CONTEXT, context_windows=context_windows)
    port, out, fork = free_port(), tmp_path / "ddp.pt", multiprocessing.get_context("fork")
    procs = [fork.Process(target=ddp_worker, args=(r, cfg, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    ddp = torch.load(out, weights_only=False)

    data, trainer, losses = run_data(cfg), make_trainer(cfg), []
    assert [(len(data.update_sequences(e, u)), data.context(e, u)) for e, u in UPDATES] == [(8, 8), (5, 16), (8, 32)]
    for epoch, u in UPDATES:
        batches, n_tokens = data.micro_batches(epoch, u, 4)
        assert {len(batch) for batch in batches} == {4 if context_windows else 2}  # (x, y[, positions, starts])
        losses.append(trainer.update(batches, n_tokens)[0].item() / n_tokens)
    assert ddp["losses"] == pytest.approx(losses, rel=1e-6)
    assert_close_parameters(ddp["params"], parameters(trainer.raw_model), 1e-5)


def test_a_run_with_the_schedule_compiles_each_shape_once(text_cache, tmp_path, monkeypatch):
    """Under torch.compile (dynamic=False) each new shape is a compile: the run's three contexts and the validation
    batch compile once each, with the recompile limit raised to what the run needs (set below it here)."""
    shapes, compile_ = [], torch.compile

    def counting_backend(gm, example_inputs):  # the token ids' and targets' shapes of each graph compiled
        shapes.append(tuple(tuple(t.shape) for t in example_inputs if t.dtype == torch.int64))
        return gm.forward
    monkeypatch.setattr(torch, "compile", lambda model, dynamic, mode: compile_(model, backend=counting_backend,
                                                                                dynamic=dynamic))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=2):  # restored afterwards, as the config's own API does
            entry = train.train(config(text_cache, tmp_path, compile=True, compile_scope="model", epochs=1,
                                       seq_len_schedule=CONTEXT))
            assert torch._dynamo.config.recompile_limit == 3 + train.EVALUATION_SHAPES
    finally:
        torch._dynamo.reset()
    assert entry["status"] == "complete" and entry["step"] == 6
    mcfg = model_lib.ModelConfig(**entry["recipe"]["model"])  # its FLOPs: each context by its share of the tokens
    assert entry["flops_per_token"] == model_lib.flops_per_token(mcfg, T, ((8, 0.3), (16, 0.6)))
    assert entry["flops_per_token"] < model_lib.flops_per_token(mcfg, T)
    window = lambda c: (2 * T // c, c)
    assert sorted(shapes) == sorted([(window(c),) * 2 for c in (8, 16, 32)] + [((4, T),) * 2])  # each once


# ---------------------------------------------------------------- context_windows: every context one shape

def test_window_tensors_have_one_shape_for_every_context_and_mark_its_windows():
    """Positions restart at each window; the window starts cover the rows' tokens, padded with empty windows to the
    smallest context's count, so that no context changes a shape (a compile, a CUDA graph's capture)."""
    made = {c: window_tensors(3, T, c, smallest=8) for c in (8, 16, 32)}
    assert {tuple(p.shape) for p, _ in made.values()} == {(T,)}
    assert {tuple(s.shape) for _, s in made.values()} == {(3 * T // 8 + 1,)}
    positions, starts = made[16]
    assert positions.tolist() == list(range(16)) * 2
    assert starts.dtype == torch.int32 and starts.tolist() == list(range(0, 3 * T + 1, 16)) + [3 * T] * 6


def test_context_windows_without_a_schedule_leaves_the_rows_as_they_are():
    """A config that keeps its windows in whole rows, run with its schedule dropped (--seq_len_schedule=): one
    context, so the micro-batches are the plain rows, and the first update's helper compiles the dense kernels."""
    tokens = torch.arange(N * T + 1, dtype=torch.int32)
    data = TrainData(tokens, T, 8, 0, context_steps=(), context_windows=True)
    batches, _ = data.micro_batches(0, 0, 4)
    assert not data.context_windows and all(len(batch) == 2 and batch[0].shape == (4, T) for batch in batches)
    from model_kernels import first_calls
    mcfg = model_lib.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=T)
    cfg = settings.Config(dict(compile=True, loss_impl="full", micro_batch_size=4, seq_len=T, warm_kernels=True,
                               attention_backend="auto", context_windows=True))
    job = first_calls.spec(cfg, mcfg, torch.device("cuda", 0), "fa4", [T], True)
    assert job["attention"] == [[4, T, 2, 16]] and job["windows"] == []


def test_windows_in_whole_rows_give_the_context_split_s_loss_and_gradients():
    """The model on rows of T with windows of 8 computes what it computes on the split rows of 8: the same targets
    from the same contexts, at the same positions (float32, the CPU's SDPA with a mask against its causal kernel)."""
    torch.manual_seed(0)
    net = model_lib.Transformer(model_lib.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                      max_seq_len=T, qk_norm=True, value_embeddings=1))
    x, y = torch.randint(0, 64, (3, T)), torch.randint(0, 64, (3, T))
    y[2, 5:] = IGNORE  # a padded row's ignored targets too
    losses, grads = [], []
    for batch in (split_context(x, y, 8), (x, y, *window_tensors(3, T, 8, smallest=8))):
        net.zero_grad()
        xs, ys, *windows = batch
        loss = net(xs, ys, reduction="sum", windows=tuple(windows) or None)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in net.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's attention kernels")
@pytest.mark.parametrize("choice", ["fa4", "sdpa", "cudnn"])
def test_each_attention_choice_computes_the_windows_as_the_math_kernel_does(choice):
    """context_windows through each GPU attention choice (flash-attn-4's variable-length kernels, SDPA's choice and
    cuDNN's with the windows' mask) against SDPA's math kernel, forward and backward, in bf16 at the speed
    candidate's shapes: windows of 256 in rows of 1024. On one H100 every choice was within 0.032 of math."""
    from model_kernels import registry
    from model_kernels.attention import windowed_attention
    why = registry.ATTENTION[choice].device_problem(torch.device("cuda"))
    if why:
        pytest.skip(why)
    torch.manual_seed(0)
    windows = tuple(t.cuda() for t in window_tensors(4, 1024, 256, smallest=256))
    inputs = [torch.randn(4, 1024, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def run(backends):
        q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
        out = windowed_attention(q, k, v, backends, windows)
        out.backward(inputs[3])
        return [out.float()] + [t.grad.float() for t in (q, k, v)]
    for got, want in zip(run(registry.ATTENTION[choice].backends), run(registry.ATTENTION["math"].backends)):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_a_run_with_context_windows_trains_as_the_context_split_does(text_cache, tmp_path):
    """Two epochs through the three contexts: the same tokens, targets and order, the same math; the weights and
    the curves agree with the split run's (not bit for bit: the masked and the split kernels add in other orders)."""
    recipe = dict(seq_len_schedule=CONTEXT, lr_schedule="wsd", cooldown_fraction=0.5)
    split = train.train(config(text_cache, tmp_path, name="split", out_dir=str(tmp_path / "split"), **recipe))
    whole = train.train(config(text_cache, tmp_path, name="whole", out_dir=str(tmp_path / "whole"),
                               context_windows=True, **recipe))
    assert whole["status"] == split["status"] == "complete" and whole["tokens"] == split["tokens"] == 2 * N * T
    assert whole["recipe"] == split["recipe"]  # an execution setting: the recipe is the same
    for a, b in zip(whole["training_curve"], split["training_curve"]):
        assert a["tokens"] == b["tokens"] and abs(a["loss"] - b["loss"]) < 1e-4
    a, b = checkpoint_parameters(tmp_path / "whole"), checkpoint_parameters(tmp_path / "split")
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)


def test_context_windows_compile_one_training_shape(text_cache, tmp_path, monkeypatch):
    """With context_windows the three contexts are one shape: the training graph compiles once (and validation's)."""
    shapes, compile_ = [], torch.compile

    def counting_backend(gm, example_inputs):
        shapes.append(tuple(tuple(t.shape) for t in example_inputs if t.dtype == torch.int64 and t.dim() == 2))
        return gm.forward
    monkeypatch.setattr(torch, "compile", lambda model, dynamic, mode: compile_(model, backend=counting_backend,
                                                                                dynamic=dynamic))
    torch._dynamo.reset()
    try:
        entry = train.train(config(text_cache, tmp_path, compile=True, compile_scope="model", epochs=1,
                                   seq_len_schedule=CONTEXT, context_windows=True))
    finally:
        torch._dynamo.reset()
    assert entry["status"] == "complete" and entry["step"] == 6
    mcfg = model_lib.ModelConfig(**entry["recipe"]["model"])  # its FLOPs: each context by its share of the tokens
    assert entry["flops_per_token"] == model_lib.flops_per_token(mcfg, T, ((8, 0.3), (16, 0.6)))
    assert entry["flops_per_token"] < model_lib.flops_per_token(mcfg, T)
    assert sorted(shapes) == sorted([((2, T),) * 2, ((4, T),) * 2])  # training's rows, validation's: once each


def windows_of(starts):
    return [(a, b) for a, b in zip(starts.tolist()[:-1], starts.tolist()[1:]) if b > a]


def varlen_forward_by_hand(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, return_lse,
                           out, lse, **unused):
    """flash-attn-4's _flash_attn_fwd over variable-length sequences, in plain torch: each window of the flattened
    tokens (N, H, D) attended causally alone, into out (N, H, D) and lse (H, N)."""
    assert causal and return_lse and not unused and torch.equal(cu_seqlens_q, cu_seqlens_k)
    assert cu_seqlens_q.dtype == torch.int32 and max_seqlen_q == max_seqlen_k
    for a, b in windows_of(cu_seqlens_q):
        assert b - a <= max_seqlen_q
        o, l = attention_forward_by_hand(*(t[None, a:b] for t in (q, k, v)))
        out[a:b], lse[:, a:b] = o[0], l[0]
    return out, lse, None, None, None


def varlen_backward_by_hand(q, k, v, out, dout, lse, causal, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dq, dk, dv, **unused):
    """flash-attn-4's _flash_attn_bwd over the same windows, in plain torch."""
    assert not unused
    for a, b in windows_of(cu_seqlens_q):
        grads = [torch.empty_like(t[None, a:b]) for t in (q, k, v)]
        attention_backward_by_hand(*(t[None, a:b] for t in (q, k, v, out, dout)), lse[None, :, a:b], causal, *grads)
        for full, part in zip((dq, dk, dv), grads):
            full[a:b] = part[0]
    return dq, dk, dv


@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_windows_op_gives_the_masked_sdpa_loss_and_gradients(flash_attn_4_stand_in, compiled):
    """The fa4 form of windowed attention (flash-attn-4's variable-length pair, written out by hand here): the model's
    loss and gradients equal the SDPA form's, so the op hands the kernels the flattened tokens, the window starts and
    the longest window, and uses what they return as they return it (compiled: its fakes agree)."""
    flash_attn_4_stand_in._flash_attn_fwd = varlen_forward_by_hand
    flash_attn_4_stand_in._flash_attn_bwd = varlen_backward_by_hand
    config = model_lib.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=T)
    x, y = torch.randint(0, 64, (3, T)), torch.randint(0, 64, (3, T))
    windows = window_tensors(3, T, 16, smallest=8)
    results = {}
    for backend in ("math", "fa4"):
        torch.manual_seed(0)
        net = model_lib.Transformer(config)
        net.set_attention_backend(backend)
        run = torch.compile(net, backend="inductor", dynamic=False) if compiled else net
        loss = run(x, y, windows=windows)
        loss.backward()
        results[backend] = loss.detach(), [p.grad for p in net.parameters()]
    (loss_a, grads_a), (loss_b, grads_b) = results["math"], results["fa4"]
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_the_first_calls_child_compiles_the_windows_pair_at_the_run_s_shapes(flash_attn_4_stand_in, capsys):
    """A cold run with context_windows hands its child (model_kernels/first_calls.py) the rows' job; the child calls
    flash-attn-4's variable-length forward and backward once each, at the run's flattened shape, with the window
    starts of the smallest context and the row's length as the longest window (what the run's own calls compile),
    then prints its line."""
    import json
    import time
    from model_kernels import first_calls
    calls = []

    def recording(kernel, by_hand):
        def call(*args, **kwargs):
            q, starts = args[0], kwargs["cu_seqlens_q"]
            calls.append((kernel, tuple(q.shape), q.dtype, starts.tolist(), kwargs["max_seqlen_q"]))
            return by_hand(*args, **kwargs)
        return call
    flash_attn_4_stand_in._flash_attn_fwd = recording("forward", varlen_forward_by_hand)
    flash_attn_4_stand_in._flash_attn_bwd = recording("backward", varlen_backward_by_hand)
    mcfg = model_lib.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=T)
    cfg = settings.Config(dict(compile=True, loss_impl="full", micro_batch_size=2, seq_len=T, warm_kernels=True,
                               attention_backend="auto", context_windows=True))
    job = first_calls.spec(cfg, mcfg, torch.device("cuda", 0), "fa4", [8, 16, T], True)
    job["device"] = "cpu"  # the kernels written out by hand run here
    first_calls.compile_kernel("attention", time.time(), lambda: json.dumps(job))
    starts = list(range(0, 2 * T + 1, 8))
    assert calls == [("forward", (2 * T, 2, 16), torch.bfloat16, starts, T),
                     ("backward", (2 * T, 2, 16), torch.bfloat16, starts, T)]
    assert first_calls.ready_line("attention", capsys.readouterr().out.splitlines()[-1]) is not None


def test_a_pinned_sdpa_kernel_runs_the_windows_too():
    """attention_backend=math (or cudnn) with context windows ran SDPA's own pick of kernel: the pin held for the
    dense rows only. The same numbers either way; the kernel is what a pin is for."""
    from torch.profiler import ProfilerActivity, profile
    from torch.nn.attention import SDPBackend
    from model_kernels.attention import causal_attention
    q, k, v = (torch.randn(2, T, 2, 16) for _ in range(3))
    windows = window_tensors(2, T, 8, smallest=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pinned = causal_attention(q, k, v, SDPBackend.MATH, windows)
    assert "aten::_scaled_dot_product_attention_math" in {e.name for e in prof.events()}
    assert torch.allclose(pinned, causal_attention(q, k, v, None, windows), atol=1e-5)
