"""Every size a layout divides either matches one process or is refused, on every rank, before any collective
can hang or abort: the catalogue of ``helpers.sizes.CASES``, each entry's outcome
printed ("matches one process" or "refused in N s: ...") and checked against what it must be. One launch
per world size (2 ranks; 4 for sequence parallelism inside a pipeline)."""

import json
import math

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun
from helpers.sizes import CASES, run_case

pytestmark = pytest.mark.multiprocess

REFUSED = {
    "sp_sequence_of_31_on_a_model_auto_plans": ["sequence_parallel=True", "31", "tensor_parallel_size=2", "32"],
    "sp_sequence_of_31_on_the_reference_gpt": ["sequence_parallel=True", "31", "tensor_parallel_size=2", "32"],
    "sp_pp_sequence_of_31": ["sequence_parallel=True", "self.model was called with input 0 of shape (4, 31)", "32"],
    "pp_batch_not_divisible_by_num_microbatches": ["4 samples per data-parallel rank", "num_microbatches=3"],
    "pp_fewer_microbatches_than_stages_1f1b": ["num_microbatches=1 < pipeline_parallel_size=2"],
    "pp_last_smaller_batch": ["shapes of the first one", "drop_last=True"],
    # policy="auto" leaves the region whole and, with more than 10% of the block parameters left so, refuses.
    "tp_hidden_width_not_divisible": ["mlp.fc1, mlp.fc2: mlp.fc2's 63 inputs do not divide by tensor_parallel_size=2",
                                      "allow_replicated=True"],
    "tp_heads_not_divisible": ["its 3 heads do not divide by tensor_parallel_size=2", "allow_replicated=True"],
}
"""Entry -> what its error must say (the numbers and the fix). Every other entry must match one process."""

LOSS_TOL = 1e-5  # fp32 losses of 2-3 steps of a tiny model (DESIGN.md's parity tolerance)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    results = {}
    for world in sorted({case.world for case in CASES.values()}):
        out = tmp_path_factory.mktemp(f"sizes{world}")
        names = [name for name, case in CASES.items() if case.world == world]
        forkrun(world, str(WORKERS / "sizes_worker.py"), str(out), *names, timeout=600)
        results.update(json.loads((out / "results.json").read_text()))
    for name, result in results.items():
        said = ("ran (compared with one process below)" if result["error"] is None
                else f"refused in {result['seconds']} s: {result['error'][:300]}")
        print(f"{name}: {said}")
    return results


def test_the_catalogue_covers_each_size_the_layouts_divide():
    assert set(REFUSED) <= set(CASES) and len(CASES) >= 15


@pytest.mark.parametrize("name", [n for n in CASES if n not in REFUSED])
def test_entry_matches_one_process(name, outcomes):
    ours = outcomes[name]
    assert ours["error"] is None, ours["error"]
    reference = run_case(CASES[name], "auto", devices=1)
    assert reference["error"] is None, reference["error"]
    assert len(ours["train"]) == len(reference["train"]) == CASES[name].steps
    differ = [(i, a, b) for i, (a, b) in enumerate(zip(ours["train"], reference["train"])) if abs(a - b) > LOSS_TOL]
    assert not differ, differ
    assert math.isclose(ours["val"], reference["val"], abs_tol=LOSS_TOL), (ours["val"], reference["val"])
    print(f"{name}: matches one process (losses {[round(x, 5) for x in reference['train']]})")


@pytest.mark.parametrize("name", list(REFUSED))
def test_entry_is_refused_saying_the_numbers_and_the_fix(name, outcomes):
    error = outcomes[name]["error"]
    assert error is not None, f"{name} ran"
    missing = [s for s in REFUSED[name] if s not in error]
    assert not missing, (missing, error)
    assert outcomes[name]["seconds"] < 30, outcomes[name]  # refused, not timed out by a watchdog
