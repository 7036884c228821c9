"""The optimizer levers of #38: NorMuon in Muon, Muon on the fused projections' pieces and the weights' average (ema),
each against a hand computation, torch.optim.Muon or a plain reference written here; then all on at once in a run
that trains, resumes bit for bit, compiles its step once under update_graph, and trains under DDP as one process
does."""
import functools
import multiprocessing
import socket

import pytest
import torch

import checkpoint
import optim
import settings
import trainer as trainer_lib
from configurator import ConfigError
from data.loader import TokenCache, eval_batches
from tests.test_optim import MUON, clones, matrices, set_grads, update_steps_apart
from tests.test_train import make_trainer, small_config, train_data
from tests.test_train import test_stop_and_resume_is_bitwise_identical as resumes_bitwise  # not collected here
from tests.test_update_graph import fresh_compiler

LEVERS = dict(optimizer="muon", muon_lr=0.01, normuon=True, muon_split_projections=True, ema=0.9)


# ---------------------------------------------------------------- NorMuon

def normuon_reference(params, grads_per_step, lr, weight_decay, momentum, beta2=0.95):
    """NorMuon's reference update (Li et al. 2025, their normuon.py) on torch's own Newton-Schulz, one matrix at a
    time, with torch.optim.Muon's Nesterov momentum, decay and original lr adjustment."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    buffers = [torch.zeros_like(p) for p in params]
    moments = [torch.zeros(p.shape[0], 1) for p in params]
    for grads in grads_per_step:
        for p, g, buf, v in zip(params, grads, buffers, moments):
            buf.lerp_(g, 1 - momentum)
            o = _zeropower_via_newtonschulz(g.lerp(buf, momentum), optim.NS_COEFFICIENTS, 5, optim.NS_EPS).float()
            norm = o.norm()
            v.lerp_((o * o).mean(dim=-1, keepdim=True), 1 - beta2)
            o = o * (1 / (v.sqrt() + 1e-10))
            o = o * (norm / (o.norm() + 1e-10))  # the norm kept
            p.mul_(1 - lr * weight_decay)
            p.add_(o * max(1, p.size(-2) / p.size(-1)) ** 0.5, alpha=-lr)
    return moments


def test_normuon_matches_its_reference_over_several_steps():
    """To the batched-bf16 tolerance of tests/test_optim.py (the Newton-Schulz products round apart), and moving
    the weights far from plain Muon's (the normalization does something)."""
    g = torch.Generator().manual_seed(1)
    start = matrices()
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(3)]
    ours, plain, reference = clones(start), clones(start), [p.detach().clone() for p in start]
    normuon, muon = optim.Muon(ours, **MUON, normuon=True), optim.Muon(plain, **MUON)
    for step_grads in grads:
        for p, q, grad in zip(ours, plain, step_grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        normuon.step()
        muon.step()
    moments = normuon_reference(reference, grads, **MUON)
    assert update_steps_apart(reference, ours, None) < 2.0
    assert update_steps_apart(plain, ours, None) > 20
    for p, v in zip(ours, moments):
        assert torch.allclose(normuon.state[p]["second_moment"], v, rtol=0.02, atol=1e-6)


MODEL_SETTINGS = dict(optimizer="muon", learning_rate=2e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8,
                      muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5, muon_adjust_lr="original", compile=False)


def test_the_lever_reaches_muon_only_and_an_old_muon_state_loads_with_it_off():
    from tests.test_optim import tiny_model
    built = optim.build_optimizer(tiny_model(), dict(MODEL_SETTINGS, normuon=True), "cpu")
    [group] = built.muon.param_groups
    assert group["normuon"] is True
    assert all("normuon" not in g for g in built.adamw.param_groups)  # AdamW's update stays plain
    params = matrices()
    saved = optim.Muon(params, **MUON).state_dict()
    for key in optim.Muon.LEVERS:  # a state saved before the lever existed
        del saved["param_groups"][0][key]
    loaded = optim.Muon(clones(params), **MUON)
    loaded.load_state_dict(saved)
    assert {k: loaded.param_groups[0][k] for k in optim.Muon.LEVERS} == optim.Muon.LEVERS
    set_grads([loaded.param_groups[0]["params"]], torch.Generator().manual_seed(0))
    loaded.step()


# ---------------------------------------------------------------- Muon on the fused projections' pieces

FUSED = [((48, 16), 3), ((32, 16), 2), ((16, 32), 1), ((48, 16), 3)]  # wqkv-, w13- and wo-like, two of one shape


def fused_and_split(seed=0):
    """Fused parameters (each stacking `pieces` matrices by rows) and clones of their pieces as parameters."""
    fused = matrices(seed, [shape for shape, _ in FUSED])
    split = clones([piece for p, (_, k) in zip(fused, FUSED) for piece in p.detach().chunk(k)])
    return fused, split


def step_fused_and_split(fused, split, ours, theirs, steps=3):
    """The same random gradients, fused and cut into the pieces; returns them, per step, as the split list."""
    g, grads = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        for p in fused:
            p.grad = torch.randn(p.shape, generator=g)
        grads.append([c.clone() for p, (_, k) in zip(fused, FUSED) for c in p.grad.chunk(k)])
        for q, grad in zip(split, grads[-1]):
            q.grad = grad.clone()
        ours.step()
        theirs.step()
    return grads


def pieces_of(fused):
    return [c for p, (_, k) in zip(fused, FUSED) for c in p.detach().chunk(k)]


def fused_groups(params):
    return [{"params": [p], "pieces": k} for p, (_, k) in zip(params, FUSED)]


@pytest.mark.parametrize("adjust_lr_fn", optim.MUON_ADJUST)
def test_muon_on_pieces_is_torch_muon_on_the_unfused_matrices(adjust_lr_fn):
    """Each piece orthogonalized and its rate adjusted as a matrix of its own: torch.optim.Muon on the pieces as
    separate parameters, to the batched-bf16 tolerance; and far from Muon on the fused matrices whole."""
    fused, split = fused_and_split()
    whole = clones(fused)
    options = dict(MUON, adjust_lr_fn=adjust_lr_fn)
    ours = optim.Muon(fused_groups(fused), **options)
    step_fused_and_split(fused, split, ours, torch.optim.Muon(split, **options))
    assert update_steps_apart(split, pieces_of(fused), adjust_lr_fn) < 1.5
    plain = optim.Muon(whole, **options)
    step_fused_and_split(whole, clones(split), plain, torch.optim.Muon(clones(split), **options))
    assert update_steps_apart(split, pieces_of(whole), adjust_lr_fn) > 20


def test_normuon_on_pieces_is_its_reference_on_the_unfused_matrices():
    """NorMuon's rows are the same rows either way; each piece keeps its own norm (the reference's per matrix)."""
    fused, split = fused_and_split()
    reference = [p.detach().clone() for p in split]
    ours = optim.Muon(fused_groups(fused), **MUON, normuon=True)
    grads = step_fused_and_split(fused, split, ours, optim.Muon(clones(split), **MUON))
    moments = normuon_reference(reference, grads, **MUON)
    assert update_steps_apart(reference, pieces_of(fused), None) < 2.0
    ours_moments = [c for p, (_, k) in zip(fused, FUSED) for c in ours.state[p]["second_moment"].chunk(k)]
    for v, w in zip(ours_moments, moments):
        assert torch.allclose(v, w, rtol=0.02, atol=1e-6)


def test_the_split_lever_puts_each_fused_projection_in_a_group_of_its_pieces():
    from tests.test_optim import tiny_model
    model = tiny_model()
    built = optim.build_optimizer(model, dict(MODEL_SETTINGS, muon_split_projections=True), "cpu")
    whole, qkv, w13 = built.muon.param_groups
    blocks = model.layers
    assert [g["pieces"] for g in built.muon.param_groups] == [1, 3, 2]
    assert qkv["params"] == [b.attention.wqkv.weight for b in blocks]
    assert w13["params"] == [b.feed_forward.w13.weight for b in blocks]
    assert whole["params"] == [w for b in blocks for w in (b.attention.wo.weight, b.feed_forward.w2.weight)]
    assert all(g["base_lr"] == MODEL_SETTINGS["muon_lr"] for g in built.muon.param_groups)
    [off] = optim.build_optimizer(model, MODEL_SETTINGS, "cpu").muon.param_groups  # off: one group, whole
    assert off["pieces"] == 1 and len(off["params"]) == 4 * len(blocks)


def test_a_run_with_the_split_lever_updates_its_fused_projections_piece_by_piece(text_cache, tmp_path):
    """The key reaches the trainer's optimizer from a run's config (not only build_optimizer's own settings), and
    moves the fused projections otherwise than Muon on them whole, the other matrices as it does."""
    moved = {}
    for split in (False, True):
        cfg = small_config(text_cache, tmp_path, optimizer="muon", muon_lr=0.01, muon_split_projections=split)
        trainer, data = make_trainer(cfg), train_data(cfg)
        assert [g["pieces"] for g in trainer.optimizer.muon.param_groups] == ([1, 3, 2] if split else [1])
        trainer.update(*data.micro_batches(0, 0, cfg.micro_batch_size))
        moved[split] = dict(trainer.raw_model.named_parameters())
    for name, p in moved[True].items():
        same = torch.equal(p, moved[False][name])
        assert same != name.endswith(("wqkv.weight", "w13.weight")), name


def test_pieces_that_do_not_divide_the_rows_are_refused():
    with pytest.raises(ValueError, match="pieces must be a whole number >= 1 that divides each parameter's rows; "
                                         r"got 3 for one of shape \(32, 16\)"):
        optim.Muon([{"params": matrices(0, [(32, 16)]), "pieces": 3}], **MUON)


# ---------------------------------------------------------------- the weights' average

def test_the_average_is_the_hand_computed_one_and_validation_scores_it(text_cache, tmp_path):
    """ema 0.9 over 3 updates: sum of 0.1 x 0.9^(3 - i) x w_i over 1 - 0.9^3, by hand in float64 from the weights
    after each update; the validation pass scores exactly the model holding those weights, then leaves the
    trained weights as they were, bit for bit."""
    cfg = small_config(text_cache, tmp_path, ema=0.9)
    trainer, data = make_trainer(cfg), train_data(cfg)
    history = []
    for u in range(3):
        trainer.update(*data.micro_batches(0, u, cfg.micro_batch_size))
        history.append([p.detach().double().clone() for p in trainer.params])
    weight = [0.1 * 0.9 ** (3 - i) / (1 - 0.9 ** 3) for i in (1, 2, 3)]
    by_hand = [sum(w * h[k] for w, h in zip(weight, history)) for k in range(len(trainer.params))]
    averaged = optim.averaged_weights(trainer.ema.state_dict(), trainer.step)
    assert list(averaged) == [n for n, _ in trainer.raw_model.named_parameters()]
    for ours, theirs in zip(averaged.values(), by_hand):
        assert torch.allclose(ours.double(), theirs, rtol=1e-5, atol=1e-7)

    val = TokenCache(cfg.data_dir).val
    batches = lambda: eval_batches(val, cfg.seq_len, 8, cfg.val_subset_tokens)
    live = [p.detach().clone() for p in trainer.params]
    scored = trainer.evaluate(batches())
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, live))
    holding_average = make_trainer(cfg).raw_model
    holding_average.load_state_dict(averaged, strict=False)
    assert scored == trainer_lib.mean_token_loss(holding_average, batches(), "cpu")
    assert scored["loss"] != trainer_lib.mean_token_loss(trainer.raw_model, batches(), "cpu")["loss"]


