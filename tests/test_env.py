"""env.py: configuration, the results file, atomic writes, the fingerprint and the machine facts."""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import common
import configurator
from results import ResultsFileError, _UMASK, append, atomic_write, atomic_write_text, lookup, read_results, record, record_many
import env
import train

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- load_config

def test_defaults_come_from_train_and_are_not_changed():
    before = dict(train.DEFAULTS)
    config = configurator.load_config(train.DEFAULTS, [])
    assert config == train.DEFAULTS and config is not train.DEFAULTS
    configurator.load_config(train.DEFAULTS, ["--learning_rate=0.5"])
    assert train.DEFAULTS == before
    # the defaults are exactly the declared settings
    import dataclasses
    import settings
    assert set(train.DEFAULTS) == {f.name for f in dataclasses.fields(settings.TrainSettings)}
    assert {k: train.DEFAULTS[k] for k in ("learning_rate", "min_lr", "tokens_per_update", "optimizer",
                                           "lr_schedule", "compile", "eval_interval")} == dict(
        learning_rate=2e-3, min_lr=2e-4, tokens_per_update=32768, optimizer="adamw", lr_schedule="cosine",
        compile=False, eval_interval=0)  # the defaults old runs were recorded under
    assert configurator.load_config(settings.TrainSettings, []) == train.DEFAULTS


def test_config_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.py"
    path.write_text("# a comment\nname = 'file'\nepochs = 3\nlearning_rate = 1e-3\n_helper = 7\n"
                    "tokens_per_update = 64 * 8\n")
    config = configurator.load_config(train.DEFAULTS, [str(path), "--epochs=5", "--name", "cli"])
    assert config["epochs"] == 5 and config["name"] == "cli"
    assert config["learning_rate"] == 1e-3 and config["tokens_per_update"] == 512
    assert "_helper" not in config
    assert config["seed"] == train.DEFAULTS["seed"]
    # an override before the file is overridden by the file
    assert configurator.load_config(train.DEFAULTS, ["--epochs=5", str(path)])["epochs"] == 3


def test_key_value_forms_and_dashes():
    a = configurator.load_config(train.DEFAULTS, ["--micro_batch_size=4", "--learning_rate", "3e-4", "--min-lr=1e-5"])
    assert a["micro_batch_size"] == 4 and a["learning_rate"] == 3e-4 and a["min_lr"] == 1e-5
    assert type(a["micro_batch_size"]) is int


@pytest.mark.parametrize("args, expected", [
    (["--compile=True"], True), (["--compile=false"], False), (["--compile"], True),
    (["--compile", "no"], False), (["--compile", "1"], True), (["--compile=off"], False),
    (["--compile", "--epochs=2"], True),
])
def test_bool_parsing(args, expected):
    config = configurator.load_config(train.DEFAULTS, args)
    assert config["compile"] is expected


