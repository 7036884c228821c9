"""update_graph: the gradient clip and the optimizer step compiled with the model.

On a GPU with reduce-overhead they replay as CUDA graphs; here, on the CPU, the same torch.compile runs without
them, so these tests hold what does not depend on the graphs: the optimizer it builds, that the compiled step
updates the weights as the eager one does and is compiled once whatever the schedule does, and that a checkpoint
moves between the two settings.
"""
import copy

import pytest
import torch

import model as model_lib
import optim
import plots
import train
import trainer as trainer_lib
from tests.test_optim import SETTINGS, saved, tiny_model, train_steps
import settings

GRAPH = dict(SETTINGS, update_graph=True, compile=True)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_it_builds_a_capturable_foreach_adamw_and_learning_rates_on_the_device(name):
    built = optim.build_optimizer(tiny_model(), dict(GRAPH, optimizer=name), "cpu")
    for each in getattr(built, "optimizers", (built,)):
        for group in each.param_groups:
            assert torch.is_tensor(group["lr"]) and group["lr"].dtype == torch.float32
    for group in (built.adamw if name == "muon" else built).param_groups:
        assert (group["fused"], group["foreach"], group["capturable"]) == (False, True, True)
    if name == "muon":
        assert built.muon.compile is False  # traced whole by the trainer's compile, not compiled apart
    plain = optim.build_optimizer(tiny_model(), dict(SETTINGS, optimizer=name), "cpu")
    assert all(isinstance(g["lr"], float) for g in plain.param_groups)  # the default run: floats, as always


def test_set_lr_fills_the_tensors_in_place_with_the_same_values():
    learning_rate = SETTINGS["learning_rate"]
    graph = optim.build_optimizer(tiny_model(), dict(GRAPH, optimizer="muon"), "cpu")
    plain = optim.build_optimizer(tiny_model(), dict(SETTINGS, optimizer="muon"), "cpu")
    tensors = [g["lr"] for g in graph.param_groups]
    for lr in (learning_rate, 7e-4, 1.3e-5):
        optim.set_lr(graph, lr, learning_rate)
        optim.set_lr(plain, lr, learning_rate)
        assert [g["lr"] for g in graph.param_groups] == tensors  # the same objects: what the graph reads
        for ours, theirs in zip(graph.param_groups, plain.param_groups):
            assert ours["lr"].item() == torch.tensor(theirs["lr"], dtype=torch.float32).item()


