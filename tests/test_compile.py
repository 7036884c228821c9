"""How a run compiles (#39): each compile scope's gradients, the saved compile cache's key, the kernels a child
compiles."""
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time

import pytest
import torch

import compile_cache
import env
import model as model_lib
import plan
import settings
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def own_driver_jit_cache(tmp_path, monkeypatch):
    """The CUDA driver's JIT cache folder of each test, unmade: a compile cache saved or loaded here never carries or
    fills the user's ~/.nv/ComputeCache."""
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "driver-jit"))
    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)


def first_update_gradients(cfg):
    """(loss, each parameter's gradient) of a tiny model's first update under cfg, on the CPU (through Inductor when
    cfg compiles): the gradients as the optimizer step would have read them."""
    from tests.test_train import make_trainer, train_data
    torch._dynamo.reset()
    trainer = make_trainer(cfg)
    batches, n_tokens = train_data(cfg).micro_batches(0, 0, cfg.micro_batch_size)
    grads = []
    trainer.optimizer_step = lambda: grads.extend(p.grad.clone() for p in trainer.raw_model.parameters()) or \
        torch.zeros(())
    loss, _ = trainer.update(batches, n_tokens)
    return loss.item(), grads


@pytest.mark.parametrize("scope", settings.COMPILE_SCOPES)
def test_every_compile_scope_makes_eagers_gradients_through_inductor(text_cache, tmp_path, scope):
    """The compiled update's loss and every gradient are eager's, through Inductor's code (aot_eager is not enough:
    compile_scope=shared, the blocks as one nested compile region, traced right, but under Inductor, on this CPU's
    torch 2.13, every gradient but the last block's came out 40 to 4,600 times off, right with Inductor's
    allow_buffer_reuse off; it was removed, its code in 02b3b11)."""
    from tests.test_train import small_config
    cfg = small_config(text_cache, tmp_path, micro_batch_size=8, n_layers=3)
    eager_loss, eager = first_update_gradients(settings.Config(cfg, compile=False))
    mark = env.compile_totals()
    loss, compiled = first_update_gradients(settings.Config(cfg, compile=True, compile_scope=scope))
    graphs, phases = env.compiled_since(mark)  # this compile's, not the suite's earlier ones
    assert graphs["compiled"] + graphs["from_cache"] > 0  # Inductor made the code (compiled it, or took it cached)
    assert phases["dynamo_tracing"] > 0 and phases["aot_autograd"] > 0 and min(phases.values()) >= 0
    assert sum(v for k, v in phases.items() if k != "compile_total") == pytest.approx(phases["compile_total"])
    assert env.compiled_since(env.compile_totals())[1]["compile_total"] == 0  # nothing since: nothing spent
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for g, e in zip(compiled, eager):
        assert ((g - e).norm() / e.norm()).item() < 1e-4


def test_blocks_compiles_the_blocks_code_once_for_every_block(text_cache, tmp_path):
    """compile_scope=blocks: one Dynamo compile of a block's code serves all of them, and one of the loss head: two
    frames for a model of three blocks."""
    from torch._dynamo.utils import counters
    from tests.test_train import small_config
    cfg = small_config(text_cache, tmp_path, micro_batch_size=8, n_layers=3)
    counters.clear()
    first_update_gradients(settings.Config(cfg, compile=True, compile_scope="blocks"))
    assert counters["frames"]["ok"] == 2


@pytest.fixture
def static_launch_unset(monkeypatch):
    """torch's static launch of user-defined kernels off, and its variable unset, as a test found them (torch's own
    patch: the setting is not a plain module attribute)."""
    import torch._inductor.config as inductor_config
    from model_kernels import swiglu
    monkeypatch.delenv(swiglu.STATIC_LAUNCH_ENV, raising=False)
    with inductor_config.patch(static_launch_user_defined_triton_kernels=False):
        yield inductor_config


@pytest.mark.parametrize("compiled,static", [(False, True), (True, False), (True, True)])
def test_static_launch_of_the_swiglu_kernel_is_set_by_a_compiled_run_that_asks(text_cache, tmp_path,
                                                                                static_launch_unset, compiled, static):
    """static_launch_user_kernels (on by default): the compiled trainer sets torch's setting in this process and its
    variable for Inductor's compile workers; a run that turns it off, or an eager one, touches neither."""
    from model_kernels import swiglu
    from tests.test_train import make_trainer, small_config
    inductor_config = static_launch_unset
    for scope in settings.COMPILE_SCOPES:
        make_trainer(small_config(text_cache, tmp_path, compile=compiled, compile_scope=scope,
                                  static_launch_user_kernels=static))
        asked = compiled and static
        assert inductor_config.static_launch_user_defined_triton_kernels is asked
        assert os.environ.get(swiglu.STATIC_LAUNCH_ENV) == ("1" if asked else None)


# ---------------------------------------------------------------- the update captured whole (trainer.CapturedUpdate)

def rerun_capture(captures):
    """A stand-in for cuda_graph_capture on the CPU: the capture records nothing and runs nothing (as a CUDA
    capture runs no kernel); each replay runs the captured step again on the graph's input tensors and writes its
    outputs into the tensors the capture returned, as a replay writes the graph's own."""
    def capture(step):
        captures.append(1)
        outputs = (torch.zeros(()), torch.zeros(()))

        def replay():
            for out, value in zip(outputs, step()):
                out.copy_(value)
        return replay, outputs
    return capture


