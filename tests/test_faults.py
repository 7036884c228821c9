"""Faults a real run meets (issue #42): its output's reader going away, a hang-up, a signal sent twice, a full
disk, a results file that is a link, a device or not UTF-8, and inputs that passed silently or as a traceback.
Signals and pipes go to real train.py and data/prepare.py subprocesses; the model and data are the smallest."""
import errno
import gzip
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import bench
import checkpoint
import configurator
import results
import sample
import train
from configurator import ConfigError
from data import loader
from data.prepare import PrepareError, prepare
from results import ResultsFileError, check_writable, read_results, record
from tests.conftest import write_cache
from tests.test_prepare import alive, descendants
from tests.test_train import REPO, cli_args, small_config

TINY = dict(dim=32, n_layers=1, hidden_dim=64, full_validation=False, val_subset_tokens=4 * 64)


def tiny_config(cache, tmp_path, **overrides):
    return small_config(cache, tmp_path, **{**TINY, **overrides})


def start_train(cfg, **popen):
    """train.py on cfg as its own process, its output (stdout and stderr) into one pipe unless told otherwise."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *cli_args(cfg)], cwd=REPO, text=True, **popen)


def read_until(proc, words, timeout=120):
    """The lines proc prints up to the first that holds `words`."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"train.py ended (exit {proc.wait()}) before printing {words!r}:\n{''.join(lines)}")
        lines.append(line)
        if words in line:
            return lines
    raise AssertionError(f"no {words!r} within {timeout} s")


def finish(proc, timeout=120):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_checkpointed_stop(cfg, tmp_path):
    entry = read_results(cfg.results_file)["t"]
    assert entry["status"] == "interrupted" and 0 < entry["step"] < entry["total_updates"], entry.get("error")
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)["step"] == entry["step"]


# ---------------------------------------------------------------- work lost: the output, a hang-up, signals

LONG = dict(epochs=10, train_subset_tokens=0, log_interval=10**6)  # ~2,300 updates, only the epochs' lines


@pytest.mark.parametrize("fault", ["SIGTERM with the output's pipe closed", "SIGHUP"])
def test_a_stop_signal_checkpoints_even_with_no_reader_left_or_as_a_hang_up(text_cache, tmp_path, fault):
    """Cases 1 and 4: the handler's own acknowledgement raised BrokenPipeError (the run failed, no checkpoint);
    SIGHUP (a terminal closed without nohup) killed the process and left its entry "running"."""
    cfg = tiny_config(text_cache, tmp_path, **LONG)
    # a terminal's hang-up, whatever ran the tests: under nohup the child would inherit an ignored SIGHUP
    proc = start_train(cfg, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    read_until(proc, "first update")
    if fault.startswith("SIGTERM"):
        proc.stdout.close()  # the ssh session dropped, the tee killed: nobody reads stdout and stderr any more
        proc.send_signal(signal.SIGTERM)
        assert finish(proc) == train.EXIT_INTERRUPTED
    else:
        proc.send_signal(signal.SIGHUP)
        assert finish(proc) == train.EXIT_INTERRUPTED
        assert "signal SIGHUP: checkpointed" in proc.stdout.read()
    assert_checkpointed_stop(cfg, tmp_path)


def test_a_reader_that_stops_early_costs_the_run_nothing(text_cache, tmp_path):
    """Case 3: `train.py ... | head -n 2` failed the run at the next log line (BrokenPipeError, a traceback)."""
    cfg = tiny_config(text_cache, tmp_path, epochs=1, train_subset_tokens=40 * 8 * 64 + 1, log_interval=1)
    command = f"{shlex.join([sys.executable, str(REPO / 'train.py'), *cli_args(cfg)])} | head -n 2; " \
              "exit ${PIPESTATUS[0]}"
    done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]
    entry = read_results(cfg.results_file)["t"]
    assert entry["status"] == "complete" and entry["step"] == 40


