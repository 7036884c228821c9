"""model_kernels/registry.py: each execution choice declared once. A choice added in one entry (here for the length of a
test) is in --help, passes and fails the settings' checks as its entry says, trains in the model and is one of
tune.py's candidates; and what the registries declare is what the settings, the model and the help read."""
import pytest
import torch
import torch.nn.functional as F

import configurator
import settings
import train
import tune
from configurator import ConfigError
from model_kernels import registry
from settings import TrainSettings
from tests.test_model import random_batch, seeded_model, tiny_config
import plan


def help_line(capsys, key):
    with pytest.raises(SystemExit):
        configurator.load_config(TrainSettings, ["--help"])
    return next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith(f"--{key}="))


def listed_choices(line):
    return line[line.index("[") + 1:line.index("]")].split(" | ")


def plain_cross_entropy(h, weight, targets, chunk_tokens):
    return F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100, reduction="sum")


def cpu_only(device):
    return None if device.type == "cpu" else "runs only on the CPU (a test's choice)"


PLAIN = registry.LossChoice(name="plain_test", help="F.cross_entropy on all the logits, a test's",
                            train=plain_cross_entropy, device_problem=cpu_only)


def test_help_lists_at_most_three_loss_implementations_each_with_its_line(capsys):
    line = help_line(capsys, "loss_impl")
    assert listed_choices(line) == list(registry.LOSS) == ["full", "fused", "quack_chunked"]
    for name in registry.LOSS:
        assert f"{name}: {registry.LOSS[name].help}" in line


@pytest.mark.parametrize("concern", registry.REGISTRIES, ids=lambda r: r.key)
def test_each_settings_field_reads_its_registry(concern):
    """The field's choices are the registry itself (so a temporary choice is one too), its help is the
    registry's, its default is a choice that runs anywhere, and it changes only how the math runs."""
    field = settings.field_of(TrainSettings, concern.key)
    assert field.metadata["choices"] is concern and field.metadata["help"] == concern.help
    assert field.default in concern and concern[field.default].device_problem(torch.device("cpu")) is None
    assert concern.key in settings.execution_keys()
    with pytest.raises(ValueError, match=rf"unknown {concern.key} 'nonsense'; valid: {', '.join(concern)}$"):
        concern["nonsense"]


def test_a_loss_added_in_one_entry_is_in_help_the_checks_the_model_and_tunes_candidates(capsys):
    with registry.LOSS.temporary(PLAIN):
        assert listed_choices(help_line(capsys, "loss_impl"))[-1] == "plain_test"
        # settings' checks: accepted where its entry says it runs, refused elsewhere with its entry's words
        cfg = settings.Config(train.DEFAULTS, loss_impl="plain_test", device="cpu")
        settings.check(TrainSettings, cfg)
        assert plan.check_device(cfg, torch.device("cpu"))[0] == "sdpa"
        with pytest.raises(ConfigError) as refused:
            plan.check_device(cfg, torch.device("cuda"))
        assert str(refused.value).startswith("loss_impl 'plain_test' runs only on the CPU (a test's choice); "
                                             "choose full")  # and the others that run there
        # the model trains with it: the full loss's value and gradients
        config = tiny_config()
        x, y = random_batch(config, 2, 40)
        results = {}
        for name in ("full", "plain_test"):
            m = seeded_model(config, loss_impl=name)
            loss = m(x, y)
            loss.backward()
            results[name] = loss.detach(), [p.grad for p in m.parameters()]
        assert torch.equal(results["plain_test"][0], results["full"][0])
        assert all(torch.equal(a, b) for a, b in zip(results["plain_test"][1], results["full"][1]))
        # tune.py: one of the loss lever's values, a candidate of the search space that this machine can run
        tune_cfg = settings.Config(dict(tune.DEFAULTS, device="cpu", tokens_per_update=8 * 1024, micro_batch_size=8))
        choices = tune.lever_choices(tune_cfg, cuda=False)
        assert "plain_test" in choices["loss_impl"]
        _, space, refused = tune.plan(tune_cfg, choices, torch.device("cpu"))
        assert "loss_impl=plain_test" not in [r["change"] for r in refused]
        assert any(lever == "loss_impl" and c["loss_impl"] == "plain_test" for lever, c in space)
    assert "plain_test" not in registry.LOSS and "plain_test" not in help_line(capsys, "loss_impl")
    with pytest.raises(ConfigError, match="loss_impl 'plain_test' is not one of full, fused, quack_chunked"):
        settings.check(TrainSettings, settings.Config(train.DEFAULTS, loss_impl="plain_test"))


def test_an_mlp_added_in_one_entry_runs_in_every_layer():
    calls = []

    def forward(x, w13, w2):
        calls.append(x.shape)
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    config = tiny_config()
    x, y = random_batch(config, 2, 16)
    with registry.MLP.temporary(registry.MLPChoice(name="plain_test", help="a test's", forward=forward)):
        loss = seeded_model(config, mlp_impl="plain_test")(x, y)
    assert len(calls) == config.n_layers
    assert torch.allclose(loss, seeded_model(config)(x, y), rtol=1e-6)


def test_a_temporary_choice_is_gone_after_an_error_and_a_declared_name_is_refused():
    with pytest.raises(RuntimeError), registry.LOSS.temporary(PLAIN):
        raise RuntimeError("the test's block failed")
    assert "plain_test" not in registry.LOSS
    with pytest.raises(ValueError, match="loss_impl 'full' is declared already"):
        with registry.LOSS.temporary(registry.LossChoice(name="full", help="", train=plain_cross_entropy)):
            pass
    assert registry.LOSS["full"].train is not plain_cross_entropy


def test_problem_says_the_first_reason_in_one_line_and_names_what_would_run():
    cpu = torch.device("cpu")
    cfg = lambda **change: settings.Config(train.DEFAULTS, **change)
    assert registry.problem(cfg(loss_impl="fused", lm_head_fp8=True), cpu) is None
    assert registry.problem(cfg(attention_backend="cudnn"), cpu) == (
        "attention_backend 'cudnn' runs only on CUDA GPUs, not on cpu; choose auto, sdpa or math instead")
    # the settings' own numbers need neither a device nor the model; the model's shape needs the model
    assert registry.problem(cfg(loss_impl="quack_chunked", loss_chunk_tokens=1001)).startswith(
        "loss_impl quack_chunked needs loss_chunk_tokens to be a multiple of 8")
    wide = tiny_config(dim=100, n_heads=2)
    assert registry.problem(cfg(mlp_impl="quack")) is None
    assert registry.problem(cfg(mlp_impl="quack"), model_config=wide).startswith("mlp_impl quack needs the model's")
    # the FP8 head: inside the losses that have its form, which the refusal names
    assert registry.problem(cfg(lm_head_fp8=True)) == (
        "lm_head_fp8 runs inside the fused loss; set loss_impl=fused (got 'full')")
    assert registry.problem(cfg(loss_impl="fused", lm_head_fp8=True), model_config=tiny_config(dim=72, n_heads=2)) \
        == "lm_head_fp8 needs the model's width to be a multiple of 16 (FP8 matmuls), got 72"
    for concern in registry.REGISTRIES:
        for name in concern:
            why = registry.problem(cfg(**{concern.key: name}), cpu)
            assert why is None or (why.startswith(f"{concern.key} '{name}' ") and "\n" not in why), why
