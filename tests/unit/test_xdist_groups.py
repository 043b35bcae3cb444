"""How the suite is spread over pytest-xdist's workers (helpers/xdist_groups.py): a group per file, the files of
the shared Hugging Face launch together, the census' halves apart, and a new user of the shared launch named."""

from types import SimpleNamespace

import pytest

from helpers.xdist_groups import check_shared_runs, group_of, put_long_launches_first


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


def test_the_census_halves_come_first_then_the_long_and_shared_launches():
    def item(nodeid, long=False, shared=False):
        return SimpleNamespace(nodeid=nodeid, fixturenames=["shared_runs"] if shared else [],
                               get_closest_marker=lambda name: object() if long and name == "long_launch" else None)

    items = [item("tests/launch/test_cli_launch.py::test_a"),
             item("tests/parity/test_auto_layout_on_ranks.py::test_b", long=True),
             *(item(f"tests/parity/test_census_causal_lm.py::{test}[half{part}]", long=True)
               for part in (0, 1) for test in ("test_c", "test_d")),
             item("tests/parity/test_parity_hf_llama.py::test_e[tp2]", shared=True),
             item("tests/unit/test_cli.py::test_f")]
    put_long_launches_first(items)
    groups = list(dict.fromkeys(group_of(i.nodeid) for i in items))
    assert groups == ["tests/parity/test_census_causal_lm.py[half0]", "tests/parity/test_census_causal_lm.py[half1]",
                      "tests/parity/test_auto_layout_on_ranks.py", "shared_runs", "tests/launch/test_cli_launch.py",
                      "tests/unit/test_cli.py"]
