"""train.py and data/loader.py: exact token accounting, determinism, resumption, the results entry and DDP."""
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
import configurator
from results import lookup, read_results
import trainer as trainer_lib
import env
import model as model_lib
import settings
import train
from data.loader import IGNORE, TokenCache, TrainData
from tests.conftest import flash_attn_4_installed, write_cache
import plan
from tests.conftest import check_execution, setup

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64
SEQUENCES_PER_UPDATE = 8
N_SEQUENCES = 21  # not a multiple of 8: updates of 8, 8 and 5 sequences


@pytest.fixture(autouse=True)
def restore_threads():
    """Trainer(cpu_threads=1) sets the process-wide thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def small_config(cache, tmp_path, **overrides):
    cfg = dict(train.DEFAULTS)
    cfg.update(name="t", preset="20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, seq_len=SEQ_LEN,
               device="cpu", cpu_threads=1, data_dir=str(cache), train_subset_tokens=N_SEQUENCES * SEQ_LEN + 1,
               val_subset_tokens=16 * SEQ_LEN, epochs=2, tokens_per_update=SEQUENCES_PER_UPDATE * SEQ_LEN,
               micro_batch_size=4, warmup_updates=2, learning_rate=3e-3, min_lr=3e-4, eval_batch_size=16,
               log_interval=1, results_file=str(tmp_path / "results.json"), out_dir=str(tmp_path / "out"))
    cfg.update(overrides)
    assert set(cfg) == set(train.DEFAULTS)
    return settings.Config(cfg)


def cli_args(cfg):
    return [f"--{k}={v}" for k, v in cfg.items()]


def make_trainer(cfg, total_updates=10, world_size=1):
    cache = TokenCache(cfg.data_dir)
    mcfg = plan.model_config(cfg, cache.vocab_size)
    return trainer_lib.Trainer(cfg, mcfg, "cpu", total_updates, world_size=world_size)


def train_data(cfg, seed=None):
    cache = TokenCache(cfg.data_dir)
    return TrainData(cache.train, cfg.seq_len, cfg.tokens_per_update // cfg.seq_len,
                     cfg.seed if seed is None else seed, cfg.train_subset_tokens)


def sequence_index(data):
    """Map a sequence's (input, target) bytes to its index, to see which sequences a micro-batch holds."""
    index = {}
    for i in range(data.n_sequences):
        chunk = np.asarray(data.tokens[i * data.seq_len:(i + 1) * data.seq_len + 1], dtype=np.int64)
        index[chunk.tobytes()] = i
    assert len(index) == data.n_sequences  # real text: no two sequences are identical
    return index


def sequences_in(batches, index):
    """Indices of the real (not padded) rows of micro-batches, in order; checks that padding is all -100."""
    found = []
    for x, y in batches:
        for row_x, row_y in zip(x, y):
            if (row_y == IGNORE).all():
                assert (row_x == 0).all()
                continue
            assert not (row_y == IGNORE).any()  # training sequences are never partly padded
            found.append(index[np.concatenate([row_x.numpy()[:1], row_y.numpy()]).tobytes()])
    return found


