"""Files that would run code when read are refused (lightning_3d.checkpoint.safe_load); our own files still load."""

import json
import os
import sys

import pytest

from helpers import WORKERS
from helpers.launchers import run_to_end


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("safe_load")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_to_end([sys.executable, str(WORKERS / "safe_load_worker.py"), str(out)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def test_our_own_checkpoint_resumes_converts_and_starts_a_run(results):
    """Its metadata holds a GPTConfig and numpy's random state: allow-listed, not refused."""
    assert results["resumed_to"] == 2
    assert results["converted"] is None
    assert results["init_from_ours"] is None


@pytest.mark.parametrize("case, file", [("init_from", "evil.pt"), ("meta", "lightning_3d.meta.pt")])
def test_a_torch_file_that_would_run_code_is_refused_naming_the_file_and_what_to_do(results, case, file):
    error = results[case]
    assert error is not None, f"{case}: the file was read"
    assert error.startswith("UnsafeCheckpointError: Refused to read"), error
    assert file in error and "asks to build io.open" in error and "add_safe_globals([YourType])" in error, error


@pytest.mark.parametrize("case", ["dcp_metadata", "dcp_metadata_convert", "dcp_metadata_init_from"])
def test_a_dcp_metadata_file_that_would_run_code_is_refused_on_resume_convert_and_init_from(results, case):
    error = results[case]
    assert error is not None, f"{case}: the file was read"
    assert "evil_dcp.ckpt': its .metadata asks to build io.open" in error, error


def test_no_refused_file_ran_its_code(results):
    assert results["created"] == []