def test_muon_state_made_up_front_is_the_state_the_first_step_makes():
    first, second = tiny_model(), tiny_model()
    lazy = optim.build_optimizer(first, dict(SETTINGS, optimizer="muon"), "cpu")
    eager = optim.build_optimizer(second, dict(SETTINGS, optimizer="muon"), "cpu")
    eager.muon.init_state()
    train_steps(first, lazy, 2)
    train_steps(second, eager, 2)
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters()))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_checkpoint_moves_between_the_two_settings_and_resumes_bitwise(name):
    plain_settings, graph_settings = dict(SETTINGS, optimizer=name), dict(GRAPH, optimizer=name)
    model = tiny_model()
    plain = optim.build_optimizer(model, plain_settings, "cpu")
    train_steps(model, plain, 2)
    graph = optim.build_optimizer(copy.deepcopy(model), graph_settings, "cpu")
    optim.load_state(graph, saved(plain))  # torch's load alone would take the saved groups' options
    for group in graph.param_groups:
        assert torch.is_tensor(group["lr"]) and group.get("capturable", True) and not group.get("fused", False)
    back = optim.build_optimizer(copy.deepcopy(model), plain_settings, "cpu")
    optim.load_state(back, saved(graph))
    assert all(isinstance(g["lr"], float) and not g.get("capturable", False) for g in back.param_groups)
    # the compiled capturable form resumes bit for bit: 2 steps, a checkpoint, 2 more, against 4 uninterrupted
    # (it only ever steps compiled: eager, torch refuses capturable on a CPU)
    model, resumed_model = tiny_model(), tiny_model()
    whole = optim.build_optimizer(model, graph_settings, "cpu")
    train_steps(model, Compiled(whole), 2, seed=0)
    resumed_model.load_state_dict(model.state_dict())
    resumed = optim.build_optimizer(resumed_model, graph_settings, "cpu")
    optim.load_state(resumed, saved(whole))
    train_steps(model, Compiled(whole), 2, seed=1)
    train_steps(resumed_model, Compiled(resumed), 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


class Compiled:
    """An optimizer whose step runs under torch.compile, as the trainer's compiled step runs it."""

    def __init__(self, optimizer):
        self.optimizer, self.step = optimizer, torch.compile(optimizer.step)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def compiled_trainer(name, update_graph, micro_batch_size=4):
    cfg = settings.Config(dict(train.DEFAULTS, preset="20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, seq_len=32,
                            device="cpu", cpu_threads=1, tokens_per_update=4 * 32, micro_batch_size=micro_batch_size,
                            compile=True, update_graph=update_graph, optimizer=name, warmup_updates=2,
                            loss_impl="full"))
    mcfg = model_lib.get_preset("20m", dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=256,
                                max_seq_len=32)
    return trainer_lib.Trainer(cfg, mcfg, "cpu", total_updates=4)


def fresh_compiler():
    """torch.compile's caches and its counters emptied (reset alone keeps the counters, which then hold the graphs
    of an earlier trainer)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def run_updates(trainer, n=4):
    """n updates of seeded random tokens (4 sequences of 32, in the trainer's micro-batches); the losses and
    gradient norms, and the count of graphs compiled so far after each update."""
    g, out, graphs = torch.Generator().manual_seed(0), [], []
    mb = trainer.cfg.micro_batch_size
    for _ in range(n):
        x = torch.randint(0, 256, (4, 32), generator=g)
        batches = [(x[i:i + mb], torch.roll(x, -1, 1)[i:i + mb]) for i in range(0, 4, mb)]
        out += [float(t) for t in trainer.update(batches, 4 * 32)]  # loss, grad norm
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out, graphs


@pytest.mark.parametrize("name, micro_batch_size", [("adamw", 4), ("muon", 4), ("adamw", 2)])
def test_the_compiled_step_updates_as_the_eager_step_and_compiles_once(name, micro_batch_size):
    """A compiled model with the eager clip and step, against the same with update_graph: the same losses,
    gradient norms and weights to float tolerance (other kernels, the same formula) over 4 updates whose learning
    rate changes each time (warmup, then cosine); the step is compiled (more graphs than the model's alone), at
    the first update and never again. Micro-batch 2: two micro-steps accumulated into each gradient."""
    runs, compiled = {}, {}
    for update_graph in (False, True):
        fresh_compiler()
        trainer = compiled_trainer(name, update_graph, micro_batch_size)
        start = [p.detach().clone() for p in trainer.raw_model.parameters()]
        out, graphs = run_updates(trainer)
        assert graphs[1:] == graphs[:1] * 3, graphs  # the new learning rates compiled nothing more
        runs[update_graph] = out, [p.detach() - p0 for p, p0 in zip(trainer.raw_model.parameters(), start)]
        compiled[update_graph] = graphs[0]
    # the clip and the step are graphs of their own (AdamW's step is 2, torch.optim breaking it on purpose)
    assert compiled[True] - compiled[False] >= 2, compiled
    assert hasattr(trainer.optimizer_step, "_torchdynamo_orig_callable")  # the step the updates ran: compiled
    # what lives across updates is marked static: the learning rates, and the gradients the trainer keeps
    marked = lambda t: getattr(t, "_dynamo_static_input_type", None) is not None
    assert all(marked(g["lr"]) for each in getattr(trainer.optimizer, "optimizers", (trainer.optimizer,))
               for g in each.param_groups)
    assert not trainer.stable_grads  # the CPU's compile has no CUDA graphs: backward makes the gradients afresh
    (eager, eager_moves), (graph, graph_moves) = runs[False], runs[True]
    # Muon's Newton-Schulz runs in bf16, which the compiler fuses and rounds otherwise (tests/test_optim.py: about
    # one bf16 step of the update, a few per cent of an element's move); AdamW is float32 throughout
    # (measured: Muon's moves differ by about 3%, AdamW's by 5e-6)
    tolerance, moves = (1e-3, 0.1) if name == "muon" else (1e-5, 1e-4)
    assert graph == pytest.approx(eager, rel=tolerance)
    for ours, theirs in zip(graph_moves, eager_moves):  # each weight's change over the 4 updates
        assert (ours - theirs).norm() <= moves * theirs.norm()


def test_the_gradients_the_trainer_keeps_are_marked_static(monkeypatch):
    """Under CUDA graphs with accumulation the trainer keeps each gradient in place across updates (tests above
    run the CPU's plain compile, where backward makes them afresh): those tensors are what the step marks."""
    monkeypatch.setattr(trainer_lib, "uses_cudagraphs", lambda cfg: True)  # the GPU's rule, on the CPU
    fresh_compiler()
    trainer = compiled_trainer("adamw", update_graph=True, micro_batch_size=2)
    assert trainer.stable_grads
    kept = [p.grad for p in trainer.params]
    run_updates(trainer, 2)
    assert all(p.grad is g for p, g in zip(trainer.params, kept))  # the same tensors, zeroed in place
    assert all(getattr(g, "_dynamo_static_input_type", None) is not None for g in kept)


@pytest.mark.parametrize("updates_before", [0, 2])
def test_a_resumed_run_compiles_its_step_once_around_the_loaded_state(updates_before):
    """A checkpoint from a run without update_graph, saved before its first update (no Muon state yet) or after
    2 (Muon's buffers, which the load puts in place of any made before), loaded into a trainer with update_graph:
    the step makes the state it lacks and marks the loaded buffers as the ones it updates in place (under CUDA
    graphs an unmarked buffer changed in place sends the step back to eager), and compiles at the first update
    only."""
    plain = compiled_trainer("muon", update_graph=False)
    run_updates(plain, updates_before)
    checkpoint, weights, step = saved(plain.optimizer), copy.deepcopy(plain.raw_model.state_dict()), plain.step
    run_updates(plain, 1)  # one more update, without update_graph: the momentum the resumed run must reach
    momentum = lambda t: [t.optimizer.muon.state[p]["momentum_buffer"] for p in t.optimizer.muon.param_groups[0]["params"]]
    expected = [b.clone() for b in momentum(plain)]
    fresh_compiler()
    resumed = compiled_trainer("muon", update_graph=True)
    resumed.raw_model.load_state_dict(weights)
    resumed.step = step
    optim.load_state(resumed.optimizer, checkpoint)
    buffers = list(resumed.optimizer.muon.state.values())
    assert len(buffers) == (0 if updates_before == 0 else len(resumed.optimizer.muon.param_groups[0]["params"]))
    _, first = run_updates(resumed, 1)
    for ours, theirs in zip(momentum(resumed), expected):  # the loaded momentum carried on, not made afresh
        assert (ours - theirs).norm() <= 1e-4 * theirs.norm()
    _, graphs = run_updates(resumed, 3)
    assert graphs == first * 3, (first, graphs)  # compiled at the first update only
    for buffer in momentum(resumed):  # the buffers the step updated: marked static
        assert getattr(buffer, "_dynamo_static_input_type", None) is not None


def test_train_py_resumes_a_run_saved_without_update_graph_with_it(text_cache, tmp_path, monkeypatch):
    """train.py's resume path (Run.load) keeps this run's optimizer options: with update_graph, the capturable
    foreach AdamW and device learning rates, whatever the checkpoint's run used (torch's own load would take the
    saved groups' fused form and float rates)."""
    from tests.test_train import small_config
    cfg = small_config(text_cache, tmp_path, compile=True, epochs=1)
    assert train.train(settings.Config(cfg, stop_after_updates=2))["status"] == "interrupted"
    seen = []
    compile_step = trainer_lib.Trainer.compile_step

    def spy(self):  # the optimizer as the compiled step first finds it: after the load
        seen.extend(dict(g) for g in self.optimizer.param_groups)
        return compile_step(self)
    monkeypatch.setattr(trainer_lib.Trainer, "compile_step", spy)
    last = train.train(settings.Config(cfg, resume=True, update_graph=True))
    assert last["status"] == "complete" and last["sessions"] == 2 and plots.finite_number(last["final_validation"]["loss"])
    assert seen and all(torch.is_tensor(g["lr"]) and g["capturable"] and g["foreach"] for g in seen)
