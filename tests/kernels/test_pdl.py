"""Programmatic dependent launch (kernels/pdl.py) stays off where the interpreter runs the kernels."""
import torch

from specserve.kernels.pdl import pdl_args


def test_the_cpu_launches_without_pdl_and_the_flag_follows_the_launch():
    # The interpreter has no grid dependency to wait on; a launch with PDL whose kernel did not wait would race.
    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