def test_all_levers_train_and_resume_bitwise_and_the_checkpoint_exports_the_average(text_cache, tmp_path):
    """tests/test_train.py's resume test (three sessions against one) with every lever on, the final validation
    scoring the average; the checkpoint then gives sampling and export (checkpoint.load_model) the average."""
    resumes_bitwise(text_cache, tmp_path, LEVERS)
    ckpts = [torch.load(tmp_path / run / "ckpt.pt", weights_only=False) for run in ("straight", "resumed")]
    for a, b in zip(*(c["ema"]["accumulator"].values() for c in ckpts)):
        assert torch.equal(a, b)
    moments = [[s["second_moment"] for s in c["optimizer"]["muon"]["state"].values()] for c in ckpts]
    assert len(moments[0]) == 8 and all(torch.equal(a, b) for a, b in zip(*moments))
    model, ckpt = checkpoint.load_model(tmp_path / "resumed" / "ckpt.pt")
    average = optim.averaged_weights(ckpt["ema"], ckpt["step"])
    for name, p in model.named_parameters():
        assert torch.equal(p, average[name]) and not torch.equal(p, ckpt["model"][name]), name


@pytest.mark.parametrize("change, words", [
    (dict(optimizer="adamw", normuon=True), "normuon refines Muon's update and optimizer is 'adamw'; set "
                                            "optimizer=muon"),
    (dict(optimizer="adamw", muon_split_projections=True), "muon_split_projections refines Muon's update and "
                                                           "optimizer is 'adamw'; set optimizer=muon"),
    (dict(ema=0.99, epochs=0, init_from="out/x"), "epochs 0 makes none"),
    (dict(ema=1.0), "ema must lie in [0, 1)")])