def test_the_stop_signal_sent_again_as_the_run_ends_keeps_exit_status_3(text_cache, tmp_path):
    """Case 5: SIGTERM twice, 0.3 s apart: the second came after the run had put the default handler back, and
    killed the checkpointed process (exit -15)."""
    cfg = tiny_config(text_cache, tmp_path, **dict(LONG, log_interval=10))
    proc = start_train(cfg)
    read_until(proc, "update 10/")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert finish(proc) == train.EXIT_INTERRUPTED
    assert_checkpointed_stop(cfg, tmp_path)


def test_a_hang_up_that_nohup_ignores_stays_ignored():
    """SIGHUP is a stop only where the process does not ignore it: under nohup the run carries on."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop = train.StopRequest()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop.restore()
    finally:
        signal.signal(signal.SIGHUP, previous)


# ---------------------------------------------------------------- work lost: prepare's workers

def test_the_tokenizing_workers_die_with_a_killed_prepare(tmp_path):
    """Case 18: after kill -9 of data/prepare.py, its 3 tokenizing workers ran on for 15 s and more."""
    from tests.test_sample import bpe_tokenizer
    src = tmp_path / "src"
    src.mkdir()
    texts = [" ".join(f"word{(i * 7919 + j) % 5003} and {j}" for j in range(7000)) for i in range(60)]
    for i, text in enumerate(texts):  # ~9 MB: each worker tokenizes its third for well over 10 s
        (src / f"d{i:02d}.txt").write_text(text)
    bpe_tokenizer(texts[0], 400).save_pretrained(tmp_path / "tok")
    run = subprocess.Popen([sys.executable, str(REPO / "data" / "prepare.py"), "--source", str(src), "--out",
                            str(tmp_path / "cache"), "--tokenizer", str(tmp_path / "tok"), "--num_proc", "3"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers, deadline = set(), time.time() + 90
    try:
        while len(workers) < 3 and run.poll() is None and time.time() < deadline:
            if list(tmp_path.glob("cache.tmp-*/tokenizer.json")):  # saved just before the tokenizing pool starts
                workers = descendants(run.pid)
            time.sleep(0.05)
        assert len(workers) >= 3, f"no tokenizing workers seen; exit code {run.poll()}"
        run.kill()
        run.wait()
        deadline = time.time() + 5
        while any(map(alive, workers)) and time.time() < deadline:
            time.sleep(0.05)
        left = [pid for pid in workers if alive(pid)]
    finally:
        for pid in descendants(run.pid) | workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:
            run.kill()
    assert not left, f"{len(left)} of {len(workers)} workers outlived the killed prepare"


# ---------------------------------------------------------------- work written to the wrong place

def test_a_results_file_that_is_a_link_is_written_through_it(tmp_path):
    """Case 2: the atomic replace swapped the link for a plain file, and the real file never got the entry."""
    real = tmp_path / "results" / "h200.json"
    real.parent.mkdir()
    real.write_text('{"kept": 1}\n')
    link = tmp_path / "results.json"
    link.symlink_to(real)
    record(link, ["benchmarks", "new"], {"tokens_per_second": 2.0})
    results.append(link, ["notes"], "appended")
    check_writable(link)
    assert link.is_symlink() and link.resolve() == real
    assert read_results(real) == {"kept": 1, "benchmarks": {"new": {"tokens_per_second": 2.0}}, "notes": ["appended"]}
    assert (tmp_path / "results" / "h200.json.lock").exists()  # one lock for every writer of that file
    assert not (tmp_path / "results.json.lock").exists()  # none beside the link, which another writer would miss
    results.atomic_write_text(link, "{}\n")  # and every other atomic write (a checkpoint, say) goes through too
    assert link.is_symlink() and real.read_text() == "{}\n"


# ---------------------------------------------------------------- wrong results, silently

def test_an_empty_validation_split_is_refused(text_cache, tmp_path, capsys):
    """Case 6: the run ended complete, its validation-subset loss 0.0 over 0 tokens, below any target."""
    cache = write_cache(tmp_path / "empty-val", np.asarray(loader.TokenCache(text_cache).train), [], 256)
    assert train.main(cli_args(tiny_config(cache, tmp_path, epochs=1))) == 2
    err = capsys.readouterr().err
    assert "val split is empty" in err and "val.bin" in err and err.count("\n") == 1
    assert not (tmp_path / "results.json").exists()


def test_a_config_file_that_calls_exit_is_refused(tmp_path, capsys):
    """Case 10: sys.exit(0) in a config file ended train.py with status 0, nothing done and nothing said."""
    config = tmp_path / "c.py"
    config.write_text("import sys\nepochs = 3\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=r"called exit\(0\); a config file assigns settings"):
        configurator.load_config(train.DEFAULTS, [str(config)])
    assert train.main([str(config)]) == 2
    assert "called exit(0)" in capsys.readouterr().err


def test_sample_refuses_a_number_of_new_tokens_it_would_never_finish(tmp_path, capsys):
    """Case 11: --max_new_tokens=1000000000 was accepted, and generated for ever, printing nothing."""
    assert sample.main([f"--out_dir={tmp_path}", "--max_new_tokens=1000000000", "--device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "max_new_tokens must be at most 100,000" in err and "1,000,000,000" in err
    assert sample.new_tokens_problem(sample.MAX_NEW_TOKENS) is None


def test_bench_refuses_a_benchmarks_section_that_is_not_an_object_before_the_work(text_cache, tmp_path,
                                                                                 monkeypatch, capsys):
    """Case 12: bench.py ran the whole benchmark, then failed to record it: the figures were lost."""
    path = tmp_path / "results.json"
    path.write_text('{"benchmarks": []}\n')
    monkeypatch.setattr(bench, "run_protocol", lambda cfg: pytest.fail("the benchmark ran"))
    argv = ["--dim=32", "--n_layers=1", "--n_heads=2", "--hidden_dim=64", "--seq_len=64", "--device=cpu",
            f"--data_dir={text_cache}", f"--results_file={path}"]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "its section 'benchmarks' is a list, not an object of entries" in err and err.count("\n") == 1
    assert path.read_text() == '{"benchmarks": []}\n'
    path.write_text('{"profiles": {"x": 3}}')  # a section given as its keys, checked at each level
    with pytest.raises(ResultsFileError, match="its section 'profiles.x' is a int"):
        check_writable(path, sections=[["profiles", "x"]])
    check_writable(path, sections=["benchmarks", ["benchmarks", "x"], "profiles"])  # absent, or objects: fine


# ---------------------------------------------------------------- tracebacks

class SmallDisk(io.FileIO):
    """A file on a filesystem of `capacity` bytes that the folder's other files fill: a write past it fails as a
    full tmpfs's does."""
    capacity = 0

    def write(self, data):
        folder = Path(os.readlink(f"/proc/self/fd/{self.fileno()}")).parent
        used = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        if used + len(data) > self.capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_a_full_disk_at_the_checkpoint_is_one_line_and_keeps_the_last_checkpoint(text_cache, tmp_path, monkeypatch,
                                                                               capsys):
    """Case 13: torch.save's `RuntimeError: [enforce fail at inline_container.cc]`, a traceback."""
    cfg = tiny_config(text_cache, tmp_path, epochs=2)
    out = tmp_path / "out"
    real_fdopen = os.fdopen
    saves = []

    def fdopen(fd, *args, **kwargs):  # the checkpoint's temporary file is on a disk that holds ~1.5 checkpoints
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(out)):
            return real_fdopen(fd, *args, **kwargs)
        saves.append(fd)
        SmallDisk.capacity = int(1.5 * (out / "ckpt.pt").stat().st_size) if (out / "ckpt.pt").exists() else 10**9
        return io.BufferedWriter(SmallDisk(fd, "wb"))
    monkeypatch.setattr(results.os, "fdopen", fdopen)
    assert train.main(cli_args(cfg)) == 2
    monkeypatch.undo()
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("error", "Traceback"))]
    assert len(saves) == 2 and len(err) == 1, err
    assert f"out_dir {out}" in err[0] and "(No space left on device)" in err[0] and "intact" in err[0], err[0]
    kept = checkpoint.read(out / "ckpt.pt")
    assert kept["epoch"] == 1 and sorted(p.name for p in out.iterdir()) == ["ckpt.pt", "run.lock"]
    entry = read_results(cfg.results_file)["t"]
    assert entry["status"] == "failed" and "No space left on device" in entry["error"]


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_a_compressed_source_file_that_does_not_decompress_is_named(tmp_path, damage):
    """Case 14: EOFError or BadGzipFile from the diagnosis, a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("A first document, whole. " * 50)
    whole = gzip.compress(("The second document, cut short by an interrupted download. " * 400).encode())
    (src / "b.txt.gz").write_bytes(whole[:len(whole) // 2] if damage == "truncated" else os.urandom(2000))
    with pytest.raises(PrepareError, match=r"--source file '.*b\.txt\.gz' does not decompress as \.gz data "
                                           r"\((EOFError|BadGzipFile): .*truncated \(an interrupted download\?\)"):
        prepare(src, tmp_path / "cache", vocab_size=300, num_proc=1)


def test_a_results_file_that_is_not_utf8_is_one_clear_error(text_cache, tmp_path, capsys):
    """Case 15: a hand-edited note in Latin-1 was a UnicodeDecodeError from read_results."""
    path = tmp_path / "results.json"
    path.write_bytes('{"note": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ResultsFileError, match="is not UTF-8 text: byte 13 is 0xe9"):
        read_results(path)
    assert train.main(cli_args(tiny_config(text_cache, tmp_path))) == 2
    assert "not UTF-8" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_results_file_that_is_not_a_regular_file_is_refused(tmp_path):
    """Case 16: --results_file=/dev/full read for ever, until memory ran out; a named pipe blocked."""
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)

    def writer():  # for the old behaviour: a reader of the pipe gets a byte, not a hang
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader yet
                time.sleep(0.05)
                continue
            os.write(fd, b"x")
            os.close(fd)
            return
    threading.Thread(target=writer, daemon=True).start()
    with pytest.raises(ResultsFileError, match="is not a regular file"):
        check_writable(fifo)
    # /dev/full, in a process whose memory is bounded: before, it read zeros until a MemoryError
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); import results\n"
            "try:\n    results.check_writable('/dev/full')\nexcept results.ResultsFileError as exc:\n"
            "    sys.exit(f'error: {exc}')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "error: results file /dev/full is not a regular file" in done.stderr, done.stderr[-1000:]


# ---------------------------------------------------------------- also

def test_an_out_folder_inside_a_flat_source_is_no_part_of_it(tmp_path):
    """Case 19: the second identical run was refused ("mixes file types"): the cache's own files had become part
    of the source."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"d{i}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20)
    first = prepare(src, src / "cache", vocab_size=300, num_proc=1)
    again = prepare(src, src / "cache", vocab_size=300, num_proc=1)
    assert again["cache_identity"] == first["cache_identity"] and again["train_documents"] == 3


