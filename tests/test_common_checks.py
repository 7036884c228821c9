"""scripts/common.py: the relative error the GPU scripts report, and where their results go by default."""
import argparse

import pytest
import torch

import settings
from scripts import common


def test_relative_error_is_the_differences_norm_over_the_references():
    reference = torch.tensor([3.0, 4.0])
    assert common.relative_error(torch.tensor([3.0, 9.0]), reference) == pytest.approx(1.0)
    assert common.relative_error(torch.tensor([0.0, 0.0]), reference) == pytest.approx(1.0)
    assert common.relative_error(reference.clone(), reference) == 0.0


def test_the_gpu_scripts_record_into_the_results_file_train_py_does_under_their_own_name():
    parser = argparse.ArgumentParser()
    common.add_run_arguments(parser, "loss-microbench", reps=20)
    args = parser.parse_args([])
    assert (args.reps, args.name) == (20, "loss-microbench")
    assert args.results_file == settings.defaults(settings.TrainSettings)["results_file"]
