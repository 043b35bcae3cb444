"""The tests' warning rules reach the ranks a test launches (helpers/warning_filters.py, through PYTHONWARNINGS):
a warning from lightning_3d code fails a rank under torchrun and under the fork launcher alike."""

import textwrap

import pytest

from helpers.launchers import forkrun, torchrun

NO_OP_ZERO = "zero_stage=2 shards over the data-parallel ranks, but dp=1"


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", [torchrun, forkrun], ids=["torchrun", "forkrun"])
def test_a_warning_of_ours_fails_a_launched_rank(tmp_path, launcher):
    script = tmp_path / "warns.py"
    script.write_text(textwrap.dedent("""
        import torch
        from lightning_3d.parallel.config import ParallelConfig
        from lightning_3d.parallel.dims import ParallelDims
        from lightning_3d.parallel.precision import warn_about_no_ops

        warn_about_no_ops(ParallelConfig(zero_stage=2), ParallelDims(dp=1, pp=2, tp=2), torch.device("cpu"))
    """))
    with pytest.raises(AssertionError, match=f"UserWarning: {NO_OP_ZERO}"):
        launcher(1, str(script), timeout=120)
