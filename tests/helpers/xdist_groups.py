"""How the suite's tests are spread over pytest-xdist's workers (``tests/conftest.py``).

A module's fixture launches the ranks of all its tests once, so each test file runs whole on one worker: a group
per file, handed out in the collection's order (``--dist loadscope --no-loadscope-reorder``, grouped here
rather than by xdist's rule). Two exceptions: the files sharing the Hugging Face launch (the ``shared_runs``
fixture: one launch per worker) form one group, and a file whose module fixture is parametrized into parts
runs each part as a group of its own (the census' two halves), each handed to whichever worker is free
(xdist gives each worker one group to start, the rest as workers free up).

The groups are read from test ids alone, as the scheduler sees them; xdist's ``xdist_group`` marks are not
used (pytest 9.2 with pytest-xdist 3.8 runs their groups' tests on every worker)."""

from __future__ import annotations

SHARED_RUNS_FILES = frozenset({
    "parity/test_parity_auto_sequence_parallel.py", "parity/test_parity_auto_tensor_parallel.py",
    "parity/test_parity_hf_gpt2.py", "parity/test_parity_hf_llama.py", "parity/test_parity_pipeline_as_written.py",
    "parity/test_parity_user_model_init.py",
})
"""The files whose tests use the ``shared_runs`` fixture (checked at collection: :func:`check_shared_runs`)."""
PARTS_APART = frozenset({"parity/test_census_causal_lm.py"})
"""Files whose tests' last parameter (``[half0]``) names a part that runs as a group of its own."""


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid`` (``tests/parity/test_x.py::test_y[param]``)."""
    path = nodeid.split("::", 1)[0]
    if _in(path, SHARED_RUNS_FILES):
        return "shared_runs"
    if _in(path, PARTS_APART) and nodeid.endswith("]"):
        return f"{path}[{nodeid.rsplit('[', 1)[1]}"
    return path


def check_shared_runs(items) -> None:
    """Every test using ``shared_runs`` is in a file of :data:`SHARED_RUNS_FILES` (else its worker would launch
    the whole shared launch again)."""
    import pytest

    stray = sorted({item.nodeid.split("::", 1)[0] for item in items
                    if "shared_runs" in item.fixturenames and group_of(item.nodeid) != "shared_runs"})
    if stray:
        raise pytest.UsageError(f"{stray} use the shared_runs fixture: add them to SHARED_RUNS_FILES in"
                                " tests/helpers/xdist_groups.py")


def scheduler(config, log):
    """xdist's scope schedule over :func:`group_of`'s groups."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def _in(path: str, files: frozenset) -> bool:
    return any(path == f"tests/{name}" or path == name or path.endswith(f"/{name}") for name in files)