def parameters(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def checkpoint_parameters(out_dir):
    return torch.load(Path(out_dir) / "ckpt.pt", map_location="cpu", weights_only=False)["model"]


def assert_close_parameters(a, b, rel):
    assert a.keys() == b.keys()
    for n in a:
        err = ((a[n] - b[n]).norm() / b[n].norm()).item()
        assert err < rel, (n, err)


# ---------------------------------------------------------------- the update step

def test_micro_batch_size_does_not_change_an_update(text_cache, tmp_path):
    results = {}
    for micro in (2, 8):
        cfg = small_config(text_cache, tmp_path, micro_batch_size=micro)
        data = train_data(cfg)
        trainer = make_trainer(cfg)
        for u in range(2):
            batches, n_tokens = data.micro_batches(0, u, micro)
            assert len(batches) == SEQUENCES_PER_UPDATE // micro and n_tokens == SEQUENCES_PER_UPDATE * SEQ_LEN
            loss_sum, grad_norm = trainer.update(batches, n_tokens)
            results[micro, u] = loss_sum.item() / n_tokens, grad_norm.item()
        results[micro] = parameters(trainer.raw_model)
    for u in range(2):
        (loss_a, norm_a), (loss_b, norm_b) = results[2, u], results[8, u]
        assert loss_a == pytest.approx(loss_b, rel=1e-5)
        assert norm_a == pytest.approx(norm_b, rel=1e-5)
    assert_close_parameters(results[2], results[8], 1e-5)
    start = parameters(make_trainer(small_config(text_cache, tmp_path)).raw_model)
    assert any(not torch.equal(start[n], results[8][n]) for n in start)  # the updates did change the weights


@pytest.mark.parametrize("compile_mode, micro, world_size, stable", [
    ("reduce-overhead", 2, 1, True), ("max-autotune", 4, 1, True), ("reduce-overhead", 8, 1, False),
    ("reduce-overhead", 4, 2, False), ("default", 2, 1, False), ("max-autotune-no-cudagraphs", 2, 1, False)])
def test_cuda_graphs_with_accumulation_keep_gradients_outside_the_graphs(compile_mode, micro, world_size, stable):
    """Under CUDA graphs a .grad made by a graph's backward is overwritten by the next micro-step's replay:
    exactly the combinations that accumulate (more than one micro-step per process) keep stable gradients."""
    cfg = settings.Config(train.DEFAULTS, compile=True, compile_mode=compile_mode, micro_batch_size=micro,
                       seq_len=64, tokens_per_update=8 * 64)
    assert (trainer_lib.uses_cudagraphs(cfg) and settings.micro_steps(cfg, world_size) > 1) is stable


@pytest.mark.parametrize("micro, stable", [(2, True), (8, False)])
def test_the_trainer_gives_accumulating_cuda_graphs_zeroed_gradients_before_the_first_update(text_cache, tmp_path,
                                                                                          micro, stable):
    """What the Trainer builds, not only the rule: compiling waits for the first call, so the CUDA-graph
    configuration can be built on the CPU and its gradients inspected before any update."""
    cfg = small_config(text_cache, tmp_path, compile=True, compile_mode="reduce-overhead", micro_batch_size=micro)
    trainer = make_trainer(cfg)
    assert trainer.stable_grads is stable
    grads = [p.grad for p in trainer.raw_model.parameters()]
    if stable:
        assert all(g is not None and not g.any() for g in grads)
    else:
        assert all(g is None for g in grads)


def test_stable_gradients_give_the_same_updates_bitwise(text_cache, tmp_path):
    """The accumulation that CUDA graphs need (zeroed gradients added into in place) is the same arithmetic as
    the default (the first micro-step's gradient taken as it comes, later ones added)."""
    cfg = small_config(text_cache, tmp_path, micro_batch_size=2)
    data = train_data(cfg)
    plain, stable = make_trainer(cfg), make_trainer(cfg)
    stable.stable_grads = True
    stable.allocate_gradients()
    grads = [p.grad for p in stable.raw_model.parameters()]
    for u in range(3):
        batches, n_tokens = data.micro_batches(0, u, 2)
        assert [t.item() for t in plain.update(batches, n_tokens)] == [t.item() for t in stable.update(batches, n_tokens)]
    assert all(p.grad is g and not g.any() for p, g in zip(stable.raw_model.parameters(), grads))  # kept, zeroed
    assert all(p.grad is None for p in plain.raw_model.parameters())
    for n, p in parameters(plain.raw_model).items():
        assert torch.equal(p, parameters(stable.raw_model)[n]), n


def test_one_autocast_region_per_update_casts_each_weight_once_with_the_same_math(text_cache, tmp_path):
    """Trainer.update keeps one autocast region over all micro-steps, so eager (launch-bound) casts each
    weight to bf16 once per update, not once per micro-step; the update must equal one with an autocast
    region per micro-step forward, as PyTorch's recipe writes it. Autocast is turned on for the CPU here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        def __init__(self, shapes):
            super().__init__()
            self.shapes, self.count = shapes, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                    and args[0].dtype == torch.float32 and tuple(args[0].shape) in self.shapes):
                self.count += 1
            return func(*args, **kwargs)

    cfg = small_config(text_cache, tmp_path, micro_batch_size=2)
    data = train_data(cfg)
    trainer, reference = make_trainer(cfg), make_trainer(cfg)
    for t in (trainer, reference):
        t.autocast_dtype = torch.bfloat16
    weights = [p for p in trainer.raw_model.parameters() if p.dim() == 2]
    for u in range(2):
        batches, n_tokens = data.micro_batches(0, u, cfg.micro_batch_size)
        assert len(batches) == 4
        with WeightCasts({tuple(p.shape) for p in weights}) as casts:
            loss_sum, grad_norm = trainer.update(batches, n_tokens)
        assert casts.count == len(weights)  # the tied embedding and head: one matrix, cast once
        # the reference: an autocast region per micro-step forward, backward outside it
        expected_loss = 0.0
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = reference.model(x, y, reduction="sum")
            (loss / n_tokens).backward()
            expected_loss += loss.item()
        for group in reference.optimizer.param_groups:
            group["lr"] = reference.lr_at(reference.step)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.raw_model.parameters(), cfg.grad_clip)
        reference.optimizer.step()
        reference.optimizer.zero_grad(set_to_none=True)
        reference.step += 1
        assert loss_sum.item() == pytest.approx(expected_loss, rel=1e-6)
        assert torch.equal(grad_norm, expected_norm)
        for (name, p), q in zip(trainer.raw_model.named_parameters(), reference.raw_model.parameters()):
            assert torch.equal(p, q), name


def test_grad_clip_0_turns_clipping_off_and_still_reports_the_norm(text_cache, tmp_path):
    """As in nanoGPT. Before, 0 clipped every gradient to nothing, and no weight ever moved."""
    cfg = small_config(text_cache, tmp_path, grad_clip=0.0, weight_decay=0.0)
    run_plan = plan.resolve(cfg, world=(0, 0, 1))
    mcfg, data = run_plan.model, plan.training_data(run_plan)
    trainers = []
    for max_norm in (0.0, 1e9):  # off, and a limit no norm reaches: the same update
        torch.manual_seed(0)
        trainers.append(trainer_lib.Trainer(settings.Config(cfg, grad_clip=max_norm), mcfg, "cpu", total_updates=10))
    before = [p.detach().clone() for p in trainers[0].raw_model.parameters()]
    batches, n_tokens = data.micro_batches(0, 0, cfg.micro_batch_size)
    (_, norm_off), (_, norm_far) = (t.update(batches, n_tokens) for t in trainers)
    assert norm_off.item() > 0 and torch.equal(norm_off, norm_far)
    for p, q, b in zip(trainers[0].raw_model.parameters(), trainers[1].raw_model.parameters(), before):
        assert torch.equal(p, q) and not torch.equal(p, b)


def test_a_partial_update_is_the_token_weighted_mean(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path)
    data = train_data(cfg)
    last = data.updates_per_epoch - 1
    batches, n_tokens = data.micro_batches(0, last, 4)  # 5 sequences: micro-batches of 4 and 1 (+3 padded rows)
    assert n_tokens == 5 * SEQ_LEN == sum(int((y != IGNORE).sum()) for _, y in batches)

    trainer = make_trainer(cfg)
    with torch.no_grad():
        per_token = torch.cat([trainer.raw_model(x, y, reduction="none") for x, y in batches])
        counted = torch.cat([(y != IGNORE).flatten() for _, y in batches])
        manual = per_token[counted].double().mean().item()
        means = [trainer.raw_model(x, y).item() for x, y in batches]
    loss_sum, grad_norm = trainer.update(batches, n_tokens)
    assert loss_sum.item() / n_tokens == pytest.approx(manual, rel=1e-5)
    assert abs(sum(means) / len(means) - manual) > 1e-4  # the mean of micro-batch means would be another number

    # the padded update has the gradient of one unpadded batch of the same 5 sequences (the gradient norm is
    # the scale-sensitive check: Adam's first step is nearly sign(gradient), blind to a wrong scale)
    x = torch.cat([x[y[:, 0] != IGNORE] for x, y in batches])
    y = torch.cat([y[y[:, 0] != IGNORE] for _, y in batches])
    reference = make_trainer(cfg)
    ref_sum, ref_norm = reference.update([(x, y)], n_tokens)
    assert ref_sum.item() == pytest.approx(loss_sum.item(), rel=1e-5)
    assert ref_norm.item() == pytest.approx(grad_norm.item(), rel=1e-5)
    assert_close_parameters(parameters(trainer.raw_model), parameters(reference.raw_model), 1e-4)


# ---------------------------------------------------------------- the loader

def test_every_sequence_once_per_epoch_and_padded_last_update(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path)
    data = train_data(cfg)
    assert data.n_sequences == N_SEQUENCES and data.updates_per_epoch == 3
    index = sequence_index(data)
    for epoch in range(2):
        for micro in (1, 2, 4, 8):
            seen, tokens = [], 0
            for u in range(data.updates_per_epoch):
                batches, n_tokens = data.micro_batches(epoch, u, micro)
                assert all(x.shape == y.shape == (micro, SEQ_LEN) for x, y in batches)
                assert n_tokens == sum(int((y != IGNORE).sum()) for _, y in batches)
                got = sequences_in(batches, index)
                assert got == list(data.update_sequences(epoch, u))
                seen += got
                tokens += n_tokens
            assert sorted(seen) == list(range(N_SEQUENCES))
            assert tokens == N_SEQUENCES * SEQ_LEN == data.tokens_per_epoch
    # the last update holds the 5 left-over sequences, padded with ignored targets to full micro-batches
    batches, n_tokens = data.micro_batches(0, 2, 4)
    assert n_tokens == 5 * SEQ_LEN and len(batches) == 2
    assert int((batches[1][1] == IGNORE).all(dim=1).sum()) == 3


# tokens beyond 6 x 8: a sequence needs seq_len + 1 tokens (its targets are the inputs shifted by one), so exactly
# 48 tokens hold 5 whole sequences, not 6 (the sixth's last target would be missing)
@pytest.mark.parametrize("left_over, whole", [(6, 6), (1, 6), (0, 5), (8, 6)])
def test_targets_are_every_token_after_the_first_once_up_to_the_last_whole_sequence(left_over, whole):
    """With a remainder, as the loader's docstring says: the tokens after the last whole sequence are never
    targets, and every other token after the first is one exactly once per epoch."""
    seq_len = 8
    tokens = np.arange(6 * seq_len + left_over, dtype=np.int64)  # each token's value is its position
    data = TrainData(tokens, seq_len, sequences_per_update=4, seed=0)
    assert data.n_sequences == whole and data.tokens_per_epoch == whole * seq_len
    targets = []
    for u in range(data.updates_per_epoch):
        batches, _ = data.micro_batches(0, u, 2)
        targets += [int(t) for _, y in batches for t in y.flatten() if t != IGNORE]
    assert sorted(targets) == list(range(1, whole * seq_len + 1))  # the last 5 positions never appear


@pytest.mark.parametrize("n, seq_len, batch, max_tokens", [(1000, 8, 4, 0), (1000, 8, 4, 57), (1000, 7, 3, 0),
                                                           (9, 8, 4, 0), (1, 8, 4, 0), (1000, 8, 4, 5000)])
def test_eval_batches_score_each_token_once_and_their_count_is_known_ahead(n, seq_len, batch, max_tokens):
    """The validation bar's total is eval_batch_count; a wrong count would leave the bar short or over."""
    from data.loader import eval_batch_count, eval_batches
    tokens = np.arange(n, dtype=np.int64)  # each token's value is its position
    batches = list(eval_batches(tokens, seq_len, batch, max_tokens))
    assert len(batches) == eval_batch_count(n, seq_len, batch, max_tokens)
    assert all(x.shape == y.shape == (batch, seq_len) for x, y in batches)
    targets = sorted(int(t) for _, y in batches for t in y.flatten() if t != IGNORE)
    assert targets == list(range(1, min(max_tokens or n, n)))


def test_the_run_counts_every_token_exactly(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path, epochs=3, full_validation=False)
    entry = train.train(cfg)
    assert entry["tokens"] == 3 * N_SEQUENCES * SEQ_LEN
    assert entry["step"] == entry["total_updates"] == 3 * 3
    assert [p["tokens"] for p in entry["validation_curve"]] == [e * N_SEQUENCES * SEQ_LEN for e in (1, 2, 3)]
    assert entry["final_validation"] is None


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_same_seed_gives_the_same_updates(text_cache, tmp_path, world_size):
    cfg = small_config(text_cache, tmp_path)
    data = train_data(cfg)
    index = sequence_index(data)
    for epoch in range(2):
        for u in range(data.updates_per_epoch):
            reference = sorted(sequences_in(data.micro_batches(epoch, u, 8)[0], index))
            for micro in (1, 2, 4):
                fresh = train_data(cfg)  # another process with the same seed
                shares = [fresh.micro_batches(epoch, u, micro, rank, world_size) for rank in range(world_size)]
                assert len({len(b) for b, _ in shares}) == 1  # every rank makes as many micro-steps
                assert {n for _, n in shares} == {len(reference) * SEQ_LEN}  # each knows the update's total
                ranks = [sequences_in(b, index) for b, _ in shares]
                assert sorted(sum(ranks, [])) == reference
                if world_size > 1:
                    assert not set(ranks[0]) & set(ranks[1])


def test_the_order_depends_on_seed_and_epoch(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path)
    a, b = train_data(cfg), train_data(cfg, seed=cfg.seed + 1)
    order = lambda d, e: [list(d.update_sequences(e, u)) for u in range(d.updates_per_epoch)]
    assert order(a, 0) == order(train_data(cfg), 0)
    assert order(a, 0) != order(b, 0)
    assert order(a, 0) != order(a, 1)
    assert sorted(sum(order(b, 0), [])) == list(range(N_SEQUENCES))


# ---------------------------------------------------------------- kill and resume

@pytest.mark.parametrize("recipe", [{}, dict(optimizer="muon", muon_lr=0.01, lr_schedule="wsd", cooldown_fraction=0.5)],
                         ids=["adamw-cosine", "muon-wsd"])
def test_stop_and_resume_is_bitwise_identical(text_cache, tmp_path, recipe):
    straight = small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"), **recipe)
    full = train.train(straight)

    cfg = small_config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), **recipe)
    # session 1 stops mid-epoch; session 2 resumes mid-epoch and stops after an epoch's end; session 3 finishes
    first = train.train(settings.Config(cfg, stop_after_updates=2))
    assert first["status"] == "interrupted" and first["step"] == 2 and first["tokens"] == 16 * SEQ_LEN
    assert (tmp_path / "resumed" / "ckpt.pt").exists()
    assert lookup(cfg.results_file, ["resumed", "status"]) == "interrupted"
    second = train.train(settings.Config(cfg, resume=True, stop_after_updates=2))
    assert second["status"] == "interrupted" and second["step"] == 4 and second["epochs"] == 1
    last = train.train(settings.Config(cfg, resume=True))
    assert last["status"] == "complete" and last["sessions"] == 3
    assert last["run_id"] == first["run_id"]
    assert "history" not in read_results(cfg.results_file)  # one run, updating its own entry

    assert last["final_validation"]["loss"] == full["final_validation"]["loss"]
    assert [p["loss"] for p in last["validation_curve"]] == [p["loss"] for p in full["validation_curve"]]
    # the training curve of the three processes is the uninterrupted run's, point for point
    curve = lambda entry: [(p["update"], p["tokens"], p["loss"], p["lr"], p["grad_norm"]) for p in entry["training_curve"]]
    assert curve(last) == curve(full) and len(curve(full)) == full["step"]  # log_interval 1
    assert last["tokens"] == full["tokens"] and last["step"] == full["step"]
    a, b = checkpoint_parameters(tmp_path / "straight"), checkpoint_parameters(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_keeps_what_the_run_recorded_before_its_stops(text_cache, tmp_path):
    """time-to-target reads the target's first reach, the best subset loss and the training seconds of each run: a
    resumed run must keep the earlier sessions' (reached at update 2, not never; the best of epoch 1, not of the last
    session's evaluations; the seconds of all three sessions)."""
    common = dict(eval_interval=1, learning_rate=3e-2, min_lr=3e-3)  # a rate that overshoots after update 2
    free = train.train(small_config(text_cache, tmp_path, name="free", out_dir=str(tmp_path / "free"), **common))
    losses = [p["loss"] for p in free["validation_curve"]]
    assert losses.index(min(losses)) == 1  # the best comes in the first session
    common["target_loss"] = losses[1]  # first reached at the second update's evaluation, before the first stop
    straight = train.train(small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"),
                                        **common))
    cfg = small_config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), **common)
    first = train.train(settings.Config(cfg, stop_after_updates=2))
    second = train.train(settings.Config(cfg, resume=True, stop_after_updates=2))
    last = train.train(settings.Config(cfg, resume=True))
    assert straight["target"]["reached"]["update"] == 2
    keep = lambda reached: {k: v for k, v in reached.items() if k != "training_seconds"}  # a clock, not the math
    assert keep(last["target"]["reached"]) == keep(straight["target"]["reached"])
    assert last["target"]["reached"]["training_seconds"] <= first["training_seconds"]
    assert (last["best_subset_loss"], last["best_epoch"]) == (straight["best_subset_loss"], straight["best_epoch"])
    assert first["training_seconds"] < second["training_seconds"] < last["training_seconds"]
    assert len(last["interval_tokens_per_second"]) == len(last["training_curve"]) == last["step"]  # log_interval 1