def halved(micro_batches):
    """The same tokens as rows half as long (a context schedule's windows): another shape."""
    return [tuple(t.reshape(t.shape[0] * 2, t.shape[1] // 2) for t in batch) for batch in micro_batches]


@pytest.mark.parametrize("recipe", [{}, {"optimizer": "muon", "ema": 0.9}])
def test_a_captured_update_is_the_plain_updates_arithmetic_and_each_shape_runs_once_before_its_capture(
        text_cache, tmp_path, monkeypatch, recipe):
    """Updates 1 (uncaptured: it compiles), 2 (captured, then replayed), 3 (replayed), a new shape's first
    (uncaptured), its second (captured again) and third: the losses, gradient norms and weights of the trainer's plain
    update, bit for bit, with the batch, the scale and the learning rates read at each replay, not at the capture.
    Several micro-steps, so the gradients are made and add up inside the graph; none kept outside it."""
    import trainer as trainer_lib
    from tests.test_train import make_trainer, small_config, train_data
    cfg = small_config(text_cache, tmp_path, micro_batch_size=2, compile_scope="blocks", **recipe)
    monkeypatch.setattr(trainer_lib, "captures_update", lambda cfg, device, world_size: True)
    captures = []
    monkeypatch.setattr(trainer_lib, "cuda_graph_capture", rerun_capture(captures))
    plain, captured = make_trainer(cfg), make_trainer(cfg)
    assert captured.captured is not None and not captured.stable_grads
    assert all(p.grad is None for p in captured.raw_model.parameters())  # made by each update's first backward
    assert all(torch.is_tensor(g["lr"]) for g in captured.optimizer.param_groups)  # set_lr fills them
    plain.captured = None  # the same optimizer and gradients, the update run step by step
    data = train_data(cfg)
    outputs, captures_after = {"plain": [], "captured": []}, []
    for u in range(6):
        batches, n_tokens = data.micro_batches(u, 0, cfg.micro_batch_size)  # each epoch's first: full updates
        assert len(batches) > 1
        batches = halved(batches) if u >= 3 else batches
        for name, trainer in (("plain", plain), ("captured", captured)):
            outputs[name].append(trainer.update(batches, n_tokens))
        captures_after.append(len(captures))
        if u == 3:  # the last shape's graph (and its memory) gone before the new shape ran
            assert captured.captured.graph is None
    assert captures_after == [0, 1, 1, 1, 2, 2]  # one capture a shape, at its second update
    for (loss, norm), (loss_c, norm_c) in zip(outputs["plain"], outputs["captured"]):
        assert torch.equal(loss, loss_c) and torch.equal(norm, norm_c)
    assert len({o[0].item() for o in outputs["captured"]}) == 6  # each update's own, not a later replay's
    for p, q in zip(plain.raw_model.parameters(), captured.raw_model.parameters()):
        assert torch.equal(p, q) and q.grad is None  # let go at the step's end, as the plain update's
    if captured.ema is not None:  # the weights' average, updated inside the graph
        assert all(torch.equal(a, b) for a, b in zip(plain.ema.accumulator, captured.ema.accumulator))


def test_only_blocks_with_cuda_graphs_on_one_gpu_captures_the_update_and_its_regions_make_no_cuda_graphs():
    import optim
    import trainer as trainer_lib
    cfg = lambda **c: settings.Config(dict(compile=True, compile_scope="blocks", compile_mode="reduce-overhead"), **c)
    assert trainer_lib.captures_update(cfg(), "cuda", 1)
    assert not trainer_lib.captures_update(cfg(), "cuda", 2)  # DDP: each region keeps torch's CUDA graphs
    assert not trainer_lib.captures_update(cfg(), "cpu", 1)
    assert not trainer_lib.captures_update(cfg(compile_scope="model"), "cuda", 1)
    assert not trainer_lib.captures_update(cfg(compile_mode="default"), "cuda", 1)
    assert not trainer_lib.captures_update(cfg(compile=False), "cuda", 1)
    assert trainer_lib.compile_mode(cfg(), captured=True) is None
    assert trainer_lib.compile_mode(cfg(compile_mode="max-autotune"), True) == "max-autotune-no-cudagraphs"
    assert trainer_lib.compile_mode(cfg()) == "reduce-overhead"
    # the default run's fused AdamW, capturable: torch refuses to capture a step without it
    assert optim.adamw_kernels(False, "cuda", captured=True) == dict(fused=True, capturable=True)
    assert optim.adamw_kernels(False, "cuda") == dict(fused=True)
    # Muon's per-shape math compiled with the model, but eager inside the captured update: no compile per shape
    from tests.test_optim import SETTINGS, tiny_model
    muon = dict(SETTINGS, optimizer="muon", compile=True)
    assert optim.build_optimizer(tiny_model(), muon, "cpu").muon.compile
    assert not optim.build_optimizer(tiny_model(), muon, "cpu", captured=True).muon.compile


# ---------------------------------------------------------------- the saved compile cache

COMPILE_ONCE = """
import importlib.util, sys, torch
sys.path.insert(0, {repo!r})
import compile_cache
spec = importlib.util.spec_from_file_location("profile", {repo!r} + "/scripts/cold_start_profile.py")
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)  # its cache_counters(): what the caches gave, as the profile records it
if sys.argv[1] == "load":
    print(compile_cache.load(sys.argv[2], "cpu")[1])
torch.compile(lambda x: x @ x, dynamic=False)(torch.randn(8, 8))  # a matmul: no C++ kernel to build
if sys.argv[1] == "save":
    print(compile_cache.save(sys.argv[2], "cpu"))
print("caches", profile.cache_counters())
print("kernel", (compile_cache.kernel_folder() / "fwd" / "k.o").read_text())
"""


def compile_in_a_fresh_process(tmp_path, mode, path):
    """A process of its own (this one's compiler settings are the earlier tests'), with empty Inductor and Triton
    caches and an empty flash-attn-4 kernel folder beside a stand-in kernel when saving, as on a fresh machine."""
    fresh = tmp_path / mode
    (fresh / "kernels" / "fwd").mkdir(parents=True)
    if mode == "save":
        (fresh / "kernels" / "fwd" / "k.o").write_text("compiled")
    environ = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(fresh / "inductor"), TRITON_CACHE_DIR=str(fresh / "t"),
                   TORCHINDUCTOR_COMPILE_THREADS="1",  # no pool of compile workers to start for one kernel
                   FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(fresh / "kernels"))
    out = subprocess.run([sys.executable, "-c", COMPILE_ONCE.format(repo=str(REPO)), mode, str(path)], env=environ,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_a_saved_cache_makes_a_fresh_process_start_warm_and_another_key_is_ignored(tmp_path):
    """Inductor's code and flash-attn-4's kernel folder travel in the file."""
    path = tmp_path / "run.compile"
    out = compile_in_a_fresh_process(tmp_path, "save", path)
    assert "saved" in out and "'inductor': {'fxgraph_cache_miss': 1}" in out
    out = compile_in_a_fresh_process(tmp_path, "load", path)
    # Inductor's graph came from the file, not from code generation
    assert "loaded" in out and "'inductor': {'fxgraph_cache_hit': 1}" in out
    assert "kernel compiled" in out
    # the same file as if another torch made it: ignored with a line naming what differs, nothing loaded
    header, _, artefacts = path.read_bytes()[len(compile_cache.MAGIC):].partition(b"\n")
    path.write_bytes(compile_cache.MAGIC + json.dumps(dict(json.loads(header), torch="0.0.0")).encode() + b"\n"
                     + artefacts)
    loaded, line = compile_cache.load(path, "cpu")
    assert not loaded and "ignored" in line and f"torch: 0.0.0 (here {torch.__version__})" in line


def test_tritons_own_entries_of_our_kernels_travel_and_triton_finds_them_in_another_folder(tmp_path, monkeypatch):
    """The fused loss's rows kernel runs inside a custom op, so Triton, not Inductor, compiles and caches it: the file
    carries its entry and Triton's compiled C helpers (not Inductor's kernels, which torch's artefacts hold), and on a
    machine whose Triton cache is elsewhere, Triton's own lookup finds them (its group files name absolute paths)."""
    from triton.runtime.cache import FileCacheManager

    def compiled(key, files):
        """An entry as Triton's compile leaves one: its files, then the group file naming them."""
        cache = FileCacheManager(key)
        paths = {name: cache.put(data, name) for name, data in files.items()}
        cache.put_group(next(iter(files)), paths)
        return cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "there"))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    launcher = "__triton_launcher.cpython-312-x86_64-linux-gnu.so"
    compiled("a1", {"cross_entropy_rows_kernel.json": "{}", "cross_entropy_rows_kernel.cubin": b"rows"})
    compiled("b2", {launcher: b"launcher"})
    compiled("c3", {"triton_poi_fused_add_0.json": "{}", "triton_poi_fused_add_0.cubin": b"inductor's"})
    damaged = FileCacheManager("d4")  # a group file cut short: Triton ignores it, and so does the unpacking
    damaged.put(b"rows", "cross_entropy_rows_kernel.cubin")
    damaged.put('{"child_paths": {', "__grp__cross_entropy_rows_kernel.json", binary=False)
    data = compile_cache.kernel_files()

    here = tmp_path / "here"
    (here / "b2").mkdir(parents=True)
    (here / "b2" / launcher).write_bytes(b"already here")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(here))
    compile_cache.unpack_kernel_files(data)
    assert sorted(p.name for p in here.iterdir()) == ["a1", "b2", "d4"]  # not Inductor's kernel
    group = FileCacheManager("a1").get_group("cross_entropy_rows_kernel.json")
    assert group == {name: str(here / "a1" / name) for name in group} and len(group) == 2
    assert (here / "a1" / "cross_entropy_rows_kernel.cubin").read_bytes() == b"rows"
    assert sorted(p.name for p in (here / "b2").iterdir()) == [launcher]  # an entry already there is kept
    assert (here / "b2" / launcher).read_bytes() == b"already here"