def test_lever_settings_that_cannot_work_are_refused(text_cache, tmp_path, change, words):
    cfg = settings.Config(small_config(text_cache, tmp_path), **change)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace(")", r"\)")):
        settings.check(settings.TrainSettings, cfg)


# ---------------------------------------------------------------- under DDP, and compiled (update_graph)

def trained(cfg, updates, world_size=1, rank=0):
    """A trainer of cfg after these updates (on this rank's share of each), with its weights' and average's moves
    from the initial weights, and the count of graphs compiled after each update."""
    trainer, data = make_trainer(cfg, world_size=world_size), train_data(cfg)
    start = [p.detach().clone() for p in trainer.params]
    graphs = []
    for u in updates:
        trainer.update(*data.micro_batches(0, u, cfg.micro_batch_size, rank, world_size))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    average = optim.averaged_weights(trainer.ema.state_dict(), trainer.step).values()
    moves = [p.detach() - p0 for p, p0 in zip([*trainer.params, *average], start * 2)]
    return trainer, moves, graphs


def assert_moves_close(ours, theirs, tolerance):
    for a, b in zip(ours, theirs):
        assert (a - b).norm() <= tolerance * b.norm(), ((a - b).norm() / b.norm()).item()


def ddp_rank(rank, port, cfg, out):
    """One of two gloo ranks (a forked child): a full update and the padded last one with every lever; its moves
    and its average's accumulator saved."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer, moves, _ = trained(cfg, (0, 2), world_size=2, rank=rank)  # 8, then the last 5, padded
    torch.save({"moves": moves, "accumulator": trainer.ema.accumulator}, out)
    del trainer  # the DDP wrapper before the process group, as train.main frees them
    torch.distributed.destroy_process_group()


def test_all_levers_under_ddp_equal_one_process_and_every_rank_holds_the_same_average(text_cache, tmp_path):
    """Two gloo ranks (forked: no second interpreter to start) against one process of the same micro-batches,
    over a full update and the padded last one: each rank's weights and average the same bits; against one
    process the same moves (of the weights and of their average) to Muon's bf16 tolerance. Two ranks sum the
    gradients in another order, and Muon's bf16 orthogonalization carries a last-bit difference far (measured: 1.0%
    of a move at most on one CPU, 3.1% on an AMD EPYC, whose bf16 matmuls round otherwise; plain Muon is as
    sensitive, 5% over 3 updates between micro-batches of 2 and 8). A rank's gradient left out of the sum, or a
    lever skipped under DDP, moves a matrix by tens of percent."""
    cfg = small_config(text_cache, tmp_path, micro_batch_size=2, **LEVERS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=ddp_rank, args=(r, port, cfg, tmp_path / f"rank{r}.pt")) for r in range(2)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(timeout=120)
        if r.exitcode is None:
            r.kill()
    assert [r.exitcode for r in ranks] == [0, 0]
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first["moves"] + first["accumulator"],
                                                 second["moves"] + second["accumulator"]))
    _, moves, _ = trained(cfg, (0, 2))
    assert_moves_close(first["moves"], moves, 0.06)


def test_all_levers_compile_the_step_once_and_update_as_eager(text_cache, tmp_path, monkeypatch):
    """update_graph's compiled clip, step and average against the eager step over 3 updates: the same losses and
    moves to the bf16 tolerance of tests/test_update_graph.py, the step compiled at the first update only (one
    graph more than Muon's three: the average's), the average's tensors marked static. Only the step compiles (the
    model stays eager: the levers change only the step), with the aot_eager backend: dynamo's capture and AOT's
    functional graphs of the step, which inductor would take; inductor itself takes 15 to 30 s more on a cold
    cache here (the levers-off step's inductor run: tests/test_update_graph.py; the GPU's: scripts/gpu_smoke.sh)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    _, eager, _ = trained(small_config(text_cache, tmp_path, **LEVERS), range(3))
    fresh_compiler()
    trainer, moves, graphs = trained(small_config(text_cache, tmp_path, update_graph=True, **LEVERS), range(3))
    assert graphs == [4] * 3, graphs
    assert hasattr(trainer.optimizer_step, "_torchdynamo_orig_callable")
    assert all(getattr(t, "_dynamo_static_input_type", None) is not None for t in trainer.ema.accumulator)
    assert_moves_close(moves, eager, 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_normuon_takes_the_dtypes_muon_takes_and_a_copy_steps(dtype):
    """NorMuon's second moment is made in the parameter's dtype and the update it is lerped with is float32: any
    parameter not in float32 failed its first step. A deepcopy (or pickle) lost the compile attribute, and its next
    step failed."""
    import copy
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8, dtype=dtype))
    ref = torch.nn.Parameter(p.detach().double().clone())
    start = ref.detach().clone()
    opt, ref_opt = optim.Muon([p], lr=0.2, normuon=True), optim.Muon([ref], lr=0.2, normuon=True)  # moves past bf16
    for _ in range(2):
        grad = torch.randn(16, 8, dtype=torch.float64)
        p.grad, ref.grad = grad.to(dtype), grad.clone()
        opt.step()
        ref_opt.step()
    moved, expected = p.double() - start, ref.detach() - start  # a parameter that never stepped would fail this
    assert (moved - expected).norm() <= 0.1 * expected.norm()
    twin = copy.deepcopy(opt)
    twin.param_groups[0]["params"][0].grad = p.grad.clone()
    twin.step()