def test_a_resumed_training_curve_is_the_uninterrupted_ones_with_stops_inside_a_log_interval(text_cache, tmp_path):
    """The loss and tokens of the log interval a stop cut were not in the checkpoint, and the resumed process's
    first log point averaged only its own updates (8.096 for the uninterrupted 8.2136). Two stops inside one
    interval (log_interval 4: updates 1-2, then 3, then 4-6) give the uninterrupted curve, point for point."""
    common = dict(epochs=1, train_subset_tokens=6 * SEQUENCES_PER_UPDATE * SEQ_LEN + 1, log_interval=4)
    full = train.train(small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"),
                                    **common))
    cfg = small_config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), **common)
    kept = lambda: checkpoint.peek(tmp_path / "resumed" / "ckpt.pt", "open_interval") or {}
    assert train.train(settings.Config(cfg, stop_after_updates=2))["training_curve"] == []
    first = kept()
    assert train.train(settings.Config(cfg, resume=True, stop_after_updates=1))["step"] == 3
    second = kept()
    last = train.train(settings.Config(cfg, resume=True))
    assert last["status"] == "complete" and last["sessions"] == 3
    curve = lambda entry: [(p["update"], p["tokens"], p["loss"], p["lr"], p["grad_norm"])
                           for p in entry["training_curve"]]
    assert [p[0] for p in curve(full)] == [4, 6] and curve(last) == curve(full)
    # what the checkpoints kept of the interval: its updates and tokens so far, and their loss sum
    assert (first.get("updates"), first.get("tokens"), second.get("updates")) == (2, 2 * SEQ_LEN * 8, 3)
    assert 0 < first["loss_sum"] < second["loss_sum"] and not kept()  # the complete run's: no interval open
    # the cut interval's rate is its tokens over its training seconds in all three processes
    assert len(last["interval_tokens_per_second"]) == 2 and all(r > 0 for r in last["interval_tokens_per_second"])


