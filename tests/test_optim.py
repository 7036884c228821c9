"""optim.py: the batched Muon against torch.optim.Muon (and, on a GPU, compiled and free of host syncs), its state
across a resume, build_optimizer's groups and set_lr, and the two learning-rate schedules (cosine: bit for bit
the formula trainer.py had)."""
import copy
import io
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

import model as model_lib
import optim

# tall, wide and square, several of one shape, in mixed order (the shape groups must keep each its own)
SHAPES = [(32, 16), (16, 48), (32, 16), (24, 24), (8, 40), (32, 16), (16, 48), (64, 8), (24, 24)]
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)

# The batched Newton-Schulz against torch.optim.Muon's one matrix at a time. Both run in bf16, and a batched
# matmul may round a product differently from the single one; when it does, the matrix's orthogonalized update
# moves by about one bf16 step at 1.0 (2^-7), so the parameter by lr x ratio(shape) x 2^-7: call that one
# "update step" (2.2e-4 for a (32, 16) matrix here). Differences are measured in those units, per matrix.
# Measured on the CPU (torch 2.13): this test's data 0.0002 units (3e-8: only the last float32 bit, as we
# scale the update and then add it where torch fuses the two); the worst over 40 seeds x the four variants 1.0
# (2.2e-4), where a batched product rounded differently. The tolerance, 1.5, sits just above that worst case, so
# a CPU whose bmm and mm round apart still passes; a real mistake moves a parameter by lr x |update|, tens to
# hundreds of units (the ratio's rows and columns swapped: 350).
MUON_TOLERANCE = 1.5
# On an H200 (torch 2.11, the 20m model's 32 matrices, 3 steps): eager 0.0003 units (torch's own bits but the
# last float32 one); compiled 1.25 after 3 steps (1.74 after 5; 4 seeds), as Inductor fuses the bf16 math and
# rounds it differently, a little more each step. 2.0 sits just above.
CUDA_MUON_TOLERANCE = 2.0


def matrices(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g) * 0.1) for shape in shapes]


def clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(param_lists, generator):
    """The same random gradient on the matching parameter of each list (drawn on the CPU, then moved)."""
    for same in zip(*param_lists):
        grad = torch.randn(same[0].shape, generator=generator).to(same[0].device)
        for p in same:
            p.grad = grad.clone()