def test_bare_bool_flag_does_not_swallow_a_config_file(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("epochs = 4\n")
    config = configurator.load_config(train.DEFAULTS, ["--compile", str(path)])
    assert config["compile"] is True and config["epochs"] == 4


def test_int_is_accepted_for_a_float(tmp_path):
    assert configurator.load_config(train.DEFAULTS, ["--learning_rate=1"])["learning_rate"] == 1.0
    assert type(configurator.load_config(train.DEFAULTS, ["--learning_rate=1"])["learning_rate"]) is float
    path = tmp_path / "c.py"
    path.write_text("grad_clip = 2\n")
    assert type(configurator.load_config(train.DEFAULTS, [str(path)])["grad_clip"]) is float


def test_float_is_not_accepted_for_an_int():
    with pytest.raises(configurator.ConfigError, match="micro_batch_size"):
        configurator.load_config(train.DEFAULTS, ["--micro_batch_size=2.5"])


@pytest.mark.parametrize("arg, closest", [("--learning_rat=1", "learning_rate"), ("--micro_batch=2", "micro_batch_size"),
                                          ("--epoch", "epochs")])
def test_unknown_key_names_the_closest(arg, closest):
    with pytest.raises(configurator.ConfigError) as info:
        configurator.load_config(train.DEFAULTS, [arg])
    assert closest in str(info.value)
    assert arg[2:].split("=")[0] in str(info.value)


@pytest.mark.parametrize("key, meant, not_meant", [("max_iters", ["epochs", "stop_after_updates"], "eval_interval"),
                                                   ("block_size", ["seq_len"], "vocab_size"),
                                                   ("batch_size", ["micro_batch_size", "tokens_per_update"],
                                                    "eval_batch_size")])
def test_a_nanogpt_key_names_what_does_its_job_here_not_its_closest_spelling(tmp_path, key, meant, not_meant):
    """--max_iters suggested eval_interval, the closest spelling, to a nanoGPT user asking for the run's length."""
    path = tmp_path / "c.py"
    path.write_text(f"{key} = 100\n")
    for argv in ([f"--{key}=100"], [str(path)]):
        with pytest.raises(configurator.ConfigError) as info:
            configurator.load_config(train.DEFAULTS, argv)
        message = str(info.value)
        assert f"'{key}' (nanoGPT's)" in message and all(k in message for k in meant), message
        assert not_meant not in message, message


def test_unknown_key_in_a_config_file(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("learning_rat = 1e-3\n")
    with pytest.raises(configurator.ConfigError) as info:
        configurator.load_config(train.DEFAULTS, [str(path)])
    assert "learning_rate" in str(info.value) and str(path) in str(info.value)


def test_wrong_types_name_the_key(tmp_path):
    with pytest.raises(configurator.ConfigError, match="micro_batch_size"):
        configurator.load_config(train.DEFAULTS, ["--micro_batch_size=abc"])
    path = tmp_path / "c.py"
    path.write_text('epochs = "ten"\n')
    with pytest.raises(configurator.ConfigError, match="epochs"):
        configurator.load_config(train.DEFAULTS, [str(path)])
    with pytest.raises(configurator.ConfigError, match="compile"):
        configurator.load_config(train.DEFAULTS, ["--compile=maybe"])


def test_missing_value_missing_file_and_broken_file(tmp_path):
    with pytest.raises(configurator.ConfigError, match="epochs"):
        configurator.load_config(train.DEFAULTS, ["--epochs"])
    with pytest.raises(configurator.ConfigError, match="nope.py"):
        configurator.load_config(train.DEFAULTS, [str(tmp_path / "nope.py")])
    broken = tmp_path / "broken.py"
    broken.write_text("epochs = = 3\n")
    with pytest.raises(configurator.ConfigError, match="broken.py"):
        configurator.load_config(train.DEFAULTS, [str(broken)])


def test_write_config_file_reproduces_the_config(tmp_path):
    config = configurator.load_config(train.DEFAULTS, ["--epochs=3", "--name=x", "--learning_rate=1e-4", "--compile"])
    path = tmp_path / "out.py"
    configurator.write_config_file(path, config, train.DEFAULTS, header="made by a test")
    assert configurator.load_config(train.DEFAULTS, [str(path)]) == config


@pytest.mark.parametrize("args", [["--learning_rat=1"], ["--micro_batch_size=abc"], ["missing_config.py"]])
def test_train_main_reports_a_config_error_in_one_line(args, capsys):
    assert train.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("script,settings_class", [("train.py", "settings.TrainSettings"),
                                                    ("bench.py", "settings.BenchSettings"),
                                                    ("tune.py", "tune.TuneSettings"),
                                                    ("compare.py", "compare.CompareSettings"),
                                                    ("sample.py", "sample.SampleSettings")])
def test_help_lists_every_key_with_its_default_and_exits_0(script, settings_class):
    """`--help` was an unknown config key; a researcher types it first. Each script lists its own keys, all of
    them and no other (sample.py none of the optimizer's or the schedule's)."""
    done = subprocess.run([sys.executable, script, "config/tiny_cpu.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr
    docstring = ast.get_docstring(ast.parse((REPO / script).read_text()))
    assert done.stdout.startswith(docstring.splitlines()[0])
    import dataclasses
    import importlib
    module, cls = settings_class.split(".")
    declared = dataclasses.fields(getattr(importlib.import_module(module), cls))
    keys = done.stdout.split("\nsettings (", 1)[1]  # after the docstring, whose examples use keys too
    listed = [line.split("=", 1)[0].strip()[2:] for line in keys.splitlines() if line.strip().startswith("--")]
    assert listed == [f.name for f in declared]
    for field in declared:  # each key with its default and its help
        line = next(line for line in keys.splitlines() if line.strip().startswith(f"--{field.name}="))
        assert field.metadata["help"] in line, field.name
    if script != "sample.py":
        assert "--micro_batch_size=8 " in done.stdout and "--attention_backend='auto' " in done.stdout
    else:
        assert not {"optimizer", "learning_rate", "lr_schedule", "muon_lr", "warmup_updates"} & set(listed)


def test_help_piped_into_a_reader_that_stops_early_ends_quietly():
    """`bench.py --help | head -1` ended in a BrokenPipeError traceback."""
    # more keys than a pipe holds (64 KiB), so that the writer is still writing when the reader leaves
    many_keys = "{**train.DEFAULTS, **{f'key_{i}': i for i in range(5000)}}"
    proc = subprocess.Popen([sys.executable, "-c", f"import configurator, train; configurator.load_config({many_keys}, ['--help'])"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its line
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_portable_traceback_names_no_path_of_this_machine(tmp_path):
    import torch

    def read(path):
        with open(path) as f:  # raises in this file
            return f.read()

    tracebacks = []
    for fail in (lambda: torch.load(tmp_path / "missing.pt"), lambda: json.loads("{"), lambda: read(tmp_path / "x")):
        try:
            fail()
        except Exception:  # noqa: BLE001
            tracebacks.append(env.portable_traceback(limit=None))
    torch_load, json_loads, here = tracebacks
    assert 'File "site-packages/torch/serialization.py", line' in torch_load
    assert 'File "stdlib/json/decoder.py", line' in json_loads
    assert 'File "tests/test_env.py", line' in here
    for text in tracebacks:
        assert '"/' not in text and str(REPO) not in text


# ---------------------------------------------------------------- the results file

WRITER = """
import os, sys, time
from results import record
path, tag, go = sys.argv[1], sys.argv[2], sys.argv[3]
open(f"{go}-{tag}-ready", "w").close()  # imports done (slow on a loaded machine)
while not os.path.exists(go):  # start together, so that the writes really overlap
    time.sleep(0.001)
for n in range(50):
    record(path, ["runs", f"{tag}-{n}"], {"run_id": f"{tag}-{n}", "n": n, "pid": os.getpid()})
    time.sleep(0.005)  # room for the other writer to take the lock between our writes
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "results.json"
    environ = dict(os.environ, PYTHONPATH=str(REPO))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), f"p{i}", str(go)], env=environ, cwd=tmp_path)
             for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"go-p{i}-ready").exists() for i in range(2)):  # both writers imported
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a writer did not start"
        time.sleep(0.01)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    data = json.loads(path.read_text())
    assert set(data["runs"]) == {f"p{i}-{n}" for i in range(2) for n in range(50)}
    assert all(data["runs"][k]["run_id"] == k for k in data["runs"])
    assert "history" not in data  # nothing was replaced
    order = [k.split("-")[0] for k in data["runs"]]  # insertion order: the writers took turns
    assert order != sorted(order), "the two writers did not overlap, so this run proved nothing about the lock"
    assert not list(tmp_path.glob(".results.json.*.tmp"))


def test_history_keeps_what_another_run_replaces(tmp_path):
    path = tmp_path / "r.json"
    record(path, ["runs", "a"], {"run_id": "1", "loss": 3.0})
    record(path, ["runs", "a"], {"run_id": "1", "loss": 2.5})  # the same run updating its entry
    assert "history" not in read_results(path)
    assert lookup(path, ["runs", "a", "loss"]) == 2.5
    record(path, ["runs", "a"], {"run_id": "2", "loss": 2.0})  # another run takes the name
    data = read_results(path)
    assert data["runs"]["a"] == {"run_id": "2", "loss": 2.0}
    assert len(data["history"]) == 1
    old = data["history"][0]
    assert old["path"] == ["runs", "a"] and old["value"] == {"run_id": "1", "loss": 2.5}
    assert old["replaced_at"] <= time.time()
    # values without a run id: an equal value is no change, a different one is kept in history
    record(path, "note", "x")
    record(path, "note", "x")
    assert len(read_results(path)["history"]) == 1
    record(path, "note", "y")
    assert read_results(path)["history"][-1]["value"] == "x"
    assert lookup(path, ["runs", "missing"], default=7) == 7


@pytest.mark.parametrize("old", [None, float("nan"), 0, "", {}, []])
def test_history_keeps_a_replaced_null_or_empty_value(tmp_path, old):
    """An entry that is there is replaced into the history whatever it holds: null (a diverged run's NaN, as the
    file writes it), zero or empty; an entry that was not there leaves no history."""
    path = tmp_path / "r.json"
    record(path, ["runs", "a"], old)
    kept = read_results(path)["runs"]["a"]  # as the file holds it: NaN is null
    record(path, ["runs", "a"], kept)  # the same value again is no change
    assert "history" not in read_results(path)
    record(path, ["runs", "a"], {"run_id": "2", "loss": 2.0})
    data = read_results(path)
    assert data["runs"]["a"] == {"run_id": "2", "loss": 2.0}
    assert [(h["path"], h["value"]) for h in data["history"]] == [(["runs", "a"], kept)]


def test_the_same_entry_again_with_a_nan_or_a_tuple_leaves_no_history(tmp_path):
    """The file holds NaN as null and a tuple as a list: recording the very same entry again is no change, where
    comparing it with what the file read back would call every diverged run's entry replaced."""
    path = tmp_path / "r.json"
    entry = {"loss": float("nan"), "tokens_per_second": 1.0, "shape": (8, 1024)}
    record(path, ["benchmarks", "x"], entry)
    record(path, ["benchmarks", "x"], entry)
    data = read_results(path)
    assert "history" not in data
    assert data["benchmarks"]["x"] == {"loss": None, "tokens_per_second": 1.0, "shape": [8, 1024]}
    record(path, ["benchmarks", "x"], dict(entry, loss=4.0))  # a different value still goes to the history
    assert [h["value"]["loss"] for h in read_results(path)["history"]] == [None]


def test_atomic_write_syncs_the_whole_file_before_it_takes_the_name(tmp_path, monkeypatch):
    """Readers see the old file or the new one even after a power cut: the new file's bytes reach the disk (fsync)
    before the rename makes them the file's, or a crash could leave the name on an empty or partial file."""
    path = tmp_path / "f.json"
    path.write_bytes(b"old")
    synced, renamed, fsync, replace = [], [], os.fsync, os.replace

    def fsync_noted(fd):
        synced.append(os.fstat(fd))
        return fsync(fd)

    def replace_noted(src, dst):
        renamed.append((os.stat(src), Path(dst), len(synced)))
        return replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync_noted)
    monkeypatch.setattr(os, "replace", replace_noted)
    data = b"new " * 10_000  # in small writes: its tail stays in the write buffer until a flush
    atomic_write(path, lambda f: [f.write(data[i:i + 4]) for i in range(0, len(data), 4)])
    assert path.read_bytes() == data
    [(moved, dst, syncs_before)], [sync] = renamed, synced
    assert dst == path and syncs_before == 1  # synced once, before the rename
    new = path.stat()
    assert (sync.st_ino, sync.st_dev) == (moved.st_ino, moved.st_dev) == (new.st_ino, new.st_dev)
    assert sync.st_size == len(data)  # everything written when synced, not only what left the buffer


def test_record_many_is_one_write_and_all_or_nothing(tmp_path, monkeypatch):
    """A merge of many entries takes the lock and writes the file once; an item that cannot be placed leaves
    the file as it was, with none of the batch in it."""
    path = tmp_path / "r.json"
    record(path, "scalar", 5)
    writes = []
    real_write = atomic_write_text
    import results
    monkeypatch.setattr(results, "atomic_write_text", lambda p, text: (writes.append(p), real_write(p, text)))
    record_many(path, [(["runs", str(i)], {"run_id": str(i)}) for i in range(50)])
    assert len(writes) == 1 and len(lookup(path, "runs")) == 50
    before = path.read_bytes()
    with pytest.raises(ResultsFileError):
        record_many(path, [(["runs", "new"], {"run_id": "x"}), (["scalar", "a"], 1)])
    assert path.read_bytes() == before and len(writes) == 1


def test_append_appends(tmp_path):
    path = tmp_path / "r.json"
    append(path, ["benchmarks", "list"], {"i": 0})
    append(path, ["benchmarks", "list"], {"i": 1})
    assert lookup(path, ["benchmarks", "list"]) == [{"i": 0}, {"i": 1}]
    record(path, "scalar", 1)
    with pytest.raises(ResultsFileError):
        append(path, "scalar", 2)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]"])
def test_a_corrupt_results_file_is_an_error_and_left_alone(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    for call in (lambda: read_results(path), lambda: record(path, ["runs", "a"], {"x": 1}),
                 lambda: append(path, ["l"], 1)):
        with pytest.raises(ResultsFileError) as info:
            call()
        assert str(path) in str(info.value)
        assert path.read_bytes() == content


def test_record_into_a_non_object_is_an_error(tmp_path):
    path = tmp_path / "r.json"
    record(path, "runs", 5)
    before = path.read_bytes()
    with pytest.raises(ResultsFileError):
        record(path, ["runs", "a"], 1)
    assert path.read_bytes() == before


# ---------------------------------------------------------------- atomic_write

def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def half_then_fail(f):
        f.write(b"new and partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]

    atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    atomic_write_text(tmp_path / "sub" / "t.txt", "text")  # creates the folder
    assert (tmp_path / "sub" / "t.txt").read_text() == "text"


# ---------------------------------------------------------------- fingerprint and machine facts

FINGERPRINT_FIELDS = ["python", "platform", "hostname", "versions", "cuda", "git_revision", "git_status", "gpu",
                      "cuda_visible_devices", "source_hash", "compiler_cache", "cpu_model", "cpu_affinity", "cpu_threads",
                      "cudnn", "slurm", "gpu_status", "gpu_topology", "cache_identity", "compiler_settings"]


def test_fingerprint_without_gpu_or_git(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("git") is None and shutil.which("nvidia-smi") is None
    repo_copy = tmp_path / "repo"
    repo_copy.mkdir()
    for name in ("env.py", "model.py", "train.py"):
        shutil.copy(REPO / name, repo_copy / name)
    monkeypatch.setattr(env, "REPO", repo_copy)  # a folder that is not a git checkout either
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    fp = env.fingerprint(cache_identity="abc")
    for field in FINGERPRINT_FIELDS:
        assert field in fp, field
    for field in ("git_revision", "git_status", "gpu", "gpu_status", "gpu_topology", "cuda", "cudnn", "slurm"):
        assert fp[field] is None, field
    assert fp["cache_identity"] == "abc"
    assert fp["versions"]["torch"] and fp["cpu_threads"] >= 1
    assert isinstance(fp["source_hash"], str) and len(fp["source_hash"]) == 64
    json.dumps(fp)  # it goes into the results file


def test_fingerprint_records_compiler_settings_from_the_environment(monkeypatch):
    """An entry measured with TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 ran other kernels, and must say so."""
    for key in [k for k in os.environ if k.startswith(env.COMPILER_ENV_PREFIXES)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/somewhere")  # where, not what: compiler_cache has it
    assert env.fingerprint()["compiler_settings"] is None
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "1")
    monkeypatch.setenv("TRITON_PRINT_AUTOTUNING", "1")
    assert env.fingerprint()["compiler_settings"] == {"TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "1",
                                                      "TRITON_PRINT_AUTOTUNING": "1"}


def test_allocation_usage_under_slurm():
    now = 1_750_000_000
    environ = {"SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_START_TIME": str(now - 3600),
               "SLURM_JOB_PARTITION": "gpu"}
    usage = env.allocation_usage(environ, now=now)
    assert usage["job_id"] == "4242" and usage["gpus"] == 2 and usage["partition"] == "gpu"
    assert usage["elapsed_seconds"] == 3600
    assert usage["gpu_hours"] == 2.0
    assert env.allocation_usage({}) is None
    assert env.allocation_usage({"HOME": "/root"}, now=now) is None


def test_allocation_usage_without_start_time():
    usage = env.allocation_usage({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "4"})
    assert usage["elapsed_seconds"] is None and usage["gpu_hours"] is None


@pytest.mark.parametrize("gpus, expected", [
    ({"SLURM_GPUS_ON_NODE": "4"}, 8),  # a node's count, on each of the 2 nodes
    ({"SLURM_GPUS": "8"}, 8),  # the job's total, however many nodes hold it
    ({"SLURM_GPUS": "h100:8"}, 8),
    ({"SLURM_GPUS": "h100:4,a100:2"}, 6),  # every type counts
])
def test_allocation_usage_counts_the_jobs_gpus(gpus, expected):
    usage = env.allocation_usage({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", **gpus})
    assert usage["gpus"] == expected


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989e12), ("NVIDIA GH200 120GB", 989e12),
                                        ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12),
                                        ("NVIDIA RTX A1000", None),  # "A100" is in that name, not as a word
                                        ("NVIDIA GeForce RTX 4090", None), ("", None), (None, None)])
def test_peak_flops(name, peak):
    assert env.peak_flops(name) == peak


def test_source_hash_follows_python_files_only(tmp_path):
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    for name in ("env.py", "model.py", "data/loader.py"):
        shutil.copy(REPO / name, root / name)
    (root / "notes.txt").write_text("a")
    first = env.source_hash(root)
    assert env.source_hash(root) == first
    # a config file a script writes (compare.py's, into an out_dir of any name) is no code: it changed the hash, so
    # the next compare.py trained its complete runs again
    (root / "experiments" / "seed1337").mkdir(parents=True)
    configurator.write_config_file(root / "experiments" / "seed1337" / "compare_config.py", {"epochs": 3},
                                   train.DEFAULTS, header="The run ...")
    assert env.source_hash(root) == first
    (root / "notes.txt").write_text("b")
    assert env.source_hash(root) == first
    (root / ".venv" / "lib").mkdir(parents=True)
    (root / ".venv" / "lib" / "x.py").write_text("x = 1\n")
    assert env.source_hash(root) == first  # the environment is not the source
    with open(root / "data" / "loader.py", "a") as f:
        f.write("\n# changed\n")
    second = env.source_hash(root)
    assert second != first
    (root / "new.py").write_text("")
    third = env.source_hash(root)
    assert third not in (first, second)
    (root / "config" / "tuned").mkdir(parents=True)  # tune.py writes its candidates here as it sweeps
    (root / "config" / "tuned" / "candidate.py").write_text("micro_batch_size = 16\n")
    assert env.source_hash(root) == third


def test_identities_are_key_order_independent():
    assert env.config_identity({"a": 1, "b": 2}) == env.config_identity({"b": 2, "a": 1})
    assert env.config_identity({"a": 1}) != env.config_identity({"a": 2})
    a, b = env.new_run_id(), env.new_run_id()
    assert a != b


def test_merging_a_returned_results_file_keeps_everything(tmp_path):
    """scripts/merge_results.py: entries of a copy made elsewhere join the local file; nothing local is lost."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    local, returned = tmp_path / "local.json", tmp_path / "returned.json"
    record(local, ["benchmarks", "old"], {"run_id": "a", "tokens_per_second": 1.0})
    record(local, ["run-1"], {"run_id": "r1", "status": "complete"})
    record(local, ["benchmarks", "changed"], {"run_id": "b", "tokens_per_second": 2.0})
    record(returned, ["benchmarks", "new"], {"run_id": "c", "tokens_per_second": 3.0})
    record(returned, ["benchmarks", "changed"], {"run_id": "e", "tokens_per_second": 3.5})  # run twice there
    record(returned, ["benchmarks", "changed"], {"run_id": "d", "tokens_per_second": 4.0})
    record(returned, ["profiles", "new"], {"run_id": "c", "kernel_count": 7})
    record(returned, ["run-2"], {"run_id": "r2", "status": "complete"})
    record(local, ["time-to-target", "speed"], {"run_id": "t1", "reaches_target": True})
    record(returned, ["time-to-target", "quality"], {"run_id": "t2", "reaches_target": False})
    assert merge_results.merge(returned, local) == (5, 0)
    merged = read_results(local)
    assert set(merged["benchmarks"]) == {"old", "new", "changed"}
    assert merged["benchmarks"]["changed"]["run_id"] == "d" and merged["profiles"]["new"]["kernel_count"] == 7
    assert merged["run-1"]["run_id"] == "r1" and merged["run-2"]["run_id"] == "r2"
    assert set(merged["time-to-target"]) == {"speed", "quality"}  # a verdict section joins, never replaces
    # the entry replaced here is kept, and so is the one the returned file replaced, once, however often merged
    assert [h["value"]["run_id"] for h in merged["history"]] == ["e", "b"]
    assert merge_results.merge(returned, local) == (0, 0)  # all already there
    assert [h["value"]["run_id"] for h in read_results(local)["history"]] == ["e", "b"]
    # another JSON object (a cache's meta.json, say) is refused in one line, and nothing of it merged
    other = tmp_path / "meta.json"
    other.write_text('{"format": 2, "vocab_size": 300}')
    before = local.read_text()
    assert merge_results.main([str(other), str(local)]) == 2 and local.read_text() == before


def test_merging_never_brings_back_a_value_replaced_here_while_the_device_ran(tmp_path):
    """The device's copy starts as the local file; an entry recomputed here meanwhile must stay the new one."""
    import importlib.util
    import shutil
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    local, returned = tmp_path / "local.json", tmp_path / "returned.json"
    record(local, ["matched-comparison"], {"optimized": "s15", "difference": 0.0173})
    record(local, ["benchmarks", "a"], {"run_id": "a"})
    shutil.copy(local, returned)  # the device call starts
    record(returned, ["benchmarks", "b"], {"run_id": "b"})  # what it measures
    record(local, ["matched-comparison"], {"optimized": "s29", "difference": -0.0105})  # meanwhile, here
    assert merge_results.merge(returned, local) == (1, 1)  # b merged, s15 skipped, a already there
    merged = read_results(local)
    assert merged["matched-comparison"]["optimized"] == "s29" and set(merged["benchmarks"]) == {"a", "b"}
    assert [h["value"]["optimized"] for h in merged["history"]] == ["s15"]


def test_merging_never_puts_an_older_state_of_a_run_or_list_over_the_newer(tmp_path):
    """A run updates its entry in place (same run_id, no history) and parity rows are appended: a copy taken
    while the run was going holds its older state, and lacks the rows appended here since."""
    import importlib.util
    import shutil
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    local, returned = tmp_path / "local.json", tmp_path / "returned.json"
    running = {"run_id": "20250101T100000-1-aaaaaa", "status": "running", "sessions": 1, "step": 50}
    record(local, ["run-a"], running)
    record(local, ["run-b"], running)
    append(local, ["trained-parity"], {"preset": "20m", "loss": 1.0})
    shutil.copy(local, returned)  # the device call starts
    record(local, ["run-a"], dict(running, status="complete", step=100, final_validation={"loss": 3.0}))
    append(local, ["trained-parity"], {"preset": "50m", "loss": 2.0})  # meanwhile, here
    record(returned, ["run-b"], dict(running, status="complete", step=100))  # there, the run went on
    append(returned, ["trained-parity"], {"preset": "90m", "loss": 3.0})
    assert merge_results.merge(returned, local) == (2, 1)
    merged = read_results(local)
    assert merged["run-a"]["status"] == "complete" and merged["run-a"]["final_validation"] == {"loss": 3.0}
    assert merged["run-b"]["status"] == "complete"
    assert [row["preset"] for row in merged["trained-parity"]] == ["20m", "50m", "90m"]
    assert "history" not in merged  # nothing was replaced: a run's own states and appended rows are no history
    assert merge_results.merge(returned, local) == (0, 1)


def test_a_merge_records_one_replacement_once_and_keeps_each_presets_entry(tmp_path):
    """A copy of the local file that ran an entry again gave two history entries for its one replacement; and an
    object of per-preset entries (mlp_microbench.py's) was merged whole, so a rerun of one preset dropped the others."""
    import importlib.util
    import shutil
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    local, returned = tmp_path / "local.json", tmp_path / "returned.json"
    record(local, ["benchmarks", "x"], {"run_id": "20250101T000000-a"})
    for preset in ("20m", "50m", "90m"):
        record(local, ["mlp-microbench", preset], {"run_id": f"20250101T000000-{preset}"})
    shutil.copy(local, returned)
    record(returned, ["benchmarks", "x"], {"run_id": "20250102T000000-b"})
    record(returned, ["mlp-microbench", "90m"], {"run_id": "20250102T000000-90m"})
    merge_results.merge(returned, local)
    merged = read_results(local)
    assert merged["benchmarks"]["x"]["run_id"] == "20250102T000000-b"
    assert sorted(merged["mlp-microbench"]) == ["20m", "50m", "90m"]
    assert merged["mlp-microbench"]["90m"]["run_id"] == "20250102T000000-90m"
    old = [h["value"]["run_id"] for h in merged["history"]]
    assert sorted(old) == ["20250101T000000-90m", "20250101T000000-a"], old  # each replacement once


def test_history_cannot_be_recorded_over(tmp_path):
    """history is where replaced values go; a run named "history" would have replaced it whole."""
    path = tmp_path / "r.json"
    record(path, ["a"], 1)
    record(path, ["a"], 2)
    with pytest.raises(ResultsFileError, match="'history' holds the file's replaced values"):
        record(path, ["history"], {"run_id": "x"})
    assert read_results(path)["history"][0]["value"] == 1


def test_atomic_writes_keep_the_file_mode_and_give_new_files_the_usual_one(tmp_path):
    path = tmp_path / "results.json"
    record(path, ["a"], 1)
    assert path.stat().st_mode & 0o777 == 0o666 & ~_UMASK  # as open() would create it, not 0600
    path.chmod(0o640)
    record(path, ["b"], 2)
    assert path.stat().st_mode & 0o777 == 0o640


def test_a_results_file_that_is_a_folder_is_one_clear_error(tmp_path):
    with pytest.raises(ResultsFileError, match="cannot be read"):
        read_results(tmp_path)


def test_a_config_file_may_import_modules(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("import math\nlearning_rate = math.sqrt(4e-6)\n")
    assert configurator.load_config(train.DEFAULTS, [str(path)])["learning_rate"] == pytest.approx(2e-3)


def test_a_config_file_is_python_that_sees_the_settings_so_far(tmp_path):
    """As nanoGPT's configurator: names imported from modules are not keys, a comprehension sees the names above
    it, and an expression may use a default the file does not set. Each of these failed before."""
    first, path = tmp_path / "first.py", tmp_path / "c.py"
    first.write_text("seq_len = 256\n")
    path.write_text("from math import sqrt\n"
                    "tokens_per_update = seq_len * 64\n"  # seq_len from the file before
                    "epochs = sum(1 for _ in range(tokens_per_update // 4096))\n"  # an earlier name, in a generator
                    "learning_rate = sqrt(4e-6) * (warmup_updates / 100)\n")  # a default this file does not set
    config = configurator.load_config(train.DEFAULTS, [str(first), str(path)])
    assert config["tokens_per_update"] == 256 * 64 and config["epochs"] == 4
    assert config["learning_rate"] == pytest.approx(2e-3)
    path.write_text("def twice(x):\n    return 2 * x\nbatch = twice(8)\n")
    with pytest.raises(configurator.ConfigError, match="unknown config key 'batch'"):  # helpers are fine; settings are keys
        configurator.load_config(train.DEFAULTS, [str(path)])


def test_gpu_scripts_refuse_a_broken_results_file_before_any_work(tmp_path, monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check, as on the device
    broken = tmp_path / "r.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        common.check_gpu_script(argparse.ArgumentParser(prog="x"), broken, "attention")
    assert exit_info.value.code == 2 and str(broken) in capsys.readouterr().err
    common.check_gpu_script(argparse.ArgumentParser(prog="x"), tmp_path / "new.json", "attention")  # a new file is fine


def test_the_gpu_scripts_name_lists_take_spaces_and_refuse_unknown_or_no_names(capsys):
    parser = argparse.ArgumentParser(prog="x")
    assert common.names_in(parser, "--presets", "20m, 50m,", ("20m", "50m", "90m")) == ["20m", "50m"]
    for text, said in (("20m,70m", "--presets: 70m not among 20m, 50m, 90m"), (" , ", "--presets: no name not among")):
        with pytest.raises(SystemExit) as exit_info:
            common.names_in(parser, "--presets", text, ("20m", "50m", "90m"))
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_the_gpu_scripts_table_has_a_row_per_variant_and_errors_in_theirs(capsys):
    common.print_variants("backend", {"cudnn": {"ms": 0.07112, "err": 2.41e-3}, "fa4": {"error": "ValueError: gone"}},
                       [("kernel ms", "ms", ".3f"), ("grad err", "err", ".2e")])
    header, cudnn, fa4 = capsys.readouterr().out.splitlines()
    assert header.split() == ["backend", "kernel", "ms", "grad", "err"]
    assert cudnn.split() == ["cudnn", "0.071", "2.41e-03"] and fa4 == "fa4              error: ValueError: gone"
    assert len(cudnn) == len(header)  # the columns line up under their headers


def test_merge_script_refuses_a_missing_source(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    assert merge_results.main([str(tmp_path / "typo.json"), str(tmp_path / "into.json")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "into.json").exists()
    record(tmp_path / "from.json", ["benchmarks", "x"], {"run_id": "20250101T000000-a"})  # a mistyped INTO: refused,
    assert merge_results.main([str(tmp_path / "from.json"), str(tmp_path / "int.json")]) == 2  # not a new file
    assert "int.json does not exist; give the results file to merge into" in capsys.readouterr().err
    assert not (tmp_path / "int.json").exists()
    (tmp_path / "folder").mkdir()  # a folder was said not to exist
    assert merge_results.main([str(tmp_path / "from.json"), str(tmp_path / "folder")]) == 2
    assert "folder is not a file; give the results file to merge into" in capsys.readouterr().err


def test_the_longest_matching_gpu_name_sets_the_peak(monkeypatch):
    monkeypatch.setattr(env, "PEAK_BF16_FLOPS", {"H200": 1.0, "GH200": 2.0, "A100": 3.0})
    assert env.peak_flops("NVIDIA GH200 480GB") == 2.0  # "H200" is in that name too
    assert env.peak_flops("NVIDIA H200") == 1.0 and env.peak_flops("Other") is None


@pytest.mark.parametrize("script, arg, words", [
    ("ce_rows_sweep.py", "--reps=0", "argument --reps: must be at least 1, got 0"),
    ("loss_microbench.py", "--tokens=ten", "argument --tokens: expected a whole number, got 'ten'"),
    ("eval_speed.py", "--device=cpu", "--device=cpu gives the CPU")])
def test_gpu_scripts_refuse_bad_arguments_in_one_line(tmp_path, script, arg, words):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / script), arg,
                             f"--results_file={tmp_path / 'r.json'}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(words)
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("script", ["ce_rows_sweep.py", "loss_microbench.py", "attention_microbench.py",
                                    "eval_speed.py", "ceilings.py", "accumulation_check.py"])
def test_gpu_scripts_say_in_one_line_that_they_need_a_gpu(tmp_path, script):
    """The GPU microbenchmarks on a machine without CUDA: exit 2 with one sentence, no traceback, no file."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / script), f"--results_file={tmp_path / 'r.json'}"],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith("PyTorch sees no CUDA GPU here") or "PyTorch sees none; pass --device=cpu" in last, last
    assert not (tmp_path / "r.json").exists()


def test_a_renamed_key_is_refused_with_its_new_name(tmp_path):
    """sdpa_backend became attention_backend: an old config or override says so instead of a near match."""
    with pytest.raises(configurator.ConfigError, match="'sdpa_backend' is now called 'attention_backend'"):
        configurator.load_config(train.DEFAULTS, ["--sdpa_backend=cudnn"])
    old = tmp_path / "old.py"
    old.write_text("sdpa_backend = 'cudnn'\n")
    with pytest.raises(configurator.ConfigError, match=f"config file {old}: config key 'sdpa_backend' is now called"):
        configurator.load_config(train.DEFAULTS, [str(old)])


def test_the_results_file_is_json_with_one_line_per_point_of_a_curve(tmp_path):
    path = tmp_path / "r.json"
    entry = {"status": "complete", "validation_curve": [{"epoch": 1, "loss": 4.5}, {"epoch": 2, "loss": 4.2}],
             "interval_tokens_per_second": [1.0, 2.0, 3.0], "nested": {"deeper": {"list": [[1, 2], [3]]}},
             "empty": {}, "path": Path("out/x")}
    record(path, ["run"], entry)
    text = path.read_text()
    assert json.loads(text)["run"] == json.loads(json.dumps(entry, default=str))
    lines = text.splitlines()
    assert '      {"epoch": 1, "loss": 4.5},' in lines and '    "interval_tokens_per_second": [1.0, 2.0, 3.0],' in lines


def test_accumulation_check_judges_nothing_but_records_all_when_its_reference_fails(tmp_path, monkeypatch, capsys):
    """The reference variant (eager, micro-batch 32) out of memory: every other variant was judged against None and
    the script died before recording the GPU work. And a run of fewer than 5 updates averaged them over 5."""
    from scripts import accumulation_check as script
    monkeypatch.setattr(script.plan_lib, "resolve", lambda *args, **kwargs: None)  # no GPU here: the run is faked

    def losses_of(cfg, mode, micro, updates):
        if (mode, micro) == ("eager", 32):
            raise RuntimeError("CUDA out of memory")
        return [3.0] * updates, 1.0
    monkeypatch.setattr(script, "losses_of", losses_of)
    results = tmp_path / "r.json"
    assert script.main([str(REPO / "config" / "tiny_cpu.py"), "--updates=2", f"--results_file={results}"]) == 1
    variants = read_results(results)["accumulation-check"]["variants"]
    assert variants["eager-mb32"]["error"] == "RuntimeError: CUDA out of memory"
    assert {name: v["last5"] for name, v in variants.items() if name != "eager-mb32"} == dict.fromkeys(
        [f"{mode}-mb{micro}" for mode, micro in script.VARIANTS[1:]], 3.0)  # the mean of its 2 updates
    assert capsys.readouterr().out.count("not judged: the reference failed") == len(script.VARIANTS) - 1


def test_accumulation_check_fails_a_gradient_accumulated_at_the_wrong_scale(tmp_path, monkeypatch, capsys):
    """Gradients 4x too large at micro-batch 8 under compile: AdamW's steps hid it from the loss (-0.0068 against a
    tolerance of 0.01, passed); the first update's gradient norm shows it."""
    from scripts import accumulation_check as script
    monkeypatch.setattr(script.plan_lib, "resolve", lambda *args, **kwargs: None)  # no GPU here: the run is faked

    def losses_of(cfg, mode, micro, updates):
        scale = 32 // micro if mode != "eager" and micro == 8 else 1
        return [6.70977 - 0.0068 * (scale > 1)] * updates, 1.078 * scale * (1 + 1e-4 * (micro == 8))
    monkeypatch.setattr(script, "losses_of", losses_of)
    results = tmp_path / "r.json"
    assert script.main([str(REPO / "config" / "tiny_cpu.py"), "--updates=2", f"--results_file={results}"]) == 1
    variants = read_results(results)["accumulation-check"]["variants"]
    assert [n for n, v in variants.items() if not v["passed"]] == ["default-mb8", "reduce-overhead-mb8"]


def test_merging_keeps_an_earlier_run_of_the_same_name_in_the_history(tmp_path):
    """FROM's run older than INTO's of the same name (another run_id) was dropped as stale: a run lost for good."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("merge_results", REPO / "scripts" / "merge_results.py")
    merge_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_results)
    local, returned = tmp_path / "local.json", tmp_path / "returned.json"
    record(local, ["foo"], {"run_id": "20240102T000000-1-bbbbbb", "status": "complete", "step": 9})
    earlier = {"run_id": "20240101T000000-1-aaaaaa", "status": "complete", "step": 9}
    record(returned, ["foo"], earlier)
    record(returned, ["evaluation", "e"], {"timestamp": 1.0, "loss": 2.0})
    record(local, ["evaluation", "e"], {"timestamp": 2.0, "loss": 3.0})
    record(returned, ["lever-screens", "qk"], {"loss": 4.2})  # a named section: joined entry by entry
    record(local, ["lever-screens", "relu2"], {"loss": 4.3})
    assert merge_results.merge(returned, local) == (1, 2)
    merged = read_results(local)
    assert merged["foo"]["run_id"].startswith("20240102") and merged["evaluation"]["e"]["loss"] == 3.0
    assert [h["value"] for h in merged["history"]] == [earlier, {"timestamp": 1.0, "loss": 2.0}]
    assert set(merged["lever-screens"]) == {"qk", "relu2"}
    assert merge_results.merge(returned, local) == (0, 2) and len(read_results(local)["history"]) == 2  # once


def test_accumulation_check_trains_past_an_epoch(text_cache, tmp_path):
    """--updates beyond one epoch read epoch 0 past its end: empty batches, a ZeroDivisionError in every variant."""
    import math
    import settings
    from scripts import accumulation_check as script
    cfg = settings.Config(settings.defaults(script.AccumulationSettings), data_dir=str(text_cache), dim=32,
                          n_layers=1, n_heads=2, hidden_dim=64, seq_len=32, tokens_per_update=256, micro_batch_size=8,
                          device="cpu", cpu_threads=1, train_subset_tokens=2_000, eval_interval=0, val_subset_tokens=0,
                          results_file=str(tmp_path / "r.json"), out_dir=str(tmp_path / "o"))
    plan = script.plan_lib.resolve(cfg, script.AccumulationSettings, world=(0, 0, 1))
    per_epoch = script.plan_lib.training_data(plan).updates_per_epoch
    losses, norm = script.losses_of(cfg, "eager", 8, per_epoch + 2)
    assert len(losses) == per_epoch + 2 and all(math.isfinite(x) for x in losses) and norm > 0


def test_reproduce_h200_fails_when_its_commands_fail_from_any_folder(tmp_path):
    """Every command failing (no GPU here) ended with exit 0, and started from another folder it ran nothing right."""
    results = tmp_path / "r.json"
    results.write_text("{}")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    out = subprocess.run(["bash", str(REPO / "scripts" / "reproduce_h200.sh"), "ceilings", "--", "r.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, PATH=path))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "sees no CUDA GPU here" in out.stderr and "a command above failed" in out.stderr


def test_the_gpu_scripts_table_shows_a_missing_figure_as_a_dash(capsys, monkeypatch):
    """loss_microbench.py leaves a variant's gradient errors None where the eager full loss (their reference) failed;
    formatting None with a number's spec was a TypeError after the GPU work."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import common
    common.print_variants("variant", {"fused": {"ms": 1.5, "err": None}, "full-eager": {"error": "OOM"}},
                          [("ms", "ms", ".3f"), ("grad error", "err", ".2e")])
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split() == ["fused", "1.500", "-"] and rows[2].split()[:2] == ["full-eager", "error:"]
