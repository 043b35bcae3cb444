"""The tests' warning rules (helpers/warning_filters.py): a warning from lightning_3d code -- ours, or a deprecation
torch or Lightning reports at our call -- fails the test that provokes it (in the ranks it launches:
launch/test_warning_filters_in_ranks.py)."""

import warnings

import pytest
import torch

from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.parallel.precision import warn_about_no_ops

NO_OP_ZERO = "zero_stage=2 shards over the data-parallel ranks, but dp=1"


def test_a_warning_of_ours_is_an_error_in_the_test_process():
    with pytest.raises(UserWarning, match=NO_OP_ZERO):
        warn_about_no_ops(ParallelConfig(zero_stage=2), ParallelDims(dp=1, pp=2, tp=2), torch.device("cpu"))


def test_a_deprecation_reported_at_our_call_is_an_error():
    # What torch's @deprecated does when lightning_3d.strategies.three_d calls a deprecated function.
    with pytest.raises(FutureWarning, match="old_api is deprecated"):
        warnings.warn_explicit("old_api is deprecated", FutureWarning, "three_d.py", 1,
                               module="lightning_3d.strategies.three_d")