def max_difference(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def update_steps_apart(a, b, adjust_lr_fn, lr=MUON["lr"]):
    """The largest difference of matching matrices, in units of lr x ratio(shape) x 2^-7 (see MUON_TOLERANCE)."""
    unit = lambda p: lr * optim.adjusted_ratio(adjust_lr_fn, p.shape) * 2 ** -7
    return max((p - q).abs().max().item() / unit(p) for p, q in zip(a, b))


@pytest.mark.parametrize("adjust_lr_fn, nesterov", list(itertools.product(optim.MUON_ADJUST, (True, False))))
def test_muon_matches_torch_muon_over_several_steps(adjust_lr_fn, nesterov):
    reference = matrices()
    ours = clones(reference)
    options = dict(MUON, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    theirs, mine = torch.optim.Muon(reference, **options), optim.Muon(ours, **options)
    g = torch.Generator().manual_seed(1)
    start = clones(reference)
    for step in range(5):
        set_grads([reference, ours], g)
        theirs.step()
        mine.step()
        assert update_steps_apart(reference, ours, adjust_lr_fn) < MUON_TOLERANCE, step
        for p, q in zip(reference, ours):  # the same momentum, bit for bit: it needs no matmul
            assert torch.equal(theirs.state[p]["momentum_buffer"], mine.state[q]["momentum_buffer"])
    assert update_steps_apart(start, ours, adjust_lr_fn) > 100  # the parameters did move


def test_muon_tensor_lr_gives_the_float_lr_result():
    """A float64 0-dim lr holds the float exactly, and both take the same ops: the same bits. A float32 one holds
    the nearest float32, so it is only close."""
    lr = MUON["lr"]
    runs = {}
    for name, value in (("float", lr), ("float64", torch.tensor(lr, dtype=torch.float64)),
                        ("float32", torch.tensor(lr))):
        params = matrices()
        optimizer = optim.Muon(params, **dict(MUON, lr=value))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            set_grads([params], g)
            optimizer.step()
        runs[name] = params
    assert all(torch.equal(p, q) for p, q in zip(runs["float"], runs["float64"]))
    assert max_difference(runs["float"], runs["float32"]) < 1e-6


def saved(optimizer):
    """The optimizer's state as a checkpoint holds it: written and read back, not the live tensors."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_muon_state_dict_round_trip_continues_bitwise():
    params = matrices()
    first = optim.Muon(params, **MUON)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        set_grads([params], g)
        first.step()
    copies = clones(params)
    second = optim.Muon(copies, **dict(MUON, lr=0.5, momentum=0.5))  # the loaded options replace these
    second.load_state_dict(saved(first))
    for _ in range(3):
        set_grads([params, copies], g)
        first.step()
        second.step()
    for p, q in zip(params, copies):
        assert torch.equal(p, q)
        assert torch.equal(first.state[p]["momentum_buffer"], second.state[q]["momentum_buffer"])


def test_a_zero_gradient_among_its_shape_is_only_decayed_as_torch_muon_does():
    """Newton-Schulz divides each matrix by its norm clamped at eps: a zero update (a matrix the loss did not reach,
    at the first step) stays zero, the weight only decayed, not 0 / 0 = NaN; its stack's other matrices as usual."""
    reference = matrices()
    ours = clones(reference)
    theirs, mine = torch.optim.Muon(reference, **MUON), optim.Muon(ours, **MUON)
    set_grads([reference, ours], torch.Generator().manual_seed(1))
    for k in (0, 4):  # one of three (32, 16) matrices, and the one (8, 40)
        reference[k].grad.zero_()
        ours[k].grad.zero_()
    start = clones(ours)
    theirs.step()
    mine.step()
    assert all(p.isfinite().all() for p in ours)
    assert update_steps_apart(reference, ours, None) < MUON_TOLERANCE
    for k in (0, 4):
        assert torch.equal(ours[k], start[k] * (1 - MUON["lr"] * MUON["weight_decay"]))


def test_muon_refuses_what_it_cannot_update():
    with pytest.raises(ValueError, match="2-D"):
        optim.Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        optim.Muon(matrices(), adjust_lr_fn="other")


# The 20m model's block matrices (fused wqkv and w13): 8 blocks x 4 shapes.
SHAPES_20M = [(960, 320), (320, 320), (1792, 320), (320, 896)] * 8
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_cuda(params):
    return [torch.nn.Parameter(p.detach().cuda()) for p in params]


@cuda_only
@pytest.mark.parametrize("compile", [False, True])
def test_muon_on_cuda_matches_torch_muon(compile):
    reference = on_cuda(matrices(shapes=SHAPES_20M))
    ours = clones(reference)
    theirs, mine = torch.optim.Muon(reference, **MUON), optim.Muon(ours, **MUON, compile=compile)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        set_grads([reference, ours], g)
        theirs.step()
        mine.step()
        apart = update_steps_apart(reference, ours, None)
        print(f"compile={compile} step {step}: {apart:.4f} update steps apart")
        assert apart < CUDA_MUON_TOLERANCE, step


@cuda_only
@pytest.mark.parametrize("compile", [False, True])
def test_muon_on_cuda_never_syncs_and_a_tensor_lr_gives_the_floats_bits(compile):
    """Steps under CUDA's sync debug mode, which raises on a host sync, with a float lr and with a float64 0-dim
    lr on the GPU (the first step, which may compile, runs before)."""
    runs = []
    for lr in (MUON["lr"], torch.tensor(MUON["lr"], dtype=torch.float64, device="cuda")):
        params = on_cuda(matrices(shapes=SHAPES_20M[:4] * 2))
        optimizer = optim.Muon(params, **dict(MUON, lr=lr), compile=compile)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            set_grads([params], g)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                optimizer.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        runs.append(params)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


# ---------------------------------------------------------------- build_optimizer and set_lr

SETTINGS = dict(optimizer="adamw", learning_rate=2e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8,
                muon_lr=0.02, muon_momentum=0.95, muon_ns_steps=5, muon_adjust_lr="original", compile=False)


def tiny_model():
    torch.manual_seed(0)
    config = model_lib.get_preset("20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=256,
                                  max_seq_len=32)
    return model_lib.Transformer(config)


def adamw_as_trainer_builds_it(model, cfg, device):
    """trainer.py's optimizer, as Trainer.__init__ wrote it before optim.py."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
        fused=torch.device(device).type == "cuda")


def options(group):
    return {k: v for k, v in group.items() if k != "params"}


def train_steps(model, optimizer, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=g)
        model(x, torch.roll(x, -1, 1), reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the device only decides `fused`: no GPU is used
def test_build_adamw_is_the_optimizer_trainer_built(device):
    model = tiny_model()
    built = optim.build_optimizer(model, SETTINGS, device)
    expected = adamw_as_trainer_builds_it(model, SimpleNamespace(**SETTINGS), device)
    assert type(built) is torch.optim.AdamW
    assert built.defaults == expected.defaults
    assert len(built.param_groups) == len(expected.param_groups) == 2
    for ours, theirs in zip(built.param_groups, expected.param_groups):
        assert options(ours) == options(theirs)
        assert [id(p) for p in ours["params"]] == [id(p) for p in theirs["params"]]
    assert built.defaults["fused"] == (device == "cuda")


@pytest.mark.parametrize("update_graph", [False, True])
def test_build_adamw_loads_an_old_checkpoints_optimizer_state(update_graph):
    """Through optim.load_state, as train.py resumes, into either form: the loaded moments, this run's options."""
    model = tiny_model()
    old = adamw_as_trainer_builds_it(model, SimpleNamespace(**SETTINGS), "cpu")
    train_steps(model, old, 2)
    built = optim.build_optimizer(model, dict(SETTINGS, update_graph=update_graph, compile=update_graph), "cpu")
    expected = [options(group) for group in built.param_groups]
    optim.load_state(built, saved(old))
    assert all(torch.equal(built.state[p]["exp_avg"], old.state[p]["exp_avg"]) for p in model.parameters())
    assert [torch.is_tensor(group["lr"]) for group in built.param_groups] == [update_graph] * 2
    for group, before in zip(built.param_groups, expected):
        assert {k: group[k] for k in ("fused", "foreach", "capturable")} == \
            {k: before[k] for k in ("fused", "foreach", "capturable")}


def test_build_muon_splits_the_parameters_and_its_settings_take_attributes_too():
    model = tiny_model()
    settings = dict(SETTINGS, optimizer="muon", muon_adjust_lr="match_rms_adamw", muon_ns_steps=4)
    built = optim.build_optimizer(model, SimpleNamespace(**settings), "cpu")  # a cfg object, as train.py has
    names = {id(p): name for name, p in model.named_parameters()}
    group_names = lambda group: {names[id(p)] for p in group["params"]}
    [muon_group] = built.muon.param_groups
    assert group_names(muon_group) == {f"layers.{i}.{m}.weight" for i in range(2) for m in
                                       ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")}
    decay, no_decay = built.adamw.param_groups
    assert group_names(decay) == {"tok_embeddings.weight"}  # the tied head: the same tensor, once
    assert group_names(no_decay) == {"norm.weight"} | {f"layers.{i}.{n}.weight" for i in range(2)
                                                       for n in ("attention_norm", "ffn_norm")}
    everything = [id(p) for group in built.param_groups for p in group["params"]]
    assert sorted(everything) == sorted(names) and len(set(everything)) == len(everything)
    assert (decay["weight_decay"], no_decay["weight_decay"], muon_group["weight_decay"]) == (0.1, 0.0, 0.1)
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["lr"] == 2e-3
    assert {k: muon_group[k] for k in ("lr", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")} == dict(
        lr=0.02, momentum=0.95, nesterov=True, ns_steps=4, adjust_lr_fn="match_rms_adamw")
    assert [g["base_lr"] for g in built.param_groups] == [2e-3, 2e-3, 0.02]


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_build_optimizer_takes_each_setting_rather_than_the_optimizers_default(name):
    """SETTINGS' adam_eps, weight_decay and muon_momentum are torch.optim.AdamW's and Muon's own defaults, so the
    tests above cannot tell a setting passed from one left out: here every one differs from its default."""
    changed = dict(SETTINGS, optimizer=name, learning_rate=1e-3, beta1=0.8, beta2=0.9, adam_eps=1e-6,
                   weight_decay=0.05, muon_lr=0.03, muon_momentum=0.9, muon_ns_steps=3)
    built = optim.build_optimizer(tiny_model(), changed, "cpu")
    decay, no_decay, *muon = built.param_groups
    for group in (decay, no_decay):
        assert (group["lr"], group["betas"], group["eps"]) == (1e-3, (0.8, 0.9), 1e-6)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
    if name == "muon":
        assert {k: muon[0][k] for k in ("lr", "weight_decay", "momentum", "ns_steps")} == dict(
            lr=0.03, weight_decay=0.05, momentum=0.9, ns_steps=3)


def test_set_lr_gives_adamw_the_schedule_and_muon_it_scaled_to_its_peak():
    learning_rate = SETTINGS["learning_rate"]
    built = optim.build_optimizer(tiny_model(), dict(SETTINGS, optimizer="muon"), "cpu")
    for lr in (learning_rate, 7e-4, 1.3e-5):
        optim.set_lr(built, lr, learning_rate)
        decay, no_decay, muon = built.param_groups
        assert decay["lr"] == no_decay["lr"] == lr
        assert muon["lr"] == pytest.approx(0.02 * lr / learning_rate, rel=1e-12)
    optim.set_lr(built, learning_rate, learning_rate)
    assert built.param_groups[2]["lr"] == 0.02  # the peak exactly
    plain = optim.build_optimizer(tiny_model(), SETTINGS, "cpu")
    optim.set_lr(plain, 7e-4, learning_rate)
    assert [g["lr"] for g in plain.param_groups] == [7e-4, 7e-4]


def test_muon_with_adamw_trains_and_resumes_bitwise():
    model = tiny_model()
    settings = dict(SETTINGS, optimizer="muon")
    first = optim.build_optimizer(model, settings, "cpu")
    train_steps(model, first, 2, seed=0)
    resumed_model = copy.deepcopy(model)
    resumed = optim.build_optimizer(resumed_model, settings, "cpu")
    resumed.load_state_dict(saved(first))
    train_steps(model, first, 2, seed=1)
    train_steps(resumed_model, resumed, 2, seed=1)
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    assert len(first.state) == len(list(model.parameters()))  # every parameter has its state, once
    with pytest.raises(ValueError, match="optimizer=adamw"):
        resumed.load_state_dict(optim.build_optimizer(model, SETTINGS, "cpu").state_dict())


# ---------------------------------------------------------------- schedules

def trainer_lr_at(step, total_updates, learning_rate, min_lr, warmup_updates):
    """Trainer.lr_at as trainer.py had it before optim.py, copied verbatim (trainer.py now calls optim.lr_at):
    the rates every run so far was trained with."""
    cfg = SimpleNamespace(learning_rate=learning_rate, min_lr=min_lr, warmup_updates=warmup_updates)
    if step < cfg.warmup_updates:
        return cfg.learning_rate * (step + 1) / cfg.warmup_updates
    progress = (step - cfg.warmup_updates) / max(1, total_updates - cfg.warmup_updates)
    progress = min(progress, 1.0)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


@pytest.mark.parametrize("total, warmup", [(60, 10), (37, 0), (5, 5), (4, 9)])
def test_cosine_is_trainers_schedule_bit_for_bit(total, warmup):
    for step in range(total + 3):  # and past the end
        args = (step, total, 2e-3, 2e-4, warmup)
        assert optim.lr_at(*args) == trainer_lr_at(*args)
        assert optim.lr_at(*args, schedule="cosine", cooldown_fraction=0.7) == trainer_lr_at(*args)


def wsd(total, warmup, fraction, lr=1e-3, floor=1e-4):
    return [optim.lr_at(s, total, lr, floor, warmup, schedule="wsd", cooldown_fraction=fraction)
            for s in range(total)]


def test_wsd_warms_up_holds_then_decays_linearly_to_min_lr():
    curve = wsd(total=50, warmup=5, fraction=0.2)
    assert curve[:5] == [1e-3 * (s + 1) / 5 for s in range(5)]  # the cosine's warmup
    assert curve[5:40] == [1e-3] * 35  # stable, exactly
    decay = curve[40:]  # the last 20% of 50 updates: 10
    steps = [a - b for a, b in zip([1e-3] + decay, decay)]
    assert steps == pytest.approx([(1e-3 - 1e-4) / 10] * 10, rel=1e-9)
    assert curve[-1] == 1e-4  # min_lr exactly, at the last update
    assert optim.lr_at(60, 50, 1e-3, 1e-4, 5, schedule="wsd") == 1e-4  # and past it


@pytest.mark.parametrize("fraction, first_decayed, total", [(0.1, 45, 50), (0.25, 38, 50), (0.5, 25, 50),
                                                             (0.9, 5, 50), (1.0, 5, 50), (0.2, 26, 33)])
def test_wsd_cooldown_starts_where_the_fraction_says(fraction, first_decayed, total):
    """The last round(fraction x total) updates decay (0.2 of 33: 7, where int() would give 6); never into the
    warmup (1.0: from its end)."""
    curve = wsd(total=total, warmup=5, fraction=fraction)
    assert curve[first_decayed - 1] == 1e-3 > curve[first_decayed]
    assert curve[-1] == 1e-4


@pytest.mark.parametrize("fraction", [1.0, 0.95])
def test_wsd_cooldown_longer_than_the_updates_after_warmup_decays_from_the_warmups_end_a_step_at_a_time(fraction):
    """round(fraction x 50) = 50 or 48 updates of cooldown, more than the 45 after the warmup: the decay takes those
    45, each a step of (peak - floor) / 45 lower, rather than starting below the peak with a jump."""
    decay = wsd(total=50, warmup=5, fraction=fraction)[5:]
    steps = [a - b for a, b in zip([1e-3] + decay, decay)]
    assert steps == pytest.approx([(1e-3 - 1e-4) / 45] * 45, rel=1e-9)


def test_wsd_cooldown_0_never_decays():
    assert wsd(total=20, warmup=4, fraction=0.0)[4:] == [1e-3] * 16
    assert optim.lr_at(25, 20, 1e-3, 1e-4, 4, schedule="wsd", cooldown_fraction=0.0) == 1e-3  # past the end too


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="wsd"):
        optim.lr_at(0, 10, 1e-3, 1e-4, 2, schedule="linear")


def test_step_with_a_closure_evaluates_it_with_gradients_and_returns_its_loss():
    """torch.optim's convention, which both Muon and MuonWithAdamW follow: step(closure) runs the closure with
    gradients enabled (even under no_grad) and returns its loss."""
    model = tiny_model()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def closure():
        model.zero_grad()
        loss = model(x, torch.roll(x, -1, 1), reduction="sum")
        loss.backward()
        return loss

    built = optim.build_optimizer(model, dict(SETTINGS, optimizer="muon"), "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        loss = built.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))  # every parameter stepped
    assert built.muon.step() is None  # without a closure, no loss
    with torch.no_grad():
        assert torch.is_tensor(built.muon.step(closure))  # Muon alone, too
