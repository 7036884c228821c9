"""bench.py on the CPU: the same code path as on the GPU, with a tiny model and a short protocol."""
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from results import read_results, record
import trainer as trainer_lib
import bench
import env
import model as model_lib
from data.loader import TokenCache
import settings
import profiling

SHAPE = ["--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128"]
TINY = ["--preset=20m", *SHAPE, "--seq_len=64", "--tokens_per_update=512", "--micro_batch_size=4", "--device=cpu", "--cpu_threads=1",
        "--train_subset_tokens=60000", "--warmup=2", "--steps=3", "--windows=3"]


def run_bench(tmp_path, cache, *extra, base=TINY):
    results = tmp_path / "results.json"
    argv = base + [f"--data_dir={cache}", f"--results_file={results}", *extra]
    code = bench.main(argv)
    return code, read_results(results)


def test_window_arithmetic_and_median():
    w = bench.window_summary(0, seconds=2.0, n_updates=100, tokens_per_update=32768, loss_sum=100 * 32768 * 4.5,
                             grad_norm=0.7)
    assert w["tokens_per_second"] == pytest.approx(100 * 32768 / 2.0)
    assert w["loss"] == pytest.approx(4.5)
    windows = [{"tokens_per_second": v} for v in (3.0, 1.0, 2.0)]
    assert bench.median_window(windows) == 2.0


def test_protocol_entry_real_data(tmp_path, text_cache, capsys):
    code, results = run_bench(tmp_path, text_cache, "--name=cpu-real", "--partial_probe=True")
    assert code == 0
    # it said "building the 20m model" for a 1.4M-parameter one (the preset with its shape overridden)
    parameters = results["benchmarks"]["cpu-real"]["parameters"]
    assert (f"building a {parameters / 1e6:.1f}M-parameter model (the 20m preset with its shape overridden)"
            in capsys.readouterr().out)
    entry = results["benchmarks"]["cpu-real"]
    assert entry["status"] == "ok"
    # the reference file's fields
    for field in ("tokens_per_second", "micro_batch_size", "compile", "compile_mode", "attention_backend", "cpu_threads",
                  "warmup_seconds", "first_update_seconds", "peak_memory_bytes", "attention_kernels",
                  "measurements", "protocol", "config_identity", "status", "source_hash", "compiler_cache",
                  "environment"):
        assert field in entry, field
    assert entry["protocol"] == {"version": 2, "warmup": 2, "steps": 3, "windows": 3, "data_mode": "real",
                                 "profile": False, "cache_identity": json.loads((text_cache / "meta.json")
                                                                               .read_text())["cache_identity"]}
    windows = entry["measurements"]
    assert [w["window"] for w in windows] == [0, 1, 2]
    for w in windows:
        assert w["tokens_per_second"] == pytest.approx(3 * 512 / w["seconds"])
        assert 0 < w["loss"] < 10 and w["grad_norm"] > 0
    assert entry["tokens_per_second"] == statistics.median(w["tokens_per_second"] for w in windows)
    assert entry["warmup_seconds"] >= entry["first_update_seconds"] > 0
    assert entry["mfu"] is None  # no GPU: unknown peak
    assert any("scaled_dot_product" in k or "attention" in k for k in entry["attention_kernels"])
    assert entry["config_identity"] == env.config_identity(entry["config"])
    assert entry["peak_memory_bytes"] > 0 and entry["source_hash"] == env.source_hash()
    assert set(entry["compiler_cache"]) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"}
    # the loss falls over the windows: these are real training updates, not a replay of one
    assert windows[-1]["loss"] < windows[0]["loss"]
    assert "profile" not in entry and "profiles" not in results  # a GPU measurement (test_profile_is_refused_on_a_cpu)
    probes = results["partial-probe"]["probes"]
    assert [p["sequences"] for p in probes] == [8, 2, 6, 8]  # 32, 11, 25, 32 scaled to 8 sequences per update
    assert all(p["seconds"] > 0 and 0 < p["loss"] < 10 for p in probes)  # each probe ran a training update


def test_synthetic_mode_needs_no_dataset(tmp_path):
    code, results = run_bench(tmp_path, tmp_path / "no-such-cache", "--name=cpu-synth", "--data_mode=synthetic",
                              "--vocab_size=512")
    assert code == 0
    entry = results["benchmarks"]["cpu-synth"]
    assert entry["status"] == "ok" and entry["protocol"]["data_mode"] == "synthetic"
    assert entry["protocol"]["cache_identity"] is None and entry["vocab_size"] == 512