def test_a_flash_attn_4_kernel_file_already_there_is_kept_and_the_missing_ones_are_added(tmp_path, monkeypatch):
    """A loaded cache fills flash-attn-4's folder file by file: a kernel already there (written by flash-attn-4
    itself, maybe being read by another run) is not replaced; those it lacks are put beside it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "fa4-there"))
    for name, data in (("fwd/k.o", b"saved fwd"), ("bwd/k.o", b"saved bwd")):
        (tmp_path / "fa4-there" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fa4-there" / name).write_bytes(data)
    data = compile_cache.kernel_files()
    here = tmp_path / "fa4-here"
    (here / "fwd").mkdir(parents=True)
    (here / "fwd" / "k.o").write_bytes(b"compiled here")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(here))
    compile_cache.unpack_kernel_files(data)
    assert (here / "fwd" / "k.o").read_bytes() == b"compiled here"
    assert (here / "bwd" / "k.o").read_bytes() == b"saved bwd"


@pytest.mark.parametrize("killed_in", ["triton", "flash-attn-4"])
def test_an_unpacking_killed_midway_leaves_no_kernel_file_under_its_name_and_the_next_load_puts_it_whole(
        tmp_path, monkeypatch, killed_in):
    """A kernel cut short beside its complete group file would be loaded by Triton (or flash-attn-4) as whole: each
    Triton entry and each flash-attn-4 file appears whole or not at all, and a later load completes the cache."""
    from triton.runtime.cache import FileCacheManager
    big = b"rows" * (1 << 18)  # the kernel being written when the process dies
    kernels = {"triton": b"rows", "flash-attn-4": b"fwd", killed_in: big}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "there"))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "fa4-there"))
    rows = FileCacheManager("a1")
    rows.put_group("cross_entropy_rows_kernel.json", {"cross_entropy_rows_kernel.cubin": rows.put(
        kernels["triton"], "cross_entropy_rows_kernel.cubin")})
    (tmp_path / "fa4-there" / "print" / "fwd").mkdir(parents=True)
    (tmp_path / "fa4-there" / "print" / "fwd" / "k.o").write_bytes(kernels["flash-attn-4"])
    data = compile_cache.kernel_files()

    here = {"triton": tmp_path / "here", "flash-attn-4": tmp_path / "fa4-here"}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(here["triton"]))
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(here["flash-attn-4"]))
    copy = tarfile.copyfileobj

    def killed(src, dst, length=None, *args, **kwargs):
        if length == len(big):
            dst.write(src.read(length // 2))
            raise KeyboardInterrupt
        return copy(src, dst, length, *args, **kwargs)

    monkeypatch.setattr(tarfile, "copyfileobj", killed)
    with pytest.raises(KeyboardInterrupt):
        compile_cache.unpack_kernel_files(data)
    final = {"triton": here["triton"] / "a1", "flash-attn-4": here["flash-attn-4"] / "print" / "fwd" / "k.o"}
    assert not final[killed_in].exists()  # in a temporary folder beside it, which nothing reads
    monkeypatch.setattr(tarfile, "copyfileobj", copy)
    compile_cache.unpack_kernel_files(data)  # the next run loads the same file
    assert (here["triton"] / "a1" / "cross_entropy_rows_kernel.cubin").read_bytes() == kernels["triton"]
    assert FileCacheManager("a1").get_group("cross_entropy_rows_kernel.json") == {
        "cross_entropy_rows_kernel.cubin": str(here["triton"] / "a1" / "cross_entropy_rows_kernel.cubin")}
    assert (here["flash-attn-4"] / "print" / "fwd" / "k.o").read_bytes() == kernels["flash-attn-4"]


def fill_driver_jit_cache(folder, files):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


@pytest.mark.parametrize("there", ["absent", "empty"])
def test_the_drivers_jit_cache_is_carried_and_put_whole_where_the_machine_has_none(tmp_path, monkeypatch, there):
    """cuDNN's attention forward is PTX that the driver compiles into its JIT cache at the first call: a loaded cache
    on a fresh machine (no folder, or an empty one) gets the saved folder, its index with its entries, as it was."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    saved = {"index": b"the driver's index", "a1/b2c3": b"sm_90 code", "a1/d4e5": b"more"}
    fill_driver_jit_cache(tmp_path / "driver-jit", saved)
    data = compile_cache.kernel_files()
    here = tmp_path / "fresh-machine" / "ComputeCache"
    if there == "empty":
        here.mkdir(parents=True)
    monkeypatch.setenv("CUDA_CACHE_PATH", str(here))
    compile_cache.unpack_kernel_files(data)
    got = {str(f.relative_to(here)): f.read_bytes() for f in here.rglob("*") if f.is_file()}
    assert got == saved
    assert [p.name for p in here.parent.iterdir()] == ["ComputeCache"]  # no staging folder left beside it


def test_a_machines_own_driver_jit_cache_is_never_merged_into(tmp_path, monkeypatch):
    """A folder that holds any file is the machine's: its index names its own entries, so nothing is added to it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    fill_driver_jit_cache(tmp_path / "driver-jit", {"index": b"saved index", "a1/b2": b"saved"})
    data = compile_cache.kernel_files()
    here = tmp_path / "machine"
    fill_driver_jit_cache(here, {"index": b"its own index"})
    monkeypatch.setenv("CUDA_CACHE_PATH", str(here))
    compile_cache.unpack_kernel_files(data)
    assert [str(f.relative_to(here)) for f in here.rglob("*")] == ["index"]
    assert (here / "index").read_bytes() == b"its own index"


def test_the_drivers_jit_cache_is_not_carried_when_disabled_or_over_its_limit(tmp_path, monkeypatch):
    """CUDA_CACHE_DISABLE=1 keeps no cache, so none is carried or put in place; a folder over JIT_MAX_BYTES (other
    programs' entries) stays out of the file."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    fill_driver_jit_cache(tmp_path / "driver-jit", {"index": b"i", "a1/b2": b"x" * 100})
    names = lambda data: tarfile.open(fileobj=io.BytesIO(data)).getnames() if data else []
    assert "cuda-jit/a1/b2" in names(compile_cache.kernel_files())
    monkeypatch.setattr(compile_cache, "JIT_MAX_BYTES", 100)
    assert names(compile_cache.kernel_files()) == []  # 101 bytes
    monkeypatch.setattr(compile_cache, "JIT_MAX_BYTES", 101)
    data = compile_cache.kernel_files()
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    assert compile_cache.kernel_files() == b""
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "elsewhere"))
    compile_cache.unpack_kernel_files(data)
    assert not (tmp_path / "elsewhere").exists()


