"""What a practitioner expects of train.py beyond training: a GPU config refused on a CPU, starting from weights
(init_from), no silent overwrite of a run, the training-loss curve in the entry and the optional dashboards."""
import sys
import time

import pytest
import torch

import checkpoint
import hf
import train
from results import lookup
from tests.test_train import REPO, checkpoint_parameters, cli_args, small_config
import settings
from tests.conftest import setup


def one_line_error(capsys, *words):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("argv", [["config/20m_gh200.py"], []])
def test_a_gpu_recipe_without_a_gpu_is_refused_in_one_line_naming_device_cpu(tmp_path, capsys, argv):
    """The 20m recipe on a CPU needed 216 s for its first update, silently; bench.py with no config too."""
    start = time.time()
    code = train.main([str(REPO / a) for a in argv] + [f"--results_file={tmp_path / 'r.json'}",
                                                       f"--out_dir={tmp_path / 'out'}"])
    assert code == 2 and time.time() - start < 10
    one_line_error(capsys, "--device=cpu")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("script", ["bench", "compare"])
def test_the_gpu_scripts_refuse_a_cpu_in_one_line_too(tmp_path, capsys, script):
    """`python bench.py --compile` printed nothing for minutes; compare.py started 20M-parameter CPU runs."""
    import importlib
    start = time.time()
    out_dir = [f"--out_dir={tmp_path / 'out'}"] if script == "compare" else []  # bench.py writes no run folder
    code = importlib.import_module(script).main(["--compile=True", f"--results_file={tmp_path / 'r.json'}", *out_dir])
    assert code == 2 and time.time() - start < 20
    one_line_error(capsys, "--device=cpu")


def test_a_rerun_of_a_name_is_refused_unless_resumed_or_overwritten(text_cache, tmp_path, capsys):
    cfg = small_config(text_cache, tmp_path, epochs=1)
    train.train(cfg)
    ckpt = tmp_path / "out" / "ckpt.pt"
    before = ckpt.read_bytes()
    capsys.readouterr()
    assert train.main(cli_args(cfg)) == 2
    one_line_error(capsys, "--resume=True", "--overwrite=True", str(ckpt))
    assert ckpt.read_bytes() == before  # nothing trained, nothing written
    again = train.train(settings.Config(cfg, overwrite=True, seed=7))
    assert again["status"] == "complete" and ckpt.read_bytes() != before


def test_init_from_a_checkpoint_takes_its_shape_and_weights_and_names_them_in_the_recipe(text_cache, tmp_path,
                                                                                         capsys):
    source = train.train(small_config(text_cache, tmp_path, name="src", out_dir=str(tmp_path / "src"), epochs=1))
    # a shape in the config that the weights contradict is refused (it would be recorded but not trained)
    wrong = small_config(text_cache, tmp_path, name="wrong", out_dir=str(tmp_path / "wrong"), epochs=0,
                         dim=32, n_layers=1, init_from=str(tmp_path / "src"))
    capsys.readouterr()
    assert train.main(cli_args(wrong)) == 2
    one_line_error(capsys, "dim=32 (the weights have 64)", "n_layers=1 (the weights have 2)")
    assert not (tmp_path / "wrong").exists()  # refused before its folder was made
    # so is a preset asked for (not the default's) whose shape the weights do not have: the weights' was trained
    shapeless = {k: 0 for k in ("dim", "n_layers", "n_heads", "hidden_dim")}
    wrong = settings.Config(wrong, preset="90m", **shapeless)
    assert train.main(cli_args(wrong)) == 2
    one_line_error(capsys, "preset=90m's dim 768 (the weights have 64)")
    assert not (tmp_path / "wrong").exists()
    # the preset's shape (0s) or the weights' own is theirs, and 0 epochs keeps them as they are
    cfg = small_config(text_cache, tmp_path, name="from", out_dir=str(tmp_path / "from"), epochs=0,
                       dim=0, n_layers=0, init_from=str(tmp_path / "src"))
    entry = train.train(cfg)
    assert entry["recipe"]["model"] == source["recipe"]["model"]
    a, b = checkpoint_parameters(tmp_path / "src"), checkpoint_parameters(tmp_path / "from")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert entry["recipe"]["init_weights"] == checkpoint.weights_sha256(a)
    assert "init_from" not in entry["recipe"]  # the weights count, not the path they were read from
    plain = small_config(text_cache, tmp_path, name="plain", out_dir=str(tmp_path / "plain"), epochs=1)
    assert "init_weights" not in setup(plain)[2]
    assert setup(plain)[2] != entry["recipe"]


