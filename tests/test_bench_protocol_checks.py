"""bench.py's figures, records and checks: median, eager compile fields, per-GPU rates, table, exit, data order."""
import pytest
import torch

import bench
import env
import model as model_lib
import settings
from configurator import ConfigError
from results import read_results, record


def test_the_median_of_an_even_number_of_windows_is_the_mean_of_the_middle_two():
    windows = [{"tokens_per_second": v} for v in (4.0, 1.0, 3.0, 2.0)]
    assert bench.median_window(windows) == 2.5


class EagerStandIn:
    """A stand-in trainer whose update is one small eager matmul: nothing compiles."""
    device = torch.device("cpu")

    def update(self):
        out = (torch.ones(4, 4) @ torch.ones(4)).sum()
        return out, out

    def compile_cache_due(self):
        return False


def test_an_eager_runs_entry_has_no_compile_figures(monkeypatch):
    """compile=False: the first update compiled nothing, so its graphs, compile seconds and cache coldness are null,
    not zeros or an earlier compile's."""
    cfg = settings.Config(bench.DEFAULTS, name="eager", compile=False, warmup=1, windows=1, steps=1,
                          tokens_per_update=4)
    monkeypatch.setattr(bench.env, "compiler_cache_state", lambda fresh=False: ({}, True))
    entry = bench.new_entry(cfg, 1)
    assert entry["cache_was_cold"] is None
    bench.timed_windows(cfg, EagerStandIn(), iter(tuple, None), entry, 1)
    assert entry["first_update_graphs"] is None and entry["first_update_compile_seconds"] is None
    compiled = bench.new_entry(settings.Config(cfg, compile=True), 1)
    assert compiled["cache_was_cold"] is True


def test_rates_per_gpu_and_mfu_are_one_gpus_share(monkeypatch):
    """Under torchrun tokens_per_second is all GPUs' total: per GPU, and MFU against one GPU's peak, it is divided."""
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cfg = settings.Config(bench.DEFAULTS, seq_len=64)
    mcfg = model_lib.get_preset("20m", vocab_size=512, max_seq_len=64)
    figures = bench.throughput(cfg, mcfg, 4000.0, 2, torch.device("cuda", 0))
    flops = model_lib.flops_per_token(mcfg, 64)
    assert figures["tokens_per_second"] == 4000.0 and figures["tokens_per_second_per_gpu"] == 2000.0
    assert figures["mfu"] == pytest.approx(flops * 2000.0 / env.peak_flops("NVIDIA H100 80GB HBM3"))


def test_a_partial_probe_is_recorded_with_its_benchmark_and_run(tmp_path):
    cfg = settings.Config(name="probed", results_file=str(tmp_path / "r.json"))
    probes = [{"sequences": 8, "seconds": 0.1, "loss": 4.0}]
    bench.record_entry(cfg, {"run_id": "r1", "status": "ok", "partial_probe": probes})
    assert read_results(tmp_path / "r.json")["partial-probe"] == {"benchmark": "probed", "run_id": "r1",
                                                                 "probes": probes}


def scaling_cfg(tmp_path, **overrides):
    return settings.Config(bench.DEFAULTS, **dict(dict(name="s", scaling_reference="ref", preset="20m", seq_len=64,
                                                       tokens_per_update=512,
                                                       results_file=str(tmp_path / "r.json")), **overrides))


def test_a_scaling_reference_of_another_update_size_is_refused(tmp_path):
    record(tmp_path / "r.json", ["benchmarks", "ref"], {"tokens_per_second": 1000.0, "world_size": 1,
                                                         "config": {"preset": "20m", "seq_len": 64,
                                                                    "tokens_per_update": 1024}})
    with pytest.raises(ConfigError, match="tokens_per_update 1024 against 512"):
        bench.check_scaling_reference(scaling_cfg(tmp_path))


def test_a_scaling_reference_whose_config_lacks_keys_is_compared_on_those_it_has(tmp_path):
    """An entry written before a shape key existed holds no value for it: that is no difference (nor a KeyError)."""
    record(tmp_path / "r.json", ["benchmarks", "ref"], {"tokens_per_second": 1000.0, "world_size": 1,
                                                         "config": {"preset": "20m", "seq_len": 64}})
    bench.check_scaling_reference(scaling_cfg(tmp_path))


def test_the_table_shows_the_ratio_to_the_previous_entry_and_mfu_in_percent(capsys):
    entry = {"status": "ok", "tokens_per_second": 1500.0, "mfu": 0.4123, "first_update_seconds": 2.0}
    bench.print_table([("run", {"tokens_per_second": 1000.0}, entry)])
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row == ["run", "ok", "1,500", "1,000", "1.50", "41.2%", "2.0", "-", "-"]


def test_one_failed_preset_fails_the_whole_run(monkeypatch):
    """With presets, one entry's error is exit 1 even when the others measured."""
    monkeypatch.setattr(bench, "run", lambda cfg: [{"status": "ok"}, {"status": "error"}])
    assert bench.main([]) == 1
    monkeypatch.setattr(bench, "run", lambda cfg: [{"status": "ok"}, {"status": "ok"}])
    assert bench.main([]) == 0


def test_progress_lines_come_from_the_main_process_only(monkeypatch, capsys):
    """Under torchrun every rank runs the protocol: one line per event, not one per GPU."""
    cfg = settings.Config(name="b")
    monkeypatch.setenv("RANK", "1")
    bench.say(cfg, "window 1/3")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    bench.say(cfg, "window 1/3")
    assert capsys.readouterr().out == "b: window 1/3\n"


class SavingStandIn(EagerStandIn):
    """The eager stand-in with a compile cache that is due: what it saved, and when (in updates made so far)."""

    def __init__(self):
        self.updates, self.saved_after = 0, []

    def update(self):
        self.updates += 1
        return super().update()

    def compile_cache_due(self):
        return not self.saved_after

    def save_compile_cache(self):
        self.saved_after.append(self.updates)


def test_a_due_compile_cache_is_written_after_the_warmup_before_the_windows():
    """bench.py --compile_cache: the file is written once the warmup's updates compiled, outside every window."""
    cfg = settings.Config(bench.DEFAULTS, name="cached", compile=False, warmup=2, windows=2, steps=3,
                          tokens_per_update=4)
    trainer = SavingStandIn()
    bench.timed_windows(cfg, trainer, iter(tuple, None), {}, 1)
    assert trainer.saved_after == [2] and trainer.updates == 2 + 2 * 3


def test_the_timed_updates_past_an_epoch_take_the_next_epochs_order(text_cache):
    """A subset of fewer full updates than the protocol makes is cycled epoch by epoch, as train.py reads it: the
    update after the last full one is the next epoch's first, not the first epoch's again."""
    import plan as plan_lib
    cfg = settings.Config(bench.DEFAULTS, data_dir=str(text_cache), preset="20m", dim=64, n_layers=2, n_heads=2,
                          hidden_dim=128, seq_len=64, tokens_per_update=512, micro_batch_size=4, device="cpu",
                          cpu_threads=1, train_subset_tokens=2_000, epochs=3)
    plan = plan_lib.resolve(cfg, settings.BenchSettings, world=(0, 0, 1))
    data, make = bench.protocol_data(plan)
    full = data.n_sequences // plan.sequences_per_update
    first = lambda batches: batches[0][0][0]  # the first micro-batch's inputs
    assert torch.equal(first(make(full + 1)), first(data.micro_batches(1, 1, 4)))
    assert not torch.equal(first(make(full)), first(make(0)))