def test_the_key_follows_the_code(tmp_path, monkeypatch):
    before = compile_cache.key("cpu")
    monkeypatch.setattr(compile_cache.env, "source_hash", lambda: "edited")
    assert compile_cache.differences(before, compile_cache.key("cpu")) == [f"code: {before['code']} (here edited)"]


@pytest.mark.parametrize("field, change", [
    ("python", lambda mp: mp.setattr(compile_cache.platform, "python_version", lambda: "3.0.1")),  # Triton's .so
    ("cuda", lambda mp: mp.setattr(compile_cache.torch.version, "cuda", "10.0")),
    ("device", lambda mp: mp.setattr(compile_cache.platform, "machine", lambda: "another-cpu"))])
def test_the_key_follows_python_cuda_and_the_device(monkeypatch, field, change):
    before = compile_cache.key("cpu")
    change(monkeypatch)
    after = compile_cache.key("cpu")
    assert compile_cache.differences(before, after) == [f"{field}: {before[field]} (here {after[field]})"]
    older = {k: v for k, v in after.items() if k != field}  # a file written before the field joined the key
    assert compile_cache.differences(older, after) == [f"{field}: None (here {after[field]})"]


def test_a_path_that_is_not_a_compile_cache_is_refused_and_kept(tmp_path):
    mine = tmp_path / "model.pt"
    mine.write_bytes(b"a user's file")
    with pytest.raises(compile_cache.CompileCacheError, match="is not a compile cache"):
        compile_cache.save(mine, "cpu")
    assert mine.read_bytes() == b"a user's file"


@pytest.mark.parametrize("kind", ["empty file", "folder"])
def test_an_empty_file_or_a_folder_as_the_cache_is_refused_and_kept(tmp_path, monkeypatch, kind):
    """Neither is a compile cache this project wrote (it writes the whole file at once): refused before the run
    (one line), and never loaded, written over or replaced."""
    monkeypatch.setattr(compile_cache.torch.compiler, "save_cache_artifacts", lambda: (b"t" * 1000, None))
    monkeypatch.setattr(compile_cache, "kernel_files", lambda: b"")
    path = tmp_path / "run.compile"
    if kind == "folder":
        path.mkdir()
        (path / "notes.txt").write_text("a user's file")
    else:
        path.touch()
    words = re.escape(f"compile_cache {path} exists and is not a compile cache this project wrote")
    for call in (lambda: compile_cache.load(path, "cpu"), lambda: compile_cache.save(path, "cpu")):
        with pytest.raises(compile_cache.CompileCacheError, match=words):
            call()
    with pytest.raises(plan.ConfigError, match=words):
        plan.check_compile_cache(settings.Config(compile_cache=str(path)))
    if kind == "folder":
        assert [p.name for p in path.iterdir()] == ["notes.txt"] and (path / "notes.txt").read_text() == "a user's file"
    else:
        assert path.is_file() and path.read_bytes() == b""


def test_a_compile_cache_in_a_folder_this_user_cannot_write_is_refused_in_one_line(tmp_path, monkeypatch):
    """The file is written after the first update, so a folder the user cannot write is refused before any work; the
    probe writes in the nearest folder that exists (the cache's own folders are made only at the save). The tests
    run as root, who can write anywhere: the probe's write fails here by hand."""
    probed = []

    def unwritable(*args, dir=None, **kwargs):
        probed.append(dir)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(plan.tempfile, "TemporaryFile", unwritable)
    path = tmp_path / "new" / "sub" / "c.bin"
    with pytest.raises(plan.ConfigError, match=re.escape(f"compile_cache {path} cannot be written there (Permission "
                                                         f"denied); give a path in a folder this user can write")):
        plan.check_compile_cache(settings.Config(compile_cache=str(path)))
    assert probed == [tmp_path] and not (tmp_path / "new").exists()


def test_a_cache_cut_short_or_with_a_header_not_its_own_is_not_loaded(tmp_path, monkeypatch):
    """A copy to another node interrupted: the kernels' archive cut short raised tarfile's ReadError in every later
    run, the torch part cut short loaded nothing and said it had loaded; now the run compiles and writes it again.
    A header cut short or that is JSON but not the key's object is compiled afresh too, not a traceback."""
    monkeypatch.setattr(compile_cache.torch.compiler, "save_cache_artifacts", lambda: (b"t" * 1000, None))
    monkeypatch.setattr(compile_cache, "kernel_files", lambda: b"k" * 500)
    loaded = []
    monkeypatch.setattr(compile_cache.torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))
    path = tmp_path / "run.compile"
    compile_cache.save(path, "cpu")
    whole = path.read_bytes()
    for cut in (300, 800):  # into the kernels' archive, into torch's part
        path.write_bytes(whole[:-cut])
        ok, line = compile_cache.load(path, "cpu")
        assert not ok and f"is damaged ({1500 - cut:,} bytes of the 1,500 written; an interrupted copy?)" in line
    assert loaded == []
    monkeypatch.setattr(compile_cache, "unpack_kernel_files", lambda data: None)
    path.write_bytes(whole)
    assert compile_cache.load(path, "cpu")[0] and loaded == [b"t" * 1000]
    for header in (b"[1]\n", b'{"format": 2, "dev'):  # JSON but not the key's object; a copy cut inside the header
        path.write_bytes(compile_cache.MAGIC + header + b"t" * 10 * (header == b"[1]\n"))
        ok, line = compile_cache.load(path, "cpu")
        assert not ok and "is damaged (its header does not read); compiling, and it is written again" in line
    assert loaded == [b"t" * 1000]