def test_synthetic_mode_times_the_model_train_py_would_build(tmp_path, text_cache):
    """With vocab_size=0 the vocabulary follows the cache; synthetic data times 32,000 classes only without one
    (it timed 32,000 for a 4,096-token cache, an LM head 8x the one trained)."""
    code, results = run_bench(tmp_path, text_cache, "--name=synth-cache", "--data_mode=synthetic")
    assert code == 0 and results["benchmarks"]["synth-cache"]["vocab_size"] == TokenCache(text_cache).vocab_size
    code, results = run_bench(tmp_path, tmp_path / "no-such-cache", "--name=synth-none", "--data_mode=synthetic")
    assert code == 0 and results["benchmarks"]["synth-none"]["vocab_size"] == 32000


def test_error_is_recorded_not_lost(tmp_path, text_cache, monkeypatch):
    def out_of_memory(self, micro_batches, n_tokens):
        raise RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB")
    monkeypatch.setattr(trainer_lib.Trainer, "update", out_of_memory)
    code, results = run_bench(tmp_path, text_cache, "--name=cpu-oom")
    assert code == 1
    entry = results["benchmarks"]["cpu-oom"]
    assert entry["status"] == "error" and "out of memory" in entry["error"]
    assert entry["config_identity"] and entry["protocol"]["version"] == 2
    # the shared results file names no machine: repository files relative to it, torch from site-packages on
    trace = entry["traceback"]
    assert 'File "bench.py", line' in trace and 'File "tests/test_bench.py", line' in trace
    assert str(env.REPO) not in trace and '"/' not in trace


@pytest.mark.parametrize("args, words", [(["--data_mode=imaginary"], ["data_mode", "synthetic"]),
                                         (["--data_mode=synthetic", "--preset=bogus"], ["'bogus'", "20m, 50m, 90m"]),
                                         (["--data_mode=synthetic", "--n_heads=7"], ["64", "7"]),
                                         (["--presets=20m,bogus", "--dim=0", "--n_layers=0", "--n_heads=0",
                                           "--hidden_dim=0"], ["unknown", "'bogus'"]),
                                         (["--presets=20m,50m", "--dim=0", "--n_layers=0", "--n_heads=0",
                                           "--hidden_dim=0", "--init_from=out/x"], ["init_from out/x fixes one"])])
def test_user_mistake_is_one_line_and_no_result(tmp_path, text_cache, capsys, args, words):
    """A bad model shape in synthetic mode was recorded as a failed measurement, with a traceback."""
    code, results = run_bench(tmp_path, text_cache, "--name=bad", *args)
    assert code == 2 and not results.get("benchmarks")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err


def test_the_warmup_makes_its_updates_and_each_window_times_only_its_own(tmp_path, text_cache, monkeypatch):
    """The protocol: `warmup` updates (the first compiles), then each window's `steps` updates alone on its clock. A
    first update made slow (as a compile is) must be in first_update_seconds and warmup_seconds, never in a window."""
    calls, update = [], trainer_lib.Trainer.update

    def counted(self, *batch):
        calls.append(time.perf_counter())
        if len(calls) == 1:
            time.sleep(0.5)  # the first update's compile
        return update(self, *batch)
    monkeypatch.setattr(trainer_lib.Trainer, "update", counted)
    code, results = run_bench(tmp_path, text_cache, "--name=protocol", "--warmup=3", "--steps=2", "--windows=2",
                              "--partial_probe=False")
    entry = results["benchmarks"]["protocol"]
    # the warmup's updates, the windows', then one more, profiled, outside them (the attention kernels' names)
    assert code == 0 and len(calls) == 3 + 2 * 2 + 1
    assert entry["warmup_seconds"] >= entry["first_update_seconds"] >= 0.5
    window_seconds = [m["seconds"] for m in entry["measurements"]]
    assert all(s < 0.5 for s in window_seconds), window_seconds  # each window from its own start