def test_init_from_a_transformers_folder_starts_from_its_weights(text_cache, tmp_path):
    train.train(small_config(text_cache, tmp_path, name="src", out_dir=str(tmp_path / "src"), epochs=1))
    model, _ = checkpoint.load_model(tmp_path / "src" / "ckpt.pt")
    hf.to_hf(model).save_pretrained(tmp_path / "hf")
    cfg = small_config(text_cache, tmp_path, name="from-hf", out_dir=str(tmp_path / "from-hf"), epochs=0,
                       init_from=str(tmp_path / "hf"))
    entry = train.train(cfg)
    a, b = model.state_dict(), checkpoint_parameters(tmp_path / "from-hf")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert entry["recipe"]["init_weights"] == checkpoint.weights_sha256({k: v.float() for k, v in a.items()})


def test_init_from_outside_the_family_or_nowhere_is_one_line(text_cache, tmp_path, capsys):
    train.train(small_config(text_cache, tmp_path, name="src", out_dir=str(tmp_path / "src"), epochs=1))
    model, _ = checkpoint.load_model(tmp_path / "src" / "ckpt.pt")
    grouped = hf.to_hf(model)
    grouped.config.num_key_value_heads = 1  # grouped-query attention: not a tiny-llm shape
    grouped.save_pretrained(tmp_path / "gqa")
    capsys.readouterr()
    model_only = tmp_path / "no-weights"
    hf.to_hf(model).config.save_pretrained(model_only)  # a good config.json beside no weights
    for path, words in ((tmp_path / "gqa", "outside the tiny-llm family: grouped-query attention"),
                        (model_only, "its weights could not be loaded"),
                        (tmp_path / "nowhere", "neither a transformers Llama folder")):
        cfg = small_config(text_cache, tmp_path, name="x", out_dir=str(tmp_path / "x"), init_from=str(path))
        assert train.main(cli_args(cfg)) == 2
        one_line_error(capsys, words)


@pytest.mark.parametrize("setting, words", [
    ({"attention_backend": "cudnn"}, "attention_backend 'cudnn' runs only on CUDA GPUs"),
    ({"name": ""}, "name '' cannot name a run's folder"),
    ({"name": "a/b"}, "give a name without '/'"),
    ({"results_file": "/proc/no/results.json"}, "results file /proc/no/results.json cannot be written")])
def test_settings_that_cannot_run_here_are_one_line_before_any_work(text_cache, tmp_path, capsys, setting, words):
    """SDPA's CUDA-only kernels failed in the first forward; an unwritable results file waited out the lock's
    ten-minute timeout after building everything; an empty name trained into the results file's top level."""
    cfg = small_config(text_cache, tmp_path, **setting)
    start = time.time()
    assert train.main(cli_args(cfg)) == 2
    one_line_error(capsys, words)
    assert time.time() - start < 30
    assert not (tmp_path / "out").exists()  # no run folder left behind
    if "results_file" not in setting:
        assert lookup(cfg.results_file, [cfg.name or "t"]) is None


def test_a_vocab_size_above_the_caches_is_refused(text_cache, tmp_path, capsys):
    """A 32,000-row LM head on a 256-token cache trained without a word."""
    cfg = small_config(text_cache, tmp_path, vocab_size=32000)
    assert train.main(cli_args(cfg)) == 2
    one_line_error(capsys, "vocab_size 32000 is larger than the 256 tokens")