def test_resume_restores_the_random_number_generators(text_cache, tmp_path):
    """Nothing in this model draws random numbers after it is built (no dropout), so equal losses cannot show
    it: a resumed process continues the saved generators' streams, whatever it drew before resuming."""
    cfg = small_config(text_cache, tmp_path, epochs=1)
    train.train(settings.Config(cfg, stop_after_updates=1))
    saved = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)["rng"]
    run = train.Run(plan.resolve(settings.Config(cfg, resume=True)))
    torch.manual_seed(12345), np.random.seed(12345), random.seed(12345)
    run.resume_or_start()
    assert torch.get_rng_state().tolist() == saved["torch"].tolist()
    assert np.random.get_state()[1].tolist() == saved["numpy"][1].tolist() and random.getstate() == saved["python"]


def test_the_random_number_generators_resume_from_a_checkpoint_read_onto_another_device(text_cache, tmp_path):
    """A resume reads the checkpoint with map_location on the run's device (a GPU's resume failed so: "RNG state
    must be a torch.ByteTensor"). The meta device stands in for the GPU: it moves every tensor off the CPU."""
    cfg = small_config(text_cache, tmp_path, epochs=1)
    train.train(settings.Config(cfg, stop_after_updates=1))
    path = tmp_path / "out" / "ckpt.pt"
    expected = torch.load(path, weights_only=False)["rng"]["torch"].tolist()
    torch.manual_seed(12345)
    checkpoint.set_rng_state(checkpoint.read(path, "meta")["rng"])
    assert torch.get_rng_state().tolist() == expected
    torch.manual_seed(12345)  # a checkpoint that kept torch's state as a tensor, as older ones did
    checkpoint.set_rng_state(dict(checkpoint.rng_state(), torch=torch.tensor(expected, dtype=torch.uint8)))
    assert torch.get_rng_state().tolist() == expected


class FakeCudaGenerator:
    def __init__(self):
        self.state = None

    def set_state(self, state):
        self.state = state.tolist()


