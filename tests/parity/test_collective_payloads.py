"""What ranks send each other is what every backend serves (issue 28): no object collective pickles a tensor
(a pickled CUDA tensor unpickles on the sender's device index; "invalid device ordinal" where a task sees one
GPU), and every tensor collective's tensor is on a device type its group's backend serves. Recorded around
torch.distributed for a whole pp2 x tp2 run on 4 ranks (helpers/workers/payload_worker.py)."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("payloads")
    forkrun(4, str(WORKERS / "payload_worker.py"), str(out), timeout=600)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_the_run_used_object_and_tensor_collectives(seen):
    ops = {call["op"] for rank in seen for call in rank["object"]}
    assert {"broadcast_object_list", "all_gather_object"} <= ops, ops  # the recorder saw them
    assert all(rank["tensor_ops"] > 50 for rank in seen)


def test_no_object_collective_pickles_a_tensor(seen):
    pickled = sorted({(call["op"], call["where"], ", ".join(call["tensors"][:3]))
                      for rank in seen for call in rank["object"] if call["tensors"]})
    assert not pickled, "\n".join(map(str, pickled))


def test_every_tensor_collective_is_on_a_device_its_backend_serves(seen):
    wrong = sorted({(call["op"], call["where"], str(call["devices"]), call["backend"])
                    for rank in seen for call in rank["device"]})
    assert not wrong, "\n".join(map(str, wrong))
