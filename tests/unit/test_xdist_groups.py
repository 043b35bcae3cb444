"""How the suite is spread over pytest-xdist's workers (helpers/xdist_groups.py): a group per file, the files of
the shared Hugging Face launch together, the census' halves apart, and a new user of the shared launch named."""

from types import SimpleNamespace

import pytest

from helpers.xdist_groups import check_shared_runs, group_of


def test_a_file_is_a_group_the_shared_launch_one_group_and_the_census_halves_two():
    assert group_of("tests/unit/test_cli.py::test_x[a]") == "tests/unit/test_cli.py"
    assert group_of("tests/parity/test_parity_hf_llama.py::test_y[tp2]") == "shared_runs"
    assert group_of("tests/parity/test_parity_hf_gpt2.py::test_z") == "shared_runs"
    halves = {group_of(f"tests/parity/test_census_causal_lm.py::{test}[half{part}]")
              for test in ("test_a", "test_b") for part in (0, 1)}
    assert halves == {"tests/parity/test_census_causal_lm.py[half0]", "tests/parity/test_census_causal_lm.py[half1]"}


def test_a_file_using_the_shared_launch_that_is_not_listed_is_named():
    item = SimpleNamespace(nodeid="tests/parity/test_new.py::test_it", fixturenames=["shared_runs"])
    with pytest.raises(pytest.UsageError, match=r"test_new.py.*SHARED_RUNS_FILES"):
        check_shared_runs([item])