def test_the_cuda_generator_kept_and_restored_is_the_run_devices_own(monkeypatch):
    """rng_state() kept the state of every visible GPU's generator and a resume set as many: a run trained where 8
    GPUs were visible died with an IndexError resumed where fewer were. Now the run's own GPU's is kept and restored,
    and an older checkpoint's list gives the entry of the run's device index (no GPU here: torch.cuda mocked)."""
    generators = (FakeCudaGenerator(), FakeCudaGenerator())  # two GPUs visible at the resume
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the model is on its GPU when Run.load runs
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": asked.append(device) or torch.full((16,), 7, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every visible GPU's state was read"))
    state = checkpoint.rng_state("cuda:1")
    assert asked == ["cuda:1"] and state["cuda"].tolist() == [7] * 16
    checkpoint.set_rng_state(state, "cuda:1")
    assert generators[1].state == [7] * 16 and generators[0].state is None
    old = dict(state, cuda=[np.full(16, i, np.uint8) for i in range(8)])  # an older checkpoint, of 8 GPUs
    checkpoint.set_rng_state(old, "cuda:1")
    assert generators[1].state == [1] * 16 and generators[0].state is None
    checkpoint.set_rng_state(old, "cuda")  # the current device's
    assert generators[0].state == [0] * 16
    checkpoint.set_rng_state(dict(old, cuda=old["cuda"][:1]), "cuda:1")  # none kept for it: left as it is
    assert generators[1].state == [1] * 16
    assert "cuda" not in checkpoint.rng_state("cpu")  # a CPU run keeps no GPU's
    checkpoint.set_rng_state(state, "cpu")
    assert generators[0].state == [0] * 16 and generators[1].state == [1] * 16


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def run_train(args, log, **kwargs):
    return subprocess.Popen([sys.executable, "-u", str(REPO / "train.py"), *args], cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, **kwargs)


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(text_cache, tmp_path):
    # long enough (40 updates per epoch) that the signal lands mid-run
    common = dict(train_subset_tokens=40 * 8 * SEQ_LEN + 1, val_subset_tokens=4 * SEQ_LEN, epochs=2)
    straight = small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"), **common)
    cfg = small_config(text_cache, tmp_path, name="killed", out_dir=str(tmp_path / "killed"), **common)

    reference = run_train(cli_args(straight), tmp_path / "straight.log")
    log = tmp_path / "killed.log"
    proc = run_train(cli_args(cfg), log)
    try:
        wait_for(lambda: "update 1/" in log.read_text() or proc.poll() is not None, 120, "the first update")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == train.EXIT_INTERRUPTED, log.read_text()  # checkpointed, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
    entry = lookup(cfg.results_file, ["killed"])
    assert entry["status"] == "interrupted", log.read_text()
    assert 0 < entry["step"] < entry["total_updates"]
    assert "signal SIGTERM: checkpointed" in log.read_text()
    assert (tmp_path / "killed" / "ckpt.pt").exists()

    resumed = run_train(cli_args(cfg) + ["--resume=True"], tmp_path / "resumed.log")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
    assert reference.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()
    results = read_results(cfg.results_file)
    done, ref = results["killed"], results["straight"]
    assert done["status"] == ref["status"] == "complete" and done["sessions"] == 2
    assert done["tokens"] == ref["tokens"] == 2 * 40 * 8 * SEQ_LEN
    assert done["final_validation"]["loss"] == ref["final_validation"]["loss"]
    a, b = checkpoint_parameters(tmp_path / "straight"), checkpoint_parameters(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_recipe_but_accepts_other_execution(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path)
    train.train(settings.Config(cfg, stop_after_updates=1))
    with pytest.raises(configurator.ConfigError) as info:
        train.train(settings.Config(cfg, resume=True, learning_rate=1e-3))
    assert "learning_rate" in str(info.value)
    assert "micro_batch_size" not in str(info.value)
    capsys.readouterr()
    assert train.main(cli_args(cfg) + ["--resume=True", "--epochs=3"]) == 2
    assert "epochs" in capsys.readouterr().err
    assert lookup(cfg.results_file, ["t", "status"]) == "interrupted"  # the refused sessions wrote nothing
    entry = train.train(settings.Config(cfg, resume=True, micro_batch_size=2, eval_batch_size=8))
    assert entry["status"] == "complete" and entry["sessions"] == 2
    assert entry["tokens"] == 2 * N_SEQUENCES * SEQ_LEN


# ---------------------------------------------------------------- recipe identity

# Every default is either part of the recipe (what is computed) or execution (how it is run).
RECIPE_KEYS = {"preset", "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "seq_len", "train_subset_tokens",
               "val_subset_tokens", "full_validation", "seed", "epochs", "tokens_per_update", "learning_rate",
               "min_lr", "warmup_updates", "weight_decay", "beta1", "beta2", "adam_eps", "grad_clip",
               "init_from",  # as the hash of the weights it names
               "residual_dtype", "lm_head_fp8",  # only off their defaults, float32 and False
               # the time-to-quality recipe keys, also only off their defaults
               "optimizer", "muon_lr", "muon_momentum", "muon_ns_steps", "muon_adjust_lr", "lr_schedule",
               "cooldown_fraction",
               # the time-to-quality levers (#38), also only off their defaults
               "normuon", "muon_split_projections", "ema", "seq_len_schedule", "qk_norm", "value_embeddings"}


def test_every_default_is_classified():
    """The declared roles are the ones this list pins: a key that moves between recipe and execution changes
    which runs count as the same recipe."""
    execution, run = settings.execution_keys(), settings.keys_of_role(settings.RUN)
    assert not execution & RECIPE_KEYS and not run & RECIPE_KEYS and not run & execution
    assert execution | run | RECIPE_KEYS == set(train.DEFAULTS), "classify the new key here and in settings.py"
    # the identity hashes these at any value; every other recipe key only off its default
    assert settings.IDENTITY_KEYS <= RECIPE_KEYS and not {"optimizer", "residual_dtype"} & settings.IDENTITY_KEYS


def recipe_id(cfg, cache_identity="cache"):
    mcfg = plan.model_config(cfg, 256)
    return env.hash_json(settings.recipe(cfg, mcfg, cache_identity))


@pytest.mark.parametrize("change", [dict(learning_rate=1e-3), dict(seed=1), dict(epochs=3), dict(dim=128),
                                    dict(residual_dtype="bfloat16"), dict(lm_head_fp8=True, loss_impl="fused"),
                                    dict(n_layers=3), dict(hidden_dim=256), dict(seq_len=32),
                                    dict(tokens_per_update=1024), dict(train_subset_tokens=999)])
def test_the_recipe_identity_follows_the_math(text_cache, tmp_path, change):
    cfg = small_config(text_cache, tmp_path)
    assert recipe_id(settings.Config(cfg, **change)) != recipe_id(cfg)


@pytest.mark.parametrize("change", [dict(micro_batch_size=2), dict(compile=True), dict(attention_backend="math"),
                                    dict(cpu_threads=2), dict(device="cuda"), dict(name="other"),
                                    dict(out_dir="elsewhere"), dict(loss_impl="fused"), dict(log_interval=7)])
def test_the_recipe_identity_ignores_execution(text_cache, tmp_path, change):
    cfg = small_config(text_cache, tmp_path)
    assert recipe_id(settings.Config(cfg, **change)) == recipe_id(cfg)


# The recipe identities of the shipped configs (with a fixed cache identity), as recorded by every run of them:
# a change of code that moves one makes earlier runs unresumable and uncomparable, so it must be deliberate.
SHIPPED_RECIPES = {
    "config/20m_gh200.py": ("36b1a1c183de09f546f608dbc1856e5b952ae0421fb2f079b68ed9e6d7f7f01b", 32000),
    "config/50m.py": ("a7b3ba62cf69381773f5ab92ad4115d6b7ac56e0c763df88c2ab53dda3c1fbb7", 32000),
    "config/90m.py": ("b84aca720e57afdb99f2d765d9ab4f64cc93829fe04f972f0449348f369496d6", 32000),
    "config/tiny_cpu.py": ("59c944b0805cba48f8128861324fce3fb7b56eb260f408efc5aee1569f403f61", 4096),
}


@pytest.mark.parametrize("path", sorted(SHIPPED_RECIPES))
def test_the_shipped_configs_keep_their_recipe_identity(path):
    identity, vocab = SHIPPED_RECIPES[path]
    cfg = settings.Config(configurator.load_config(train.DEFAULTS, [str(REPO / path)]))
    mcfg = plan.model_config(cfg, vocab)
    assert env.hash_json(settings.recipe(cfg, mcfg, "pinned-cache-identity")) == identity


def test_the_recipe_identity_follows_the_data(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path)
    _, _, rec = setup(cfg)
    assert env.hash_json(rec) == recipe_id(cfg, TokenCache(text_cache).identity)
    cache = TokenCache(text_cache)
    other = write_cache(tmp_path / "other", np.asarray(cache.train)[::-1], np.asarray(cache.val), 256)
    _, _, rec_other = setup(settings.Config(cfg, data_dir=str(other)))
    assert env.hash_json(rec_other) != env.hash_json(rec)
    moved = write_cache(tmp_path / "moved", np.asarray(cache.train), np.asarray(cache.val), 256)
    assert env.hash_json(setup(settings.Config(cfg, data_dir=str(moved)))[2]) == env.hash_json(rec)


# ---------------------------------------------------------------- the results entry

def test_results_entry(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path)
    entry = train.train(cfg)
    assert read_results(cfg.results_file)["t"] == json.loads(json.dumps(entry, default=str))
    val_tokens = len(TokenCache(text_cache).val)
    assert entry["status"] == "complete"
    assert entry["parameters"] == sum(p.numel() for p in model_lib.Transformer(plan.model_config(cfg, 256)).parameters())
    assert entry["tokens"] == 2 * N_SEQUENCES * SEQ_LEN and entry["step"] == 6 and entry["epochs"] == 2
    assert entry["best_subset_loss"] == min(p["loss"] for p in entry["validation_curve"])
    assert entry["validation_curve"][entry["best_epoch"] - 1]["loss"] == entry["best_subset_loss"]
    fv = entry["final_validation"]
    assert fv["tokens"] == val_tokens - 1  # every validation token after the first is scored once
    assert fv["validation_complete"] is True and fv["seconds"] > 0
    assert fv["perplexity"] == pytest.approx(math.exp(fv["loss"]))
    assert 0 < fv["loss"] < math.log(256)  # it learned something about English bytes
    for key in ("seconds_this_session", "training_seconds", "training_elapsed_seconds",
                "training_tokens_per_second", "elapsed_tokens_per_second", "peak_memory_bytes"):
        assert entry[key] > 0, key
    assert entry["training_seconds"] <= entry["training_elapsed_seconds"] <= entry["seconds_this_session"]
    assert entry["training_tokens_per_second"] == pytest.approx(entry["tokens"] / entry["training_seconds"])
    assert entry["elapsed_tokens_per_second"] == pytest.approx(entry["tokens"] / entry["training_elapsed_seconds"])
    assert entry["recipe_identity"] == env.hash_json(setup(cfg)[2])
    assert [p["tokens"] for p in entry["validation_curve"]] == [N_SEQUENCES * SEQ_LEN, 2 * N_SEQUENCES * SEQ_LEN]
    for point in entry["validation_curve"]:
        assert point["loss"] > 0 and point["seconds"] >= 0
    assert entry["flops_per_token"] == model_lib.flops_per_token(plan.model_config(cfg, 256), SEQ_LEN)
    # compare.py's speed ratio reads the median, bench.py's the median window: one definition, the middle or the
    # mean of the two middle intervals
    assert entry["median_training_tokens_per_second"] == statistics.median(entry["interval_tokens_per_second"])
    assert entry["environment"]["cache_identity"] == TokenCache(text_cache).identity
    assert (tmp_path / "out" / "ckpt.pt").exists()


@pytest.mark.parametrize("path", sorted((REPO / "config").rglob("*.py")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_passes_the_execution_checks(path):
    """A config file is read only when somebody runs it, maybe on a GPU machine: a key the defaults lack, a
    value of the wrong type, an unknown compile mode or a model shape that does not divide would fail there
    first."""
    cfg = settings.Config(configurator.load_config(train.DEFAULTS, [str(path)]))
    check_execution(cfg)
    plan.model_config(cfg, 32000)


def test_bad_micro_batch_size_lists_the_valid_ones(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path, micro_batch_size=3)
    with pytest.raises(configurator.ConfigError) as info:
        train.train(cfg)
    assert "micro_batch_size 3" in str(info.value) and "[1, 2, 4, 8]" in str(info.value)
    with pytest.raises(configurator.ConfigError, match=r"\[1, 2, 4\]"):
        check_execution(cfg, world_size=2)
    assert train.main(cli_args(cfg)) == 2
    assert "valid sizes" in capsys.readouterr().err
    assert not Path(cfg.results_file).exists()


@pytest.mark.parametrize("change, word", [(dict(loss_impl="liger"), "full, fused, quack_chunked"),
                                          (dict(loss_chunk_tokens=0), "loss_chunk_tokens"),
                                          (dict(ddp_bucket_mb=-1), "ddp_bucket_mb"),
                                          (dict(activation_memory_budget=0.0), "activation_memory_budget must lie in"),
                                          (dict(activation_memory_budget=1.5), "activation_memory_budget must lie in"),
                                          (dict(seq_len=0), "seq_len must be positive"),
                                          (dict(log_interval=0), "log_interval must be positive"),
                                          (dict(eval_batch_size=0), "eval_batch_size"),
                                          (dict(epochs=-1), "epochs must be 0 or more"),
                                          # recipe values that AdamW or the data order would reject with a
                                          # traceback mid-run, or that would train quietly in the wrong direction
                                          (dict(learning_rate=-1e-3), "learning_rate must be positive"),
                                          (dict(beta1=1.5), "beta1 must lie in"),
                                          (dict(adam_eps=0.0), "adam_eps must be positive"),
                                          (dict(weight_decay=-0.1), "weight_decay must be 0 or more"),
                                          (dict(grad_clip=-1.0), "grad_clip must be 0 or more"),
                                          (dict(seed=-1), "seed must lie in"),
                                          (dict(seed=2 ** 64), "seed must lie in"),  # torch.manual_seed's overflow
                                          (dict(min_lr=0.01), "min_lr 0.01 is above learning_rate"),
                                          (dict(val_subset_tokens=1), "val_subset_tokens 1 holds no target")])
def test_bad_execution_keys_are_refused_before_any_work(text_cache, tmp_path, capsys, change, word):
    cfg = small_config(text_cache, tmp_path, **change)
    with pytest.raises(configurator.ConfigError, match=word):
        check_execution(cfg)
    assert train.main(cli_args(cfg)) == 2
    assert word in capsys.readouterr().err
    assert not Path(cfg.results_file).exists() and not (Path(cfg.out_dir) / "ckpt.pt").exists()


@pytest.mark.skipif(flash_attn_4_installed(), reason="flash-attn-4 is installed here")
def test_fa4_without_flash_attn_4_is_refused_before_any_work(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path, attention_backend="fa4")
    with pytest.raises(configurator.ConfigError, match="needs the flash-attn-4 package"):
        plan.check_device(cfg, torch.device("cpu"))
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: attention_backend 'fa4' needs ") and "Traceback" not in err
    assert not Path(cfg.results_file).exists()


def test_fa4_on_the_cpu_is_refused_rather_than_run_as_another_kernel(text_cache, tmp_path, capsys,
                                                                      flash_attn_4_stand_in):
    cfg = small_config(text_cache, tmp_path, attention_backend="fa4")
    check_execution(cfg)  # the package imports
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert "attention_backend 'fa4' runs on Hopper and Blackwell GPUs only" in err and err.count("\n") == 1


@pytest.mark.parametrize("change, word", [(dict(preset="30m"), "20m, 50m, 90m"), (dict(dim=100, n_heads=3), "n_heads"),
                                          (dict(train_subset_tokens=10**9), "train_subset_tokens")])
def test_model_and_data_mistakes_are_one_line_errors(text_cache, tmp_path, capsys, change, word):
    cfg = small_config(text_cache, tmp_path, **change)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and word in err and "Traceback" not in err


@pytest.mark.parametrize("key, words", [("out_dir", "out_dir"), ("results_file", "results file")])
def test_an_unwritable_out_dir_or_results_file_is_one_line_before_training(text_cache, tmp_path, capsys, key, words):
    """An out_dir under a file failed at the first checkpoint, after an epoch, in a traceback; a results file
    there in filelock's Timeout."""
    (tmp_path / "afile").write_text("a file, not a folder")
    cfg = small_config(text_cache, tmp_path, **{key: str(tmp_path / "afile" / "x")})
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "afile" in lines[0], lines
    assert "update " not in err.out  # refused before any update


@pytest.mark.parametrize("vocab_size", [0, 4096])
def test_a_missing_cache_suggests_the_command_that_makes_it(tmp_path, capsys, vocab_size):
    """config/tiny_cpu.py's missing cache suggested a 32,000-token prepare for its 4,096-token model."""
    missing = tmp_path / "gutenberg-4k"
    cfg = small_config(missing, tmp_path, vocab_size=vocab_size)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err.strip()
    command = f"python data/prepare.py --source ../shared/data/gutenberg --out {missing}"
    assert err.count("\n") == 0 and err.endswith(command + (f" --vocab_size {vocab_size}" if vocab_size else ""))


@pytest.mark.parametrize("damage, words", [
    (lambda c: (c / "meta.json").write_text("{not json"), "unreadable or incomplete"),
    (lambda c: (c / "meta.json").write_text(json.dumps({k: v for k, v in json.loads((c / "meta.json").read_text()).items()
                                                        if k != "train_sha256"})), "train_sha256"),
    (lambda c: (c / "train.bin").write_bytes((c / "train.bin").read_bytes()[:-2]), "truncated"),
    # bytes changed at the same size are data/verify.py's to find (tests/test_shards.py): a start costs a stat per file
    (lambda c: (c / "val.bin").write_bytes((c / "val.bin").read_bytes() + b"\x01\x00"), "truncated or foreign"),
    (lambda c: (c / "meta.json").unlink(), "no meta.json"),
])
def test_a_damaged_token_cache_is_one_line_error(text_cache, tmp_path, capsys, damage, words):
    cache = tmp_path / "damaged"
    shutil.copytree(text_cache, cache)
    damage(cache)
    cfg = small_config(cache, tmp_path)
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- distributed data parallel (gloo, CPU)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DDP_WORKER = """
import json, os, sys
import torch
import distributed
import plan
import settings
import trainer as trainer_lib
from data.loader import TokenCache, TrainData
cfg = settings.Config(json.loads(sys.argv[1]))
rank, _, world_size = distributed.distributed()
cache = TokenCache(cfg.data_dir)
data = TrainData(cache.train, cfg.seq_len, cfg.tokens_per_update // cfg.seq_len, cfg.seed, cfg.train_subset_tokens)
trainer = trainer_lib.Trainer(cfg, plan.model_config(cfg, cache.vocab_size), "cpu", 10, world_size=world_size)
losses = []
for u in (0, data.updates_per_epoch - 1):  # a full update and the partial last one
    batches, n_tokens = data.micro_batches(0, u, cfg.micro_batch_size, rank, world_size)
    loss_sum, grad_norm = trainer.update(batches, n_tokens)
    losses.append(distributed.all_reduce_sum(loss_sum, world_size).item() / n_tokens)
if rank == 0:
    torch.save({"losses": losses, "params": dict(trainer.raw_model.named_parameters())}, sys.argv[2])
del trainer  # free the DDP wrapper before the process group, as train.main does
import gc; gc.collect()
torch.distributed.destroy_process_group()
"""


def test_ddp_update_equals_one_process(text_cache, tmp_path):
    assert_ddp_update_equals_one_process(small_config(text_cache, tmp_path, micro_batch_size=2), tmp_path)


def assert_ddp_update_equals_one_process(cfg, tmp_path):
    """Two gloo processes (micro-batches of cfg's micro_batch_size each) make the losses and parameters of one
    process's full update and partial last update, and those parameters moved."""
    environ = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE="2", OMP_NUM_THREADS="1")
    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER)
    out = tmp_path / "ddp.pt"
    procs = [subprocess.Popen([sys.executable, str(script), json.dumps(cfg), str(out)], cwd=REPO,
                              env=dict(environ, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    ddp = torch.load(out, weights_only=False)

    data = train_data(cfg)
    trainer = make_trainer(cfg)
    losses = []
    for u in (0, data.updates_per_epoch - 1):
        batches, n_tokens = data.micro_batches(0, u, 8)
        loss_sum, _ = trainer.update(batches, n_tokens)
        losses.append(loss_sum.item() / n_tokens)
    assert ddp["losses"] == pytest.approx(losses, rel=1e-6)
    ref = parameters(trainer.raw_model)
    # Two ranks sum in another order than one process; after Adam (which divides by the gradient's own
    # size) a few float32 roundings leave parameters about 1e-6 apart. A dropped token or a wrong scale
    # would be 1e-3 or more.
    assert_close_parameters({n: p.detach() for n, p in ddp["params"].items()}, ref, 1e-5)
    start = parameters(make_trainer(cfg).raw_model)
    assert any(not torch.equal(start[n], ref[n]) for n in start)


def test_torchrun_training_on_two_processes(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path, micro_batch_size=2, name="ddp")
    log = tmp_path / "ddp.log"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(REPO / "train.py"),
                           *cli_args(cfg)], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, log.read_text()
    results = read_results(cfg.results_file)
    assert set(results) == {"ddp"}  # no "history": the rank-1 process, a different run id, never wrote
    entry = results["ddp"]
    assert entry["status"] == "complete" and entry["world_size"] == 2
    assert entry["tokens"] == 2 * N_SEQUENCES * SEQ_LEN
    assert entry["final_validation"]["tokens"] == len(TokenCache(text_cache).val) - 1
    single = train.train(settings.Config(cfg, name="single", out_dir=str(tmp_path / "single")))
    assert entry["final_validation"]["loss"] == pytest.approx(single["final_validation"]["loss"], rel=1e-5)
    assert_close_parameters(checkpoint_parameters(tmp_path / "out"), checkpoint_parameters(tmp_path / "single"), 1e-4)


def torchrun(cfg, log, *args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(REPO / "train.py"),
                           *cli_args(cfg), *args], cwd=REPO,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=300).returncode


def test_torchrun_resumes_inside_a_log_interval_with_timed_checkpoints_to_the_uninterrupted_curve(text_cache, tmp_path):
    """Two processes: a stop inside a log interval keeps the interval's loss summed over both ranks, and timed
    checkpoints (rank 0's clock, every sync point here) never leave a rank waiting for the other."""
    common = dict(epochs=1, train_subset_tokens=6 * SEQUENCES_PER_UPDATE * SEQ_LEN + 1, log_interval=4,
                  micro_batch_size=2, checkpoint_minutes=1e-9)
    straight = small_config(text_cache, tmp_path, name="straight", out_dir=str(tmp_path / "straight"), **common)
    cfg = small_config(text_cache, tmp_path, name="resumed", out_dir=str(tmp_path / "resumed"), **common)
    for run, log, args in [(straight, "straight", ()), (cfg, "first", ("--stop_after_updates=3",)),
                           (cfg, "last", ("--resume=True",))]:
        code = torchrun(run, tmp_path / f"{log}.log", *args)  # torchrun's 1 for its processes' EXIT_INTERRUPTED
        assert code == (1 if log == "first" else 0), (tmp_path / f"{log}.log").read_text()
    assert "stop_after_updates=3: checkpointed at update 3" in (tmp_path / "first.log").read_text()
    results = read_results(cfg.results_file)
    full, last = results["straight"], results["resumed"]
    assert last["status"] == "complete" and last["sessions"] == 2 and last["world_size"] == 2
    points = lambda entry: [(p["update"], p["tokens"], p["lr"]) for p in entry["training_curve"]]
    assert points(last) == points(full) and [p[0] for p in points(full)] == [4, 6]
    # the ranks' sums are added in another order across the stop: float32 roundings apart, not 3 updates of 4
    for a, b in zip(last["training_curve"], full["training_curve"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_two_nodes_through_torchruns_rendezvous_train_as_one_process(text_cache, tmp_path):
    """Multi-node is torchrun's: two torchrun launchers (--nnodes=2, the c10d rendezvous), one process each, as two
    machines would start them, meet on one endpoint and train the recipe to the one-process result."""
    cfg = small_config(text_cache, tmp_path, micro_batch_size=2, name="nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
              f"--rdzv_endpoint={endpoint}", "--rdzv_id=tiny-llm-test", str(REPO / "train.py"), *cli_args(cfg)]
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    nodes = [subprocess.Popen(launch, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for log in logs]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    entry = read_results(cfg.results_file)["nodes"]
    assert entry["status"] == "complete" and entry["world_size"] == 2
    assert entry["tokens"] == 2 * N_SEQUENCES * SEQ_LEN
    single = train.train(settings.Config(cfg, name="single", out_dir=str(tmp_path / "single")))
    assert entry["final_validation"]["loss"] == pytest.approx(single["final_validation"]["loss"], rel=1e-5)


@pytest.mark.parametrize("rank_0_due", [False, True])
def test_ddp_ranks_take_a_timed_checkpoint_by_rank_0s_clock_where_they_sync(monkeypatch, rank_0_due):
    """checkpoint_minutes was judged by each rank's own clock after every update, so ranks could disagree: a
    checkpoint one rank takes alone (its all-reduce of the log interval, or its leaving the loop on weights that are
    not finite) leaves the others waiting. Rank 0's clock decides, shared where signalled() all-reduces anyway."""
    reduced = []

    def all_reduce_sum(tensor, world_size):  # rank 0's flags: no signal, and its clock's verdict
        reduced.append(tensor.tolist())
        return tensor + torch.tensor([0.0, float(rank_0_due)])

    monkeypatch.setattr(train, "all_reduce_sum", all_reduce_sum)
    run = train.Run.__new__(train.Run)  # rank 1 of 2, whose own clock says a checkpoint is due
    run.cfg, run.plan = settings.Config(checkpoint_minutes=1.0, log_interval=4), types.SimpleNamespace(device="cpu")
    run.world_size, run.main_process, run.last_checkpoint_time = 2, False, time.time() - 120
    run.stop, run.trainer = types.SimpleNamespace(signal=None), types.SimpleNamespace(step=3)
    run.epoch_done = lambda: False
    assert not run.signalled() and not run.checkpoint_due(False, None) and reduced == []  # no sync at update 3
    run.trainer.step = 4  # a log line's update: the ranks sync
    assert not run.signalled() and run.checkpoint_due(False, None) == rank_0_due
    assert reduced == [[0.0, 0.0]]  # this rank's clock has no say
    run.main_process, run.trainer.step = True, 5  # rank 0 itself: due by its clock, told at the next sync
    assert not run.signalled() and not run.checkpoint_due(False, None)
    run.trainer.step = 8
    assert not run.signalled() and run.checkpoint_due(False, None) and reduced[-1] == [0.0, 1.0]
    run.world_size, run.trainer.step = 1, 9  # one process: its clock, after every update
    assert not run.signalled() and run.checkpoint_due(False, None) and len(reduced) == 2


def test_the_recipe_identity_is_of_the_resolved_model(text_cache, tmp_path):
    """"0 keeps the preset's value" is the same math as writing the preset's value out, and another value is not.
    (small_config sets every shape field, so the preset's own fields are spelled out against zeros here.)"""
    shape = ("dim", "n_layers", "n_heads", "hidden_dim")
    zeros = small_config(text_cache, tmp_path, **dict.fromkeys(shape, 0))
    preset = train.model_lib.get_preset(zeros.preset)
    spelled_out = settings.Config(zeros, **{k: getattr(preset, k) for k in shape})
    assert spelled_out != zeros and recipe_id(spelled_out) == recipe_id(zeros)
    assert recipe_id(settings.Config(spelled_out, n_layers=preset.n_layers + 1)) != recipe_id(zeros)


def test_prefetcher_thread_has_ended_when_training_stops_early(text_cache, tmp_path):
    """The stop waits for the thread: one left running (here in a batch's making) into the interpreter's exit is
    ended inside torch's C++ code, which aborts the process after a clean checkpoint (exit -6, not 3)."""
    from data.loader import Prefetcher
    data = train_data(small_config(text_cache, tmp_path))

    def slow_batches(u):
        time.sleep(0.05)
        return data.micro_batches(0, u % data.updates_per_epoch, 2)
    prefetcher = Prefetcher(slow_batches, range(1000), "cpu", depth=1)
    batches = iter(prefetcher)
    next(batches)
    batches.close()  # what a for loop's break does to the generator
    assert not prefetcher.thread.is_alive()


def test_regional_compilation_keeps_the_math_and_the_checkpoint_names(text_cache, tmp_path):
    """compile_scope=blocks compiles each block and the loss head in place: the same loss and gradients as
    eager, and the same state_dict keys, so checkpoints move between scopes."""
    cfg = small_config(text_cache, tmp_path)
    data = train_data(cfg)
    eager, compiled = make_trainer(cfg), make_trainer(settings.Config(cfg, compile=True, compile_scope="blocks"))
    assert list(compiled.raw_model.state_dict()) == list(eager.raw_model.state_dict())
    batches, n_tokens = data.micro_batches(0, 0, cfg.micro_batch_size)
    loss_e, norm_e = eager.update(batches, n_tokens)
    loss_c, norm_c = compiled.update(batches, n_tokens)
    assert loss_c.item() == pytest.approx(loss_e.item(), rel=1e-5)
    assert norm_c.item() == pytest.approx(norm_e.item(), rel=1e-4)
    assert "loss" in vars(compiled.raw_model) and "loss" not in vars(eager.raw_model)  # the head compiled apart


@pytest.mark.parametrize("content, words", [(b"not a checkpoint", "could not be loaded"),
                                             ({"model": {}}, "is not one train.py wrote (it lacks recipe"),
                                             ([1, 2], "is not one train.py wrote")])
def test_a_corrupt_or_foreign_checkpoint_is_one_line_error(text_cache, tmp_path, capsys, content, words):
    """A file torch loads but train.py did not write (a model-only export, a list) was a KeyError traceback."""
    import torch
    cfg = small_config(text_cache, tmp_path)
    (tmp_path / "out").mkdir()
    ckpt = tmp_path / "out" / "ckpt.pt"
    ckpt.write_bytes(content) if isinstance(content, bytes) else torch.save(content, ckpt)
    assert train.main(cli_args(cfg) + ["--resume=True"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ckpt.pt" in err[0] and words in err[0], err


def test_an_activation_memory_budget_saves_less_for_backward_with_the_same_math(text_cache, tmp_path):
    """activation_memory_budget < 1 makes the compiled update recompute cheap ops in backward instead of saving
    their outputs: fewer bytes kept between forward and backward, the same loss and gradient norm."""
    import torch._functorch.config
    # torch's own patch restores the setting after the test; pytest's monkeypatch would delete it on undo, which
    # torch's config module takes as hiding the key, and every later compile in the process then fails reading it
    with torch._functorch.config.patch(activation_memory_budget=1.0):
        budget_saves_less(text_cache, tmp_path)


def budget_saves_less(text_cache, tmp_path):
    cfg = small_config(text_cache, tmp_path, micro_batch_size=8)
    batches, n_tokens = train_data(cfg).micro_batches(0, 0, cfg.micro_batch_size)
    results = {}
    for budget in (1.0, 0.3):
        torch._dynamo.reset()  # else the second trainer would reuse the first one's compiled graphs
        trainer = make_trainer(settings.Config(cfg, compile=True, activation_memory_budget=budget))
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss_sum, grad_norm = trainer.update(batches, n_tokens)
        results[budget] = loss_sum.item(), grad_norm.item(), sum(storages.values())
    (loss_a, norm_a, saved_a), (loss_b, norm_b, saved_b) = results[1.0], results[0.3]
    assert loss_b == pytest.approx(loss_a, rel=1e-5) and norm_b == pytest.approx(norm_a, rel=1e-4)
    assert saved_b < 0.8 * saved_a, (saved_a, saved_b)