def jsonl_source(folder, n=6):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 20} for i in range(n)]
    (folder / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_every_cache_prepared_inside_a_source_is_no_part_of_it(tmp_path):
    """A second cache in the source read the first one's meta.json and tokenizer files as JSON documents; a killed
    build's folder (beside its lock) is no part of it either."""
    src = jsonl_source(tmp_path / "src")
    first = prepare(src, src / "a", vocab_size=300, num_proc=1)
    (src / "a.tmp-999").mkdir()  # a build killed before its meta.json: a.lock beside it says whose it is
    (src / "a.tmp-999" / ".prepare-aside").touch()  # as prepare marks its builds (data/sources.py, start_build)
    (src / "a.tmp-999" / "dataset_info.json").write_text('{"text": "not a document"}')
    second = prepare(src, src / "b", vocab_size=300, num_proc=1)
    assert second["source_sha256"] == first["source_sha256"] and second["cache_identity"] == first["cache_identity"]


def test_a_folder_named_like_a_build_or_an_old_copy_is_left_alone(tmp_path):
    """Any DIR.old-* was put back as the cache, or deleted; any DIR.tmp-* deleted: only DIR.old-PID and
    DIR.tmp-PID are prepare's."""
    src, out = jsonl_source(tmp_path / "src"), tmp_path / "cache"
    prepare(src, out, vocab_size=300, num_proc=1)
    shutil.copytree(out, tmp_path / "cache.old-keep")  # the user's backup of a cache
    (tmp_path / "cache.tmp-notes").mkdir()
    prepare(src, out, vocab_size=300, num_proc=1)  # up to date: clears what a killed run left
    assert (tmp_path / "cache.old-keep" / "meta.json").is_file() and (tmp_path / "cache.tmp-notes").is_dir()
    shutil.rmtree(out)
    prepare(src, out, vocab_size=300, num_proc=1)  # a killed swap's DIR.old-PID would be put back
    assert (tmp_path / "cache.old-keep" / "meta.json").is_file()


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.json", "\n  \n")])
def test_a_json_file_with_no_rows_is_named_in_one_line(tmp_path, name, content):
    """datasets raises with an empty message there, whose first line was an IndexError."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / name).write_text(content)
    with pytest.raises(PrepareError, match=rf"--source file '.*{name}' holds no rows"):
        prepare(tmp_path / "src", tmp_path / "cache", vocab_size=300, num_proc=1)
    from data.diagnose import first_line
    assert first_line(ValueError("")) == "ValueError" and first_line(ValueError("a\nb")) == "a"


def test_files_and_options_that_train_and_val_folders_leave_out_are_noted(tmp_path, capsys):
    from data.prepare import main as prepare_main
    src = tmp_path / "src"
    for split in ("train", "val", "validation", "test"):
        jsonl_source(src / split, n=3)
    (src / "extra.jsonl").write_text((src / "train" / "docs.jsonl").read_text())
    prepare_main(["--source", str(src), "--out", str(tmp_path / "cache"), "--vocab_size", "300", "--num_proc", "1",
                  "--val_fraction", "0.2", "--seed", "3"])
    out = capsys.readouterr().out
    assert "note: 3 data files of" in out and "left out (extra.jsonl, test/docs.jsonl, validation/docs.jsonl)" in out
    assert "note: --val_fraction 0.2 was ignored: the split is the source's own (folders train/ and val/)" in out
    assert "note: --seed 3 was ignored" in out
    for other in ("val", "validation"):  # train/ and test/: the test documents were pooled into training, unsaid
        shutil.rmtree(src / other)
    prepare_main(["--source", str(src), "--out", str(tmp_path / "tt"), "--vocab_size", "300", "--num_proc", "1"])
    assert json.loads((tmp_path / "tt" / "meta.json").read_text())["split_rule"] == "folders train/ and test/"


def test_a_config_file_with_a_utf8_bom_is_read_as_python_reads_it(tmp_path):
    """Case 20: a BOM (Windows editors) was a SyntaxError although Python runs such a file."""
    config = tmp_path / "c.py"
    config.write_text("# written on Windows\nepochs = 3\nname = 'caf\u00e9'\n", encoding="utf-8-sig")
    assert config.read_bytes().startswith(b"\xef\xbb\xbf")
    loaded = configurator.load_config(train.DEFAULTS, [str(config)])
    assert loaded["epochs"] == 3 and loaded["name"] == "caf\u00e9"


def test_relative_paths_from_another_folder_and_a_folder_as_config_file_say_what_happened(tmp_path, monkeypatch):
    """Case 21: from another folder the repository's cache "has no meta.json; prepare it first", and a folder
    given as the config file "does not exist"."""
    repo = tmp_path / "proj"
    (repo / "config").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a folder; pass a file such as config/tiny_cpu.py"):
        configurator.load_config(train.DEFAULTS, [str(repo / "config")])
    write_cache(repo / "data" / "cache" / "c", list(range(200)), list(range(50)), 256)
    (repo / "config" / "c.py").write_text("epochs = 1\n")
    monkeypatch.setattr(loader, "REPO", repo)
    monkeypatch.setattr(configurator, "REPO", repo)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(loader.CacheError) as info:
        loader.TokenCache("data/cache/c")
    assert f"relative paths are taken from the current folder {elsewhere}" in str(info.value)
    assert f"data_dir={repo / 'data' / 'cache' / 'c'}" in str(info.value)
    with pytest.raises(ConfigError, match=f"relative paths are taken from the current folder {elsewhere}"):
        configurator.load_config(train.DEFAULTS, ["config/c.py"])
    with pytest.raises(loader.CacheError, match="has no meta.json; prepare it first"):  # nowhere: as before
        loader.TokenCache("data/cache/none")