def test_the_entry_holds_the_training_curve_and_the_dashboards_get_it(text_cache, tmp_path, fake_wandb):
    logged = fake_wandb
    cfg = small_config(text_cache, tmp_path, epochs=1, log_interval=2, tensorboard_dir=str(tmp_path / "tb"),
                       wandb_log=True)
    entry = train.train(cfg)
    curve = entry["training_curve"]
    assert [p["update"] for p in curve] == [2, 3]  # every log_interval, and the epoch's last update
    assert [p["tokens"] for p in curve] == [16 * 64, 21 * 64]
    assert all(p["loss"] > 0 and p["grad_norm"] > 0 for p in curve)
    # the rate each logged update ran at: the end of warmup (2 updates), then the cosine's start
    assert [p["lr"] for p in curve] == [pytest.approx(3e-3), pytest.approx(3e-3)]
    assert lookup(cfg.results_file, ["t", "training_curve"]) == curve
    # a point is the token-weighted mean loss of its interval: the same run logged at every update
    every = train.train(small_config(text_cache, tmp_path, epochs=1, name="every", out_dir=str(tmp_path / "every"),
                                     tensorboard_dir=str(tmp_path / "tb")))
    fine = every["training_curve"]
    tokens = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}] + fine, fine)]
    assert curve[0]["loss"] == pytest.approx((fine[0]["loss"] * tokens[0] + fine[1]["loss"] * tokens[1])
                                             / (tokens[0] + tokens[1]), rel=1e-5)
    assert curve[1]["loss"] == pytest.approx(fine[2]["loss"], rel=1e-5)

    assert logged[0][0] == "init" and logged[0][1]["mode"] == "offline" and logged[0][1]["id"] == entry["run_id"]
    train_points = [(step, s["train/loss"]) for kind, *rest in logged if kind == "log"
                    for step, s in [rest] if "train/loss" in s]
    assert train_points == [(p["update"], p["loss"]) for p in curve]
    assert logged[-1] == ("finish",)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    # two runs into one tensorboard_dir are two TensorBoard runs, each in the folder of its name (one merged run
    # before: `tensorboard --logdir tb` drew both runs' points as one curve)
    assert sorted(str(f.parent.relative_to(tmp_path / "tb")) for f in (tmp_path / "tb").rglob("events.out.*")) == [
        "every", "t"]
    for name, run in (("t", entry), ("every", every)):
        events = EventAccumulator(str(tmp_path / "tb" / name))
        events.Reload()
        scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
        assert scalars == [(p["update"], pytest.approx(p["loss"], rel=1e-6)) for p in run["training_curve"]]
        assert [e.value for e in events.Scalars("val/subset_loss")] == [
            pytest.approx(p["loss"]) for p in run["validation_curve"]]
    # the run started again under its name (overwrite): only its own points, not the replaced run's beside them
    again = train.train(settings.Config(cfg, log_interval=1, wandb_log=False, overwrite=True))
    events = EventAccumulator(str(tmp_path / "tb" / "t"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (p["update"], pytest.approx(p["loss"], rel=1e-6)) for p in again["training_curve"]]
    # stopped and resumed: the points logged at the checkpoint's update stay (the resumed process does not log them
    # again); a purge from that update on had dropped them
    stopped = settings.Config(cfg, log_interval=1, epochs=2, wandb_log=False, overwrite=True, stop_after_updates=2)
    assert train.train(stopped)["status"] == "interrupted"
    resumed = train.train(settings.Config(stopped, overwrite=False, resume=True, stop_after_updates=0))
    events = EventAccumulator(str(tmp_path / "tb" / "t"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [p["update"] for p in resumed["training_curve"]]


def test_dashboards_that_are_not_installed_are_one_line_before_training(text_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = small_config(text_cache, tmp_path, wandb_log=True)
    assert train.main(cli_args(cfg)) == 2
    one_line_error(capsys, "pip install wandb")
    assert lookup(cfg.results_file, ["t"]) is None


def test_a_signal_arriving_twice_is_one_stop_and_a_later_second_stops_at_once():
    """A scheduler may signal train.py and its parent (compare.py), which passes the signal on: the same stop
    arriving twice must not turn into the second signal's stop-now, which skips the checkpoint."""
    import os
    import signal
    stop = train.StopRequest()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # the same stop, again: ignored
        stop.signalled_at -= train.StopRequest.SAME_STOP_SECONDS + 1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
    finally:
        stop.restore()


def test_an_unwritable_tensorboard_dir_is_one_line_before_training(text_cache, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    cfg = small_config(text_cache, tmp_path, tensorboard_dir=str(tmp_path / "a-file" / "tb"))
    assert train.main(cli_args(cfg)) == 2
    one_line_error(capsys, "tensorboard_dir", "cannot be written")
    assert lookup(cfg.results_file, ["t"]) is None
