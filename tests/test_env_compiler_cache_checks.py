"""env.py's compiler caches: the folders in effect, whether Inductor's is empty, and compile seconds by phase."""
import os
from pathlib import Path

import pytest

import env


@pytest.fixture
def no_cache_variables(monkeypatch):
    for variable in (*env.CACHE_VARIABLES, "TRITON_HOME"):
        monkeypatch.delenv(variable, raising=False)


def test_tritons_folder_follows_triton_home_as_triton_does(tmp_path, monkeypatch, no_cache_variables):
    """Triton's default is <TRITON_HOME or ~>/.triton/cache: the fingerprint names the folder its kernels came from."""
    assert env.compiler_cache()["TRITON_CACHE_DIR"] == os.path.join(str(Path.home()), ".triton", "cache")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert env.compiler_cache()["TRITON_CACHE_DIR"] == str(tmp_path / ".triton" / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert env.compiler_cache()["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_relative_inductor_folder_is_recorded_as_an_absolute_path(tmp_path, monkeypatch, no_cache_variables):
    """A relative TORCHINDUCTOR_CACHE_DIR names another folder from each working directory: the entry says which."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "rel/inductor")
    assert env.compiler_cache()["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "rel" / "inductor")


def test_inductors_folder_is_empty_when_missing_or_without_entries_only(tmp_path, monkeypatch):
    """A cold compile is one whose folder holds nothing: a folder made but still empty is cold too."""
    folder = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    assert env.inductor_cache_empty()
    folder.mkdir()
    assert env.inductor_cache_empty()
    (folder / "fxgraph").mkdir()
    assert not env.inductor_cache_empty()


def timers(frame, backend, backward, inductor, wait):
    return {"entire_frame_compile": frame, "backend_compile": backend, "entire_backward_compile": backward,
            "inductor_compile": inductor, "async_compile.wait": wait}


@pytest.mark.parametrize("inductor, wait, expected", [
    # compiled: Inductor's timer holds the wait for Triton's compiles
    (1.5, 0.5, {"dynamo_tracing": 1.0, "aot_autograd": 1.5, "inductor_codegen": 1.0, "triton_compile_wait": 0.5}),
    # from the FX graph cache: Inductor's timer does not run, and the wait (loading the kernels) is AOTAutograd's
    (0.0, 0.5, {"dynamo_tracing": 1.0, "aot_autograd": 2.5, "inductor_codegen": 0.0, "triton_compile_wait": 0.5}),
])
def test_compile_seconds_by_phase_are_those_since_the_mark_and_add_up(monkeypatch, inductor, wait, expected):
    before = ({"compiled": 3, "from_cache": 1, "kernels_from_binaries": 0}, timers(10.0, 6.0, 2.0, 1.0, 1.0))
    after = ({"compiled": 5, "from_cache": 1, "kernels_from_binaries": 4},
             timers(13.0, 8.0, 3.0, 1.0 + inductor, 1.0 + wait))
    monkeypatch.setattr(env, "compile_totals", lambda: after)
    graphs, seconds = env.compiled_since(before)
    assert graphs == {"compiled": 2, "from_cache": 0, "kernels_from_binaries": 4}
    assert seconds == pytest.approx(dict(expected, compile_total=4.0))
    assert sum(v for k, v in seconds.items() if k != "compile_total") == pytest.approx(seconds["compile_total"])