def test_presets_print_before_and_after(tmp_path, text_cache, capsys, monkeypatch):
    argv = ["--name=reg", "--presets=20m,50m", "--warmup=1", "--steps=1", "--windows=1", "--data_mode=synthetic",
            "--vocab_size=512"]
    base = [a for a in TINY if not a.startswith("--preset=") and a not in SHAPE]  # presets fix the shapes
    for name, width in (("20m", 32), ("50m", 64)):  # two shapes of their own: nothing below needs the real sizes
        monkeypatch.setitem(model_lib.PRESETS, name, model_lib.get_preset(name, dim=width, n_layers=1, n_heads=2,
                                                                           hidden_dim=2 * width))
    resets, reset = [], bench.reset_peak_memory
    monkeypatch.setattr(bench, "reset_peak_memory", lambda device: resets.append(str(device)) or reset(device))
    assert run_bench(tmp_path, text_cache, *argv, base=base)[0] == 0
    assert resets == ["cpu", "cpu"]  # each preset's peak starts anew, before its model is built
    first = read_results(tmp_path / "results.json")["benchmarks"]
    assert set(first) == {"reg-20m", "reg-50m"}
    for name in ("20m", "50m"):
        preset = model_lib.Transformer(model_lib.get_preset(name, vocab_size=512, max_seq_len=64))
        assert first[f"reg-{name}"]["parameters"] == sum(p.numel() for p in preset.parameters())
    capsys.readouterr()
    assert run_bench(tmp_path, text_cache, *argv, base=base)[0] == 0
    table = capsys.readouterr().out
    before = f"{first['reg-20m']['tokens_per_second']:,.0f}"
    assert before in table  # the previous entry's figure is shown beside the new one
    history = read_results(tmp_path / "results.json")["history"]
    assert {tuple(h["path"]) for h in history} == {("benchmarks", "reg-20m"), ("benchmarks", "reg-50m")}


def test_shape_keys_beside_presets_are_refused(tmp_path, text_cache, capsys):
    """--presets=20m,50m --dim=... --n_heads=... timed each preset in its own shape and dropped the keys unsaid."""
    base = [a for a in TINY if not a.startswith("--preset=") and a not in SHAPE]
    code, results = run_bench(tmp_path, text_cache, "--name=p", "--presets=20m,50m", "--dim=128", "--n_heads=2",
                              base=base)
    assert code == 2 and not results
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "presets=20m,50m" in err[0] and "dim=128, n_heads=2 would be ignored" in err[0], err