def test_the_cache_is_written_after_the_first_update_and_again_only_when_graphs_were_compiled(tmp_path, monkeypatch,
                                                                                              capsys):
    """A warm start that compiles nothing writes nothing; a schedule's new shape, compiled later, is saved too."""
    import trainer as trainer_lib
    compiled, saved = [0], []
    monkeypatch.setattr(trainer_lib.env, "inductor_graph_counts", lambda: {"compiled": compiled[0], "from_cache": 0})
    monkeypatch.setattr(trainer_lib.compile_cache, "save", lambda path, device: saved.append(compiled[0]))

    def run(loaded, graphs_after_each_update):
        """The file saves of a process that found (loaded) a matching file or none, then ran these updates."""
        monkeypatch.setattr(trainer_lib.compile_cache, "load", lambda path, device: (loaded, "line"))
        compiled[0], saved[:] = 0, []
        trainer = type("Trainer", (), {"device": "cpu"})()
        trainer.compile_cache = trainer_lib.Trainer.load_compile_cache(trainer, tmp_path / "run.compile")
        assert trainer.compile_cache_loaded is loaded  # what bench.py records as no cold start
        for graphs in graphs_after_each_update:
            compiled[0] = graphs
            if trainer_lib.Trainer.compile_cache_due(trainer):
                trainer_lib.Trainer.save_compile_cache(trainer)
        return saved

    assert run(False, [2, 2, 3, 3]) == [2, 3]  # cold: after the first update, and after the new shape's
    assert run(True, [0, 0]) == []  # warm: nothing compiled, nothing written
    assert run(True, [0, 1]) == [1]  # warm, then a shape the file did not hold

    def full(path, device):
        saved.append("tried")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(trainer_lib.compile_cache, "save", full)  # a failed write: one line, no more tries
    assert run(False, [2, 3]) == ["tried"] and "not saved (No space left on device); the run goes on" in \
        capsys.readouterr().out

    def refused(path, device):  # torch's own failure to gather the artefacts failed the run after its first update
        saved.append("tried")
        raise RuntimeError("could not serialize the artifacts")
    monkeypatch.setattr(trainer_lib.compile_cache, "save", refused)
    assert run(False, [2, 3]) == ["tried"] and "not saved (could not serialize the artifacts); the run goes on" in \
        capsys.readouterr().out


def test_writing_the_compile_cache_is_out_of_the_training_clock(text_cache, tmp_path, monkeypatch):
    """The file was written inside the update, so its write counted in the first update's seconds and the training
    time (and again at a schedule's new shape)."""
    import metrics
    import train
    import trainer as trainer_lib
    from tests.test_train import small_config
    events, save, pause, resume = [], trainer_lib.compile_cache.save, metrics.Metrics.pause_clock, \
        metrics.Metrics.resume_clock
    monkeypatch.setattr(trainer_lib.compile_cache, "save", lambda *a: events.append(("save", time.time())) or save(*a))
    monkeypatch.setattr(metrics.Metrics, "pause_clock", lambda self: events.append(("pause", time.time())) or
                        pause(self))
    monkeypatch.setattr(metrics.Metrics, "resume_clock", lambda self, start: events.append(("resume", time.time()))
                        or resume(self, start))
    cfg = small_config(text_cache, tmp_path, compile=True, epochs=1, compile_cache=str(tmp_path / "c.bin"))
    assert train.train(cfg)["status"] == "complete" and (tmp_path / "c.bin").is_file()
    kinds = [kind for kind, _ in events]
    at = kinds.index("save")
    assert kinds[at - 1] == "pause" and kinds[at + 1] == "resume"  # the clock paused around the write


@pytest.mark.parametrize("compiled, where, words", [
    (True, "notes.txt", "is not a compile cache this project wrote"),
    (False, "notes.txt", "this run compiles nothing; set compile=True"),
    (True, "notes.txt/run.compile", "cannot be written there"),  # a folder that cannot be made: the file's there
])
def test_a_compile_cache_path_of_a_users_file_or_without_compile_is_one_line_before_any_work(text_cache, tmp_path,
                                                                                           capsys, compiled, where,
                                                                                           words):
    """Each before any work: the file is written after the first update, which an unwritable folder failed."""
    import train
    from tests.test_train import cli_args, small_config
    mine = tmp_path / "notes.txt"
    mine.write_bytes(b"a user's file")
    cfg = small_config(text_cache, tmp_path, compile=compiled, compile_cache=str(tmp_path / where))
    assert train.main(cli_args(cfg)) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert mine.read_bytes() == b"a user's file" and not (tmp_path / "out").exists()


def test_a_run_refused_after_the_compile_cache_check_leaves_no_folder_for_it(text_cache, tmp_path, capsys):
    """The check made the cache's folder to probe it, so a run refused by a later check left that folder behind."""
    import train
    from tests.test_train import cli_args, small_config
    cfg = small_config(text_cache, tmp_path, compile=True, compile_cache=str(tmp_path / "new" / "sub" / "c.bin"),
                       data_dir=str(tmp_path / "no-cache"))
    assert train.main(cli_args(cfg)) == 2 and "no meta.json" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------- kernels compiled by a child (model_kernels/first_calls.py)

def first_calls_cfg(**changes):
    return settings.Config(dict(compile=True, loss_impl="fused", lm_head_fp8=False, micro_batch_size=8, seq_len=512,
                                warm_kernels=True, attention_backend="auto", static_launch_user_kernels=False),
                           **changes)


def test_the_child_compiles_each_sequence_length_and_nothing_when_no_kernel_would_compile():
    from model_kernels import first_calls
    mcfg = model_lib.ModelConfig(vocab_size=32000, dim=320, n_layers=2, n_heads=5, hidden_dim=64, max_seq_len=512)
    cuda = torch.device("cuda", 0)
    job = first_calls.spec(first_calls_cfg(), mcfg, cuda, "fa4", [512, 256], True)
    # windows of 256 hold twice the rows of the micro-batch's 512-token sequences
    assert job == {"device": "cuda:0", "attention": [[16, 256, 5, 64], [8, 512, 5, 64]], "windows": [],
                   "vocab_size": 32000}
    # context_windows: one job for every context, the variable-length pair over whole rows (rows, T, H, D, smallest)
    windows = first_calls.spec(first_calls_cfg(context_windows=True), mcfg, cuda, "fa4", [512, 256], True)
    assert windows["attention"] == [] and windows["windows"] == [[8, 512, 5, 64, 256]]
    assert first_calls.kernels_of(windows) == ["loss", "attention"]
    assert first_calls.spec(first_calls_cfg(), mcfg, cuda, "sdpa", [512], True)["attention"] == []
    assert first_calls.spec(first_calls_cfg(lm_head_fp8=True), mcfg, cuda, "fa4", [512], True)["vocab_size"] == 0
    for cfg, device, attention in ((first_calls_cfg(compile=False), cuda, "fa4"),  # eager: nothing compiles beside
                                   (first_calls_cfg(warm_kernels=False), cuda, "fa4"),
                                   (first_calls_cfg(), torch.device("cpu"), "fa4"),
                                   (first_calls_cfg(loss_impl="full"), cuda, "sdpa")):
        assert first_calls.spec(cfg, mcfg, device, attention, [512], True) is None
    assert first_calls.spec(first_calls_cfg(), mcfg, cuda, "fa4", [512], False) is None  # warm caches


