"""env.py's machine facts: SLURM's accounting, the MFU peak's whole-word match, the CPU's name, the fingerprint."""
import datetime
import io

import pytest

import env


def test_allocation_usage_reads_the_older_slurm_jobid():
    """SLURM_JOBID (older SLURM, and srun steps) names the job as SLURM_JOB_ID does: without it, no usage at all."""
    usage = env.allocation_usage({"SLURM_JOBID": "77", "SLURM_GPUS_ON_NODE": "1"}, now=0)
    assert usage is not None and usage["job_id"] == "77" and usage["gpus"] == 1


def test_allocation_usage_gives_the_jobs_start_and_end_as_local_times():
    now = 1_750_000_000
    usage = env.allocation_usage({"SLURM_JOB_ID": "1", "SLURM_JOB_START_TIME": str(now - 3600),
                                  "SLURM_JOB_END_TIME": str(now + 7200)}, now=now)
    assert usage["start_local"] == datetime.datetime.fromtimestamp(now - 3600).isoformat()
    assert usage["end_local"] == datetime.datetime.fromtimestamp(now + 7200).isoformat()
    assert env.allocation_usage({"SLURM_JOB_ID": "1"}, now=now)["end_local"] is None


def test_allocation_usage_with_an_unreadable_gpu_count_gives_no_gpu_hours_rather_than_zero():
    """A GPU count SLURM spelled in a way not read here is unknown (null), not zero GPUs and zero GPU-hours."""
    now = 1_750_000_000
    usage = env.allocation_usage({"SLURM_JOB_ID": "1", "SLURM_GPUS": "h100:four",
                                  "SLURM_JOB_START_TIME": str(now - 3600)}, now=now)
    assert usage["gpus"] is None and usage["gpu_hours"] is None and usage["elapsed_seconds"] == 3600


@pytest.mark.parametrize("rate", [None, 0])
def test_mfu_without_a_rate_is_null(rate):
    """metrics.py passes None for a run without training seconds: MFU is then null, not a TypeError or 0 %."""
    assert env.mfu(6e9, rate, "NVIDIA H100 80GB HBM3") is None
    assert env.mfu(6e9, 1000.0, "NVIDIA H100 80GB HBM3") == pytest.approx(6e12 / 989e12)


def test_a_gpu_name_matches_the_peak_table_as_a_whole_word_only(monkeypatch):
    """Without a GH200 row, an H200's peak is no GH200's: "H200" inside "GH200" is no match."""
    monkeypatch.setattr(env, "PEAK_BF16_FLOPS", {"H200": 1.0})
    assert env.peak_flops("NVIDIA GH200 480GB") is None
    assert env.peak_flops("NVIDIA H200") == 1.0


def test_cpu_model_is_the_model_name_line_not_the_model_number(monkeypatch):
    """/proc/cpuinfo's "model" line (a number) comes before its "model name" line."""
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 9654\n"
    monkeypatch.setattr(env, "open", lambda path, *args, **kwargs: io.StringIO(cpuinfo), raising=False)
    assert env.cpu_model() == "AMD EPYC 9654"


def test_fingerprint_records_the_visible_devices_as_the_process_has_them(monkeypatch):
    """CUDA_VISIBLE_DEVICES as it is (left alone: changing it could hide a GPU from the tests after this one)."""
    import os
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # a neighbour, which is not the visible devices
    assert env.fingerprint()["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_package_that_is_not_installed_has_a_null_version():
    """Every package asked for is in the fingerprint's versions: a missing one as null, not left out."""
    from importlib import metadata
    versions = env.package_versions(("torch", "no-such-distribution-tiny-llm"))
    assert versions == {"torch": metadata.version("torch"), "no-such-distribution-tiny-llm": None}
