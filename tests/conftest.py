"""The tests by kind, one folder each (``python -m pytest tests/unit`` runs the fast ones):

unit/     one process, no rank launched: config, dims, plans, policies, the planner's model, the CLI's parsing
parity/   runs on several gloo ranks that must match one process (or the theory: bytes, collectives, memory)
faults/   what happens when something goes wrong: failing or hanging ranks, NaNs, restarts, bad configurations,
          unsafe files
launch/   how ranks start: the CLI under its launcher and torchrun, Slurm, the tests' own fork launcher
helpers/  what they share: launchers, the parity harness, the workers ranks run, test models, warning rules
"""

import os
import sys
from pathlib import Path

import pytest

# The tests' shared package, helpers/ (launchers, the parity harness, workers, test models), is imported from
# this folder: here, and in every process the tests start (ranks, the fork server, the CLI), by the same name.
TESTS_DIR = str(Path(__file__).parent)
sys.path.insert(0, TESTS_DIR)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")]))

# Tiny models: one thread per process keeps 8 ranks on 2 cores from thrashing. Set before the import below,
# which imports torch: its OpenMP pool reads the variable once, at load (set after, this process kept 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from helpers import warning_filters  # noqa: E402

# Processes the tests start (ranks, launchers, the CLI) read their warning rules from here.
os.environ["PYTHONWARNINGS"] = warning_filters.pythonwarnings()


def pytest_configure(config):
    # Warnings from lightning_3d code fail the test; third-party ones are ignored only as listed
    # (helpers/warning_filters.py).
    for line in warning_filters.pytest_filters():
        config.addinivalue_line("filterwarnings", line)
    config.addinivalue_line("markers", "long_launch: a file whose launch takes minutes; its file starts first")


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml): one worker per CPU, 2 to 4 of them. Each launches ranks of its own, so more
    workers would only queue more ranks on the same cores; 2 keep both cores busy while one worker waits on a
    launch or runs a single-process test."""
    return max(2, min(4, len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before xdist's own scope schedule
def pytest_xdist_make_scheduler(config, log):
    """Each test file whole on one worker, with the exceptions of helpers/xdist_groups.py."""
    if config.getvalue("dist") == "loadscope":
        from helpers.xdist_groups import scheduler

        return scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    """Files marked ``long_launch``, and those sharing the Hugging Face launch, come first: the workers take
    them first (helpers/xdist_groups.py) and end at about the same time."""
    from helpers.xdist_groups import check_shared_runs

    check_shared_runs(items)
    late = {item.nodeid for item in items
            if "shared_runs" not in item.fixturenames and item.get_closest_marker("long_launch") is None}
    items.sort(key=lambda item: item.nodeid in late)  # stable: the files keep their order otherwise


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """Every run of the shared launch (helpers/hf_cases.py: Hugging Face models, users' models) by name; the
    launch happens once per pytest session, in whichever module asks first."""
    pytest.importorskip("transformers")  # the shared launch also runs the Hugging Face cases
    from helpers.hf_cases import hf_results

    return hf_results(tmp_path_factory)


# The environment every test starts from (see each_test_starts_without_a_process_group).
_SESSION_ENVIRON = dict(os.environ)


@pytest.fixture(autouse=True)
def each_test_starts_without_a_process_group():
    """Tests share one pytest process, and a Trainer run in it (in a test or a module's fixture) leaves its
    default process group and the variables it set (MASTER_PORT, ...) behind, as Lightning does so that fit and
    test can follow each other. Left there, the next test's ``init_process_group`` fails, a worker it launches
    inherits a port that is taken, and a layout check reads the old world size. Each test starts from the
    process as the session began; a fixture that starts a group for its test leaves the end to this one."""
    import torch.distributed as dist

    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name in set(os.environ) - set(_SESSION_ENVIRON) - {"PYTEST_CURRENT_TEST"}:  # pytest's own, per phase
        del os.environ[name]
    os.environ.update(_SESSION_ENVIRON)
