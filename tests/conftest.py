import os

import pytest

import warning_filters

# Tiny models: one thread per process keeps 8 ranks on 2 cores from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Processes the tests start (ranks, launchers, the CLI) read their warning rules from here.
os.environ["PYTHONWARNINGS"] = warning_filters.pythonwarnings()


def pytest_configure(config):
    # Warnings from lightning_3d code fail the test; third-party ones are ignored only as listed (warning_filters.py).
    for line in warning_filters.pytest_filters():
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """Every run of the shared launch (tests/hf_cases.py: Hugging Face models, users' models) by name; the
    launch happens once per pytest session, in whichever module asks first."""
    pytest.importorskip("transformers")  # the shared launch also runs the Hugging Face cases
    from hf_cases import hf_results

    return hf_results(tmp_path_factory)