def test_the_attention_child_calls_the_backward_and_cudnns_forward_at_each_shape(monkeypatch, capsys):
    """The child's own body (compile_kernel), the kernels stood in for (they run on a GPU only; here on the meta
    device, shapes without data): at each shape of its job, flash-attn-4's backward, whose compile the run would wait
    for, and before it cuDNN's forward, which cuDNN generates at run time for the driver to compile into its cache,
    the run's first call's otherwise."""
    from model_kernels import attention, first_calls
    calls = []
    monkeypatch.setattr(attention, "flash_attn_4", lambda: None)
    monkeypatch.setattr(attention, "_flash_attention_4_backward_op",
                        lambda q, k, v, out, lse, grad_out: calls.append(("backward", tuple(q.shape), q.dtype)))
    monkeypatch.setattr(attention, "cudnn_attention_forward",
                        lambda q, k, v: calls.append(("forward", tuple(q.shape), q.dtype)))
    job = {"device": "meta", "attention": [[4, 8, 2, 16], [2, 16, 2, 16]], "windows": [], "vocab_size": 0}
    first_calls.compile_kernel("attention", time.time(), lambda: json.dumps(job))
    assert calls == [(kind, shape, torch.bfloat16) for shape in ((4, 8, 2, 16), (2, 16, 2, 16))
                     for kind in ("forward", "backward")]
    assert capsys.readouterr().out.startswith("attention ")
    calls.clear()
    first_calls.compile_kernel("attention", time.time(), lambda: json.dumps(dict(job, device="cpu")))
    assert [kind for kind, *_ in calls] == ["backward", "backward"]  # cuDNN has no CPU forward
    assert capsys.readouterr().out.startswith("attention ")  # the line the run waits for
    calls.clear()
    first_calls.compile_kernel("attention", time.time(), lambda: "")  # no job (the run ended it): no kernel
    assert calls == []


JOB = {"device": "cpu", "attention": [[2, 16, 2, 8]], "vocab_size": 64}


def stand_in_children(sources):
    """Children that run sources[kernel] (Python source, "" for none), read their job as the real child does and
    print their kernel's line, with job= the count of attention shapes the job gave."""
    return lambda kernel, started: [sys.executable, "-c", f"{sources.get(kernel, '')}\nimport json, sys\n"
                                    f"job = json.loads(sys.stdin.readline())\n"
                                    f"print({kernel!r}, 1.5, f'job={{len(job[\"attention\"])}}', flush=True)"]


def test_each_kernel_has_a_child_and_a_first_call_waits_for_its_own_only(tmp_path):
    from model_kernels import first_calls
    flag = tmp_path / "go"
    first_calls.start(JOB, stand_in_children({"loss": f"import os, time\nwhile not os.path.exists({str(flag)!r}): "
                                                      f"time.sleep(0.01)"}))
    try:
        loss_child = first_calls._children["loss"]["process"]
        first_calls.wait("attention")  # the attention's child does not wait for the loss's compile
        assert loss_child.poll() is None and set(first_calls.timings()) == {"attention"}
        flag.touch()
        first_calls.wait("loss")
        assert first_calls._children == {} and loss_child.returncode is not None  # reaped
        assert first_calls.timings()["loss"]["ready_seconds"] == 1.5
        assert first_calls.timings()["loss"]["job_seconds"] == 1  # the job came through its input
        assert first_calls.timings()["loss"]["waited_seconds"] > 0
        first_calls.wait("loss")  # no child: at once
    finally:
        first_calls.stop()


def test_prestarted_children_get_their_job_later_and_those_the_run_does_not_need_end(tmp_path, monkeypatch):
    """prestart starts Inductor's compile workers and a child per kernel the settings may compile, before the
    attention backend is resolved; start gives the job to the children of its kernels (the same processes) and ends
    the rest; a later run's start does not reuse a child that had a job."""
    from torch._inductor import async_compile
    from model_kernels import first_calls
    pools = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: pools.append(1))
    cuda = torch.device("cuda", 0)
    flag = tmp_path / "go"
    stand_in = stand_in_children({"attention": f"import os, time\nwhile not os.path.exists({str(flag)!r}): "
                                               f"time.sleep(0.01)"})
    assert first_calls.kernels_for(first_calls_cfg(attention_backend="sdpa"), cuda, None, True) == ["loss"]
    first_calls.prestart(first_calls_cfg(), torch.device("cpu"), True, stand_in)  # the CPU: nothing
    first_calls.prestart(first_calls_cfg(), cuda, False, stand_in)  # warm caches: nothing either
    assert first_calls._children == {} and pools == []
    try:
        first_calls.prestart(first_calls_cfg(), cuda, True, stand_in)
        assert pools == [1]
        children = {k: c["process"] for k, c in first_calls._children.items()}
        assert set(children) == {"loss", "attention"}
        first_calls.start(dict(JOB, vocab_size=0))  # as resolved: fa4's attention, the plain loss
        assert children["loss"].returncode is not None and set(first_calls._children) == {"attention"}
        assert first_calls._children["attention"]["process"] is children["attention"]  # prestart's, not a new one
        flag.touch()
        first_calls.wait("attention")
        assert first_calls.timings()["attention"]["job_seconds"] == 1
        first_calls.start(JOB, stand_in_children({}))  # a run's children, given their job
        given = first_calls._children["loss"]["process"]
        first_calls.start(JOB, stand_in_children({}))  # the next run's (bench.py's presets): new children
        assert given.returncode is not None and first_calls._children["loss"]["process"] is not given
        first_calls.wait("loss")
        assert first_calls.timings()["loss"]["ready_seconds"] == 1.5
    finally:
        first_calls.stop()


def test_the_helpers_can_start_before_the_script_imports_torch():
    """train.py and bench.py import first_calls and read bench's cold from their arguments before torch."""
    code = ("import sys\nfrom model_kernels import first_calls\nfrom configurator import argv_value\n"
            "print(sorted(m for m in ('torch', 'settings', 'model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize("script, argv, fresh", [("train.py", ["config/x.py"], False),
                                                 ("bench.py", ["config/x.py", "--cold=True"], True),
                                                 ("bench.py", ["config/x.py"], False)])