def test_a_scaling_reference_with_one_process_is_refused(tmp_path, text_cache, capsys, monkeypatch):
    """Scaling efficiency is computed over several processes only: with one, the key was ignored unsaid."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, results = run_bench(tmp_path, text_cache, "--name=s", "--scaling_reference=one-gpu")
    assert code == 2 and not results
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scaling_reference=one-gpu" in err[0] and "torchrun" in err[0], err


@pytest.mark.parametrize("reference", [None, {"status": "error"}, {"tokens_per_second": 0},
                                       {"tokens_per_second": None}])
def test_a_scaling_reference_without_a_rate_is_refused_before_any_work(tmp_path, text_cache, capsys, monkeypatch,
                                                                       reference):
    """A misspelled or rateless reference gave scaling_efficiency null after the whole multi-GPU run; the refusal
    comes before any process group or model (so this runs on the CPU, with WORLD_SIZE alone set)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    results = tmp_path / "results.json"
    record(results, ["benchmarks", "one-gpu-typo" if reference is None else "one-gpu"], reference or {"status": "ok"})
    code, after = run_bench(tmp_path, text_cache, "--name=s", "--scaling_reference=one-gpu")
    assert code == 2 and "s" not in after["benchmarks"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scaling_reference=one-gpu is no entry under benchmarks" in err[0], err


@pytest.mark.parametrize("reference, extra, words", [
    ({"world_size": 2}, [], "ran 2 processes; give a one-GPU entry"),
    ({"world_size": 1, "config": {"preset": "20m", "seq_len": 32}}, [], "seq_len 32 against 64"),
    ({"world_size": 1}, ["--presets=20m,50m", "--dim=0", "--n_layers=0", "--n_heads=0", "--hidden_dim=0"],
     "presets=20m,50m measures several"),
])
def test_a_scaling_reference_of_several_processes_or_another_model_is_refused(tmp_path, text_cache, capsys,
                                                                                monkeypatch, reference, extra, words):
    """The efficiency divides this run's rate per process by the reference's: a two-process reference's total, or
    another model's rate, gave a wrong figure (0.596 for a two-process reference)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    record(tmp_path / "results.json", ["benchmarks", "ref"], dict(reference, tokens_per_second=1000.0))
    code, after = run_bench(tmp_path, text_cache, "--name=s", "--scaling_reference=ref", *extra)
    assert code == 2 and "s" not in after["benchmarks"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scaling_reference=ref" in err[0] and words in err[0], err


def test_a_key_that_fits_one_preset_but_not_the_next_is_refused_before_any_is_measured(tmp_path, text_cache, capsys):
    """value_embeddings=5 fits 50m's 10 blocks, not 20m's 8: 50m was measured and recorded, then the run failed at
    20m with a message that did not name it."""
    base = [k for k in TINY if not k.startswith(("--preset=", "--dim", "--n_layers", "--n_heads", "--hidden_dim"))]
    code, results = run_bench(tmp_path, text_cache, "--name=ve", "--presets=50m,20m", "--value_embeddings=5",
                              "--warmup=1", "--steps=1", "--windows=1", base=base)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not results.get("benchmarks")
    assert len(err) == 1 and err[0].startswith("error: preset 20m: value_embeddings 5 needs 2 x 5 blocks"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for runs on the CPU")
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_profile_is_refused_on_a_cpu(tmp_path, text_cache, capsys, device):
    """On a CPU the profile recorded the CPU operators' time as kernel_ms, beside GPU profiles of that name."""
    code, results = run_bench(tmp_path, text_cache, "--name=prof", "--profile=True", f"--device={device}")
    assert code == 2 and not results
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile" in err[0] and "on the CPU" in err[0] and "kernel_ms" in err[0], err


def test_a_profile_goes_to_its_own_section(tmp_path):
    """record_entry (the GPU's profiles, which the CPU cannot make) puts profiles.NAME beside benchmarks.NAME."""
    cfg = settings.Config(name="gpu-run", results_file=str(tmp_path / "r.json"))
    breakdown = profiling.kernel_breakdown([("nvjet_tst_128x64", 8, 3.0), ("cross_entropy_rows_kernel", 4, 2.0)])
    bench.record_entry(cfg, {"run_id": "r1", "status": "ok", "profile": dict(breakdown, device="cuda")})
    results = read_results(tmp_path / "r.json")
    assert results["profiles"]["gpu-run"]["run_id"] == "r1" and results["profiles"]["gpu-run"]["kernel_ms"] == 5.0
    assert results["benchmarks"]["gpu-run"]["status"] == "ok"


@pytest.mark.parametrize("name,category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_NTT", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("triton_red_fused__log_softmax__to_copy_nll_loss_forward_0", "cross_entropy"),
    ("cross_entropy_rows_kernel", "cross_entropy"),  # model.py's fused loss kernel
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused__fused_rms_norm_mean_pow_rsqrt_1", "norm"),
    ("triton_poi_fused_add_mul_silu_2", "elementwise"),
    ("swiglu_kernel", "elementwise"),  # model.py's fused SwiGLU
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
    ("aten::baddbmm", "matmul"),  # Newton-Schulz's batched matmuls in a CPU profile, not an "add"
    ("aten::_scaled_mm", "matmul"),  # the FP8 head's
    ("triton_tem_fused_addmm_1", "matmul"),  # Inductor's Triton matmul template, not an "add"
    ("triton_tem_fused__to_copy_mm_t_2", "matmul"),
    ("void cub::DeviceRadixSortSingleTileKernel<...>", "other"),  # "Single" holds no sine
    ("triton_poi_fused_cos_sin_3", "rotary"),
    # CuTe-DSL kernels (kernel_cutlass_kernel_<module><class>): quack's loss was filed under matmul for "cutlass"
    ("kernel_cutlass_kernel_quackcross_entropyCrossEntropy_object_at__tensorptrbf16", "cross_entropy"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__", "attention"),
    ("transpose_kernel", "elementwise"),  # the FP8 head's
])
def test_kernel_categories(name, category):
    assert profiling.categorize(name) == category


def test_gpu_profiles_count_kernels_not_the_ranges_around_them():
    """The optimizer's record_function range appears on the GPU timeline beside the kernels it spans."""
    from types import SimpleNamespace as Event
    kernel = Event(key="multi_tensor_apply_kernel", device_type="DeviceType.CUDA", self_device_time_total=200.0,
                   is_user_annotation=False)
    step_range = Event(key="Optimizer.step#AdamW.step", device_type="DeviceType.CUDA",
                       self_device_time_total=270.0, is_user_annotation=True)
    host_op = Event(key="aten::mm", device_type="DeviceType.CPU", self_device_time_total=0.0,
                    is_user_annotation=False)
    assert [profiling.gpu_kernel_ms(e) for e in (kernel, step_range, host_op)] == [0.2, 0, 0]


def test_kernel_breakdown_totals_and_slowest_kernels():
    kernels = [("nvjet_tst_128x64", 8, 3.0), ("triton_poi_fused_add_mul_silu_2", 40, 1.5),
               ("cross_entropy_rows_kernel", 4, 2.0), ("x" * 300, 1, 0.5)]
    breakdown = profiling.kernel_breakdown(kernels, top=3)
    assert breakdown["kernel_ms"] == pytest.approx(7.0) and breakdown["kernel_count"] == 53
    assert breakdown["kernel_ms_by_category"]["matmul"] == 3.0
    assert breakdown["kernel_ms_by_category"]["other"] == 0.5
    assert [k["name"] for k in breakdown["top_kernels"]] == [
        "nvjet_tst_128x64", "cross_entropy_rows_kernel", "triton_poi_fused_add_mul_silu_2"]
    assert breakdown["top_kernels"][1] == {"name": "cross_entropy_rows_kernel", "category": "cross_entropy",
                                           "count": 4, "ms": 2.0}


def test_mfu_peak_table():
    assert env.peak_flops("NVIDIA H200") == 989e12
    assert env.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert env.peak_flops("Some Future GPU") is None


def test_bench_output_holds_no_profiler_line(tmp_path, text_cache):
    """Every bench run profiles an update (for its attention kernels), and libkineto wrote its own lines to stderr
    ("USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start" on this CPU torch, "STAGE:... Completed Stage"
    and CUPTI's on a GPU) into bench's output and so into tune.py's candidates', which run bench.py as a process and
    read it: that process's whole output is checked here."""
    import subprocess
    import sys
    from tests.test_train import REPO
    argv = TINY + ["--windows=1", f"--data_dir={text_cache}", f"--results_file={tmp_path / 'r.json'}", "--name=quiet"]
    proc = subprocess.run([sys.executable, str(REPO / "bench.py"), *argv], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_results(tmp_path / "r.json")["benchmarks"]["quiet"]["attention_kernels"]  # the profile ran
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines and not [line for line in lines if profiling.is_profiler_line(line)], lines


def test_a_quiet_profile_passes_the_profiled_works_own_stderr_on(capfd):
    import sys
    import warnings
    from torch.profiler import ProfilerActivity
    assert profiling.is_profiler_line("STAGE:2026-12-02 13:32:10 22990:22990 SyncActivityProfilerHandler.cpp:51] "
                                      "Completed Stage: Warm Up")
    assert profiling.is_profiler_line("WARNING: CUPTI initialization failed") and not profiling.is_profiler_line(
        "bench: window 1/3: 1,234 tokens/s")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # CUDA on a CPU: torch.profiler warns that it is not available
        with profiling.quiet_profile([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            torch.ones(8) @ torch.ones(8)
            print("the work's own line", file=sys.stderr)
            warnings.warn("the work's own warning")
            # torch.profiler's own Python warning, as torch 2.11 gives it on an H200
            exec("import warnings; warnings.warn('Profiler clears events at the end of each cycle.')",
                 {"__name__": "torch.profiler.profiler"})
    assert prof.key_averages()
    assert [str(w.message) for w in caught] == ["the work's own warning"]
    err = capfd.readouterr().err
    assert "the work's own line" in err and "profiler_start" not in err, err



class CompiledLinear:
    """A stand-in trainer whose update runs a compiled linear layer of its own width (a preset's model)."""
    device = torch.device("cpu")

    def __init__(self, width):
        self.layer, self.x = torch.compile(torch.nn.Linear(width, width)), torch.randn(2, width)

    def update(self):
        with torch.no_grad():
            out = self.layer(self.x).sum()
        return out, out

    def compile_cache_due(self):
        return False


def test_each_runs_first_update_records_its_own_compile_not_an_earlier_runs():
    """bench.py's presets run in one process, whose compile counters and timers torch never resets (not even
    torch._dynamo.reset): each entry's first_update_graphs and compile seconds are its own first update's."""
    cfg = settings.Config(name="presets", compile=True, warmup=1, windows=1, steps=1, tokens_per_update=4)
    torch._dynamo.reset()
    entries = [{}, {}]
    for width, entry in zip((8, 16), entries):
        bench.timed_windows(cfg, CompiledLinear(width), iter(tuple, None), entry, 1)
    for entry in entries:
        graphs = entry["first_update_graphs"]
        assert graphs["compiled"] + graphs["from_cache"] == 1, graphs  # its one graph, not the two made so far
        assert 0 < entry["first_update_compile_seconds"]["compile_total"] < entry["first_update_seconds"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the CPU's peak resets through Linux's /proc")
def test_the_cpu_peak_starts_anew():
    """On the CPU the peak is the process's RSS high-water mark, which getrusage never resets: a preset timed after a
    larger one in the same process recorded the larger's peak. Each run now starts the mark anew (bench.py's
    presets: test_presets_print_before_and_after)."""
    import re
    big = torch.ones(64 * 2**20)  # 256 MiB, touched: the mark is at least that much above what is freed after
    del big
    trainer_lib.reset_peak_memory("cpu")
    in_use = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    assert trainer_lib.peak_memory_bytes("cpu") <= in_use + 32 * 2**20  # the mark starts at the memory in use now


def test_a_loaded_compile_cache_is_not_recorded_as_a_cold_start(tmp_path, text_cache, monkeypatch):
    """--cold=True with a --compile_cache that loads: the new folders were empty, but the file filled them before
    the first update, which the entry called cold."""
    from_plan = bench.Trainer.from_plan

    def loaded(*args, **kwargs):
        trainer = from_plan(*args, **kwargs)
        trainer.compile_cache_loaded = True  # as Trainer.load_compile_cache sets it when the file's key matched
        return trainer
    monkeypatch.setattr(bench.Trainer, "from_plan", loaded)
    monkeypatch.setattr(bench.env, "compiler_cache_state", lambda fresh=False: ({}, True))
    code, results = run_bench(tmp_path, text_cache, "--name=loaded", "--warmup=1", "--steps=1", "--windows=1")
    assert code == 0 and results["benchmarks"]["loaded"]["cache_was_cold"] is False


def test_a_subset_smaller_than_one_update_names_the_keys_and_the_smallest_subset(tmp_path, text_cache, capsys):
    code, _ = run_bench(tmp_path, text_cache, "--name=small", "--train_subset_tokens=1000")
    err = capsys.readouterr().err.strip().splitlines()
    # 512 tokens an update are 8 sequences of 64: 1,000 tokens hold 15 sequences, so this one fits...
    assert code == 0, err
    code, _ = run_bench(tmp_path, text_cache, "--name=small", "--train_subset_tokens=300")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err  # ...and 300 hold 4: at least 8 x 64 + 1 = 513
    assert "train_subset_tokens 300 holds 4 sequences of 64" in err[0] and "give at least 513 tokens" in err[0], err
    # the whole cache less than one update: no subset can help (it said "give at least ... tokens, or 0")
    code, _ = run_bench(tmp_path, text_cache, "--name=small", "--train_subset_tokens=0", "--tokens_per_update=4194304")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: the whole cache holds"), err
    assert "training tokens: give a smaller tokens_per_update" in err[0] and "give at least" not in err[0], err


def test_more_threads_than_cores_are_warned_of_as_train_py_warns(tmp_path, text_cache, capsys, monkeypatch):
    """bench.py, which times the threads (and tune.py's cpu_threads screens through it), said nothing."""
    monkeypatch.setattr(bench.settings.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(bench.settings.os, "cpu_count", lambda: 1)
    code, _ = run_bench(tmp_path, text_cache, "--name=threads", "--cpu_threads=2", "--warmup=1", "--steps=1",
                        "--windows=1")
    out = capsys.readouterr().out
    assert code == 0 and "warning: cpu_threads 2 is more than the 1 cores this process may use" in out, out