def test_train_and_bench_start_the_helpers_first_when_run_as_scripts(script, argv, fresh):
    """Run as a script (not imported: compare.py and the tests call main()), each calls start_early with its
    arguments before it imports torch; bench.py passes its --cold."""
    code = (f"import runpy, sys\nfrom model_kernels import first_calls\n"
            f"def early(argv, fresh=False):\n"
            f"    print('start_early', argv, fresh, 'torch' in sys.modules, flush=True)\n"
            f"    raise SystemExit(0)\n"
            f"first_calls.start_early = early\nsys.argv = [{script!r}] + {argv!r}\n"
            f"runpy.run_path({script!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"start_early {argv} {fresh} False", out.stderr[-2000:]
    imported = subprocess.run([sys.executable, "-c", f"import {script[:-3]}\nfrom model_kernels import first_calls\n"
                               f"print(first_calls._children)"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
    assert imported.returncode == 0 and imported.stdout.strip() == "{}"  # imported: no early start


@pytest.mark.parametrize("argv, cold", [(["config/x.py", "--cold=True"], True), (["--cold"], True),
                                        (["--cold", "False"], False), (["--cold=True", "--cold=False"], False),
                                        (["--cold=maybe"], False), (["--cold_start=True"], False), ([], False)])
def test_the_early_reading_of_an_override_is_load_configs(argv, cold):
    from configurator import argv_value
    assert argv_value(argv, "cold", bool, False) is cold


def test_early_children_start_on_a_cold_gpu_machine_only_and_the_plan_keeps_those_it_needs(tmp_path, monkeypatch):
    """start_early, at the process's start: a child per kernel when the machine has a GPU and Inductor's cache is
    empty; prestart keeps those the run compiles (the same processes) and ends the others."""
    from model_kernels import first_calls
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    stand_in = stand_in_children({})
    try:
        first_calls.start_early(["config/x.py"], command=stand_in, gpu=False)
        assert first_calls._children == {}
        first_calls.start_early(["--help"], command=stand_in, gpu=True)
        assert first_calls._children == {}
        first_calls.start_early(["config/x.py"], command=stand_in, gpu=True)
        early = {k: c["process"] for k, c in first_calls._children.items()}
        assert set(early) == {"loss", "attention"}
        first_calls.prestart(first_calls_cfg(attention_backend="sdpa"), torch.device("cuda", 0), True, stand_in)
        assert set(first_calls._children) == {"loss"} and first_calls._children["loss"]["process"] is early["loss"]
        assert early["attention"].returncode is not None  # ended
        first_calls.stop()
        (tmp_path / "inductor").mkdir()
        (tmp_path / "inductor" / "fxgraph").mkdir()  # warm: Inductor loads its kernels, no child is worth it
        first_calls.start_early(["config/x.py"], command=stand_in, gpu=True)
        assert first_calls._children == {}
    finally:
        first_calls.stop()


@pytest.mark.parametrize("cold_run", [True, False])
def test_bench_cold_folders_made_at_the_start_are_the_runs_and_put_back_when_it_is_not_cold(tmp_path, monkeypatch,
                                                                                         cold_run):
    """bench.py's cold=True among its arguments: the new folders are made before the children start, which inherit
    them, and the run's own fresh folders are those; a run that is not cold after all (its config file said
    otherwise) gets the folders it had, and the plan replaces the children started under the others."""
    from model_kernels import first_calls
    for variable in env.CACHE_VARIABLES:
        monkeypatch.setenv(variable, str(tmp_path / variable))
    before = env.compiler_cache()
    stand_in = stand_in_children({})
    try:
        first_calls.start_early(["--cold=True"], fresh=True, command=stand_in, gpu=True)
        early = env.compiler_cache()
        assert early != before and set(first_calls._children) == {"loss", "attention"}
        assert all(c["folders"] == early for c in first_calls._children.values())
        folders, cold = env.compiler_cache_state(fresh=cold_run)
        assert cold and folders == (early if cold_run else before)
        assert env.compiler_cache_state(fresh=cold_run)[0] != early  # a later run (another preset): new folders
        children = {k: c["process"] for k, c in first_calls._children.items()}
        env.compiler_cache_state(fresh=False)
        monkeypatch.setattr(env, "compiler_cache", lambda: early)  # the run's folders as at the start
        first_calls.prestart(first_calls_cfg(), torch.device("cuda", 0), True, stand_in)
        kept = {k: c["process"] is children[k] for k, c in first_calls._children.items()}
        assert kept == {"loss": True, "attention": True}
        monkeypatch.setattr(env, "compiler_cache", lambda: before)  # other folders: new children under them
        first_calls.prestart(first_calls_cfg(), torch.device("cuda", 0), True, stand_in)
        assert all(c["process"] is not children[k] for k, c in first_calls._children.items())
    finally:
        first_calls.stop()


COMPILER_AT_PRESTART = """
import sys, torch
from torch._inductor import codecache
from torch._inductor.runtime.triton_compat import triton_key  # Triton: in requirements.txt, as on the GPU
hashed = []  # torch_key's walk over torch's sources
real = codecache.build_code_hash
codecache.build_code_hash = lambda roots, prefix, hasher: (hashed.append(prefix), real(roots, prefix, hasher))[1]
import settings
from model_kernels import first_calls
seen = []
for changes in (dict(compile=False), dict(warm_compiler=False), dict()):
    cfg = settings.Config(dict(compile=True, warm_kernels=True, warm_compiler=True), **changes)
    first_calls.prestart(cfg, torch.device("cpu"), False)
    seen.append(["torch._inductor.compile_fx" in sys.modules, "torch._inductor.codegen.halide" in sys.modules,
                 bool(hashed), triton_key.cache_info().currsize == 1])
print(seen)
"""


def test_a_compiled_runs_plan_imports_the_compiler_and_hashes_the_sources_its_first_update_would():
    """warm_compiler: prestart (train.py's and bench.py's plan) imports Inductor's compiler and its backends' code
    generators and computes the hashes of torch's and Triton's sources that key its caches, which the first compile
    of a process otherwise does inside the first update; an eager run, or the setting off, leaves all of it to the
    first compile. In a process of its own: this one has compiled before."""
    out = subprocess.run([sys.executable, "-c", COMPILER_AT_PRESTART], cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1].lower()) == [[False] * 4, [False] * 4, [True] * 4]


@pytest.mark.parametrize("static", [False, True])
def test_static_launch_is_in_the_environment_before_inductors_workers_start(monkeypatch, static_launch_unset, static):
    """Cold, prestart starts Inductor's compile workers early; with static_launch_user_kernels their environment
    already holds the setting (they read it once, when they start), and without it it does not."""
    from torch._inductor import async_compile
    from model_kernels import first_calls, swiglu
    seen = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: seen.append(os.environ.get(swiglu.STATIC_LAUNCH_ENV)))
    cfg = first_calls_cfg(warm_kernels=False, static_launch_user_kernels=static)  # the workers alone, no child
    first_calls.prestart(cfg, torch.device("cuda", 0), True)
    assert seen == ["1" if static else None]


def test_train_and_bench_start_the_helpers_at_the_plan_before_the_trainer_and_a_checked_plan_starts_none(
        text_cache, tmp_path, monkeypatch):
    """prestart is called once per run, with the run's device and the caches' state, before the trainer gives the
    children their job (first_calls.start); compare.py's plan of a run it only checks starts nothing."""
    import plan as plan_lib
    import train
    from model_kernels import first_calls
    from tests.test_bench import run_bench
    from tests.test_train import small_config
    events = []
    monkeypatch.setattr(first_calls, "prestart", lambda cfg, device, cold: events.append(("prestart", device, cold)))
    real_start = first_calls.start
    monkeypatch.setattr(first_calls, "start", lambda job: (events.append(("start", job)), real_start(job)))
    cfg = small_config(text_cache, tmp_path)
    cold = env.compiler_cache_state()[1]
    plan_lib.resolve(cfg, world=(0, 0, 1))
    assert events == []
    train.train(settings.Config(cfg, stop_after_updates=1))
    assert events == [("prestart", torch.device("cpu"), cold), ("start", None)]  # the CPU: no job
    events.clear()
    code, _ = run_bench(tmp_path, text_cache, "--name=prestart")
    assert code == 0 and [e[0] for e in events] == ["prestart", "start"] and events[0][1] == torch.device("cpu")


def test_the_child_exits_without_a_line_when_its_input_ends_without_a_job():
    """A prestarted child that the run does not need: its input closes, and it exits after its imports."""
    done = subprocess.run([sys.executable, "-m", "model_kernels.first_calls", "loss", repr(time.time())],
                          input="", capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "", done.stderr


def test_a_library_line_that_begins_with_the_kernels_name_is_not_taken_for_the_childs(tmp_path):
    """flash-attn-4 or Triton may print a line beginning "attention ..." before the child's own line."""
    from model_kernels import first_calls
    first_calls.start(dict(JOB, vocab_size=0), lambda kernel, started: [
        sys.executable, "-c", "print('attention is compiled for sm_90'); print('attention 2 slow'); "
                              "print('attention 3.25 torch=1.5 code=2.0', flush=True)"])
    try:
        first_calls.wait("attention")
        assert first_calls.timings()["attention"] == dict(first_calls.timings()["attention"], ready_seconds=3.25,
                                                          torch_seconds=1.5, code_seconds=2.0)
    finally:
        first_calls.stop()


def test_a_job_starts_children_for_its_kernels_only():
    from model_kernels import first_calls
    assert first_calls.kernels_of(JOB) == ["loss", "attention"]
    assert first_calls.kernels_of(dict(JOB, vocab_size=0)) == ["attention"]
    assert first_calls.kernels_of(dict(JOB, attention=[])) == ["loss"]


def test_a_failed_child_says_so_in_one_line_and_the_run_compiles_itself(capsys):
    from model_kernels import first_calls
    first_calls.start(dict(JOB, vocab_size=0), stand_in_children({"attention": "raise SystemExit('no GPU here')"}))
    first_calls.wait("attention")
    err = capsys.readouterr().err
    assert ("the attention kernel exited with 1 (no GPU here); compiling it in this process" in err
            and len(err.splitlines()) == 1)
    assert first_calls._children == {} and first_calls.timings() == {}


def test_fa4s_backward_starts_after_the_child_compiled_it(flash_attn_4_stand_in):
    from model_kernels import attention, first_calls
    from tests.conftest import attention_backward_by_hand
    seen = []

    def backward(*args, **kwargs):
        seen.append(sorted(first_calls.timings()))
        return attention_backward_by_hand(*args, **kwargs)

    flash_attn_4_stand_in._flash_attn_bwd = backward
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    first_calls.start(dict(JOB, vocab_size=0), stand_in_children({"attention": "import time; time.sleep(0.2)"}))
    try:
        attention.flash_attention_4(q, k, v).sum().backward()
    finally:
        first_calls.stop()
    assert seen == [["attention"]]


def test_the_loss_kernel_waits_for_the_child_before_it_is_built(monkeypatch):
    """The Triton rows' first step is the wait (the kernel itself needs a GPU: the wait stops it here)."""
    pytest.importorskip("triton")
    from model_kernels import cross_entropy, first_calls
    waited = []

    def wait(kernel):
        waited.append(kernel)
        raise RuntimeError("stop before the kernel")

    monkeypatch.setattr(first_calls, "wait", wait)
    with pytest.raises(RuntimeError, match="stop before the kernel"):
        cross_entropy._cross_entropy_rows_triton(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))
    assert waited == ["loss"]


def test_the_real_children_call_each_kernel_at_the_runs_shapes(tmp_path, monkeypatch):
    """On the CPU: the torch loss rows, and flash-attn-4's backward as our op calls it (a stand-in package that
    notes each call's shapes), at two sequence lengths; on the GPU the Triton rows and fa4's CuTe kernel."""
    from model_kernels import first_calls
    package = tmp_path / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "interface.py").write_text(
        "from tests.conftest import attention_backward_by_hand\n"
        "def _flash_attn_bwd(q, k, v, out, dout, lse, **kw):\n"
        f"    open({str(tmp_path / 'calls')!r}, 'a').write(f'{{list(q.shape)}} {{list(lse.shape)}} {{q.dtype}}\\n')\n"
        "    return attention_backward_by_hand(q, k, v, out, dout, lse, **kw)\n"
        "def _flash_attn_fwd(*args, **kwargs):  # the windows' (not in this job)\n"
        "    raise AssertionError('not called')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    first_calls.start(dict(JOB, attention=[[2, 16, 2, 8], [1, 32, 2, 8]]))
    children = [first_calls._children[k]["process"] for k in first_calls.KERNELS]
    for kernel in first_calls.KERNELS:
        first_calls.wait(kernel)
    timings = first_calls.timings()
    assert set(timings) == {"loss", "attention"} and first_calls._children == {}
    assert all(0 < t["torch_seconds"] <= t["code_seconds"] <= t["ready_seconds"] for t in timings.values())
    assert all(child.returncode is not None for child in children)  # reaped
    assert (tmp_path / "calls").read_text().splitlines() == ["[2, 16, 2, 8] [2, 2, 16] torch.bfloat16",
                                                             "[1, 32, 2, 8] [1, 2, 32] torch.bfloat16"]


def test_a_child_that_never_answers_is_ended_after_the_wait_limit(tmp_path, monkeypatch, capsys):
    """A child hung before its line (a GPU call that never returns, say) costs the run WAIT_LIMIT_S, not the run:
    it is killed, the first call compiles the kernel itself and the line says why."""
    from model_kernels import first_calls
    monkeypatch.setattr(first_calls, "WAIT_LIMIT_S", 0.5)
    first_calls.start(JOB, stand_in_children({"loss": "import time\ntime.sleep(600)"}))
    try:
        child = first_calls._children["loss"]["process"]
        begin = time.perf_counter()
        first_calls.wait("loss")
        assert time.perf_counter() - begin < 30 and child.returncode is not None
        assert "loss" not in first_calls.timings()
        assert "the child compiling the loss kernel gave no line within 0.5 s" in capsys.readouterr().err
        first_calls.wait("attention")  # an answering child is not cut by the limit's earlier timer
        assert first_calls.timings()["attention"]["ready_seconds"] == 1.5
    finally:
        first_calls.stop()


def test_the_cold_start_profile_writes_its_compile_cache(text_cache, tmp_path, capsys):
    """The write moved out of the update into train.py and bench.py; the profile still promised it and wrote none."""
    import importlib.util
    from tests.test_train import SEQ_LEN
    spec = importlib.util.spec_from_file_location("profile", REPO / "scripts" / "cold_start_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    path = tmp_path / "p.compile"
    profile.main(["--preset=20m", "--dim=64", "--n_layers=2", "--n_heads=2", "--hidden_dim=128", f"--seq_len={SEQ_LEN}",
                  "--device=cpu", "--cpu_threads=1", f"--data_dir={text_cache}", "--micro_batch_size=4",
                  f"--tokens_per_update={4 * SEQ_LEN}", "--compile=True", f"--compile_cache={path}",
                  f"--results_file={tmp_path / 'r.json'}", "--name=profile"])
    assert "saving it there after the first update" in capsys.readouterr().out and path.is_file()
