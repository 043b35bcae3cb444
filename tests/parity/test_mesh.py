"""The DeviceMesh that ParallelDims builds on 8 real ranks has the documented layout."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun
from lightning_3d import ParallelDims, RankCoords

LAYOUTS = [(2, 2, 2), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 4, 1), (4, 1, 2), (1, 2, 4)]  # (dp, pp, tp)


@pytest.fixture(scope="module")
def mesh_views(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh")
    forkrun(8, str(WORKERS / "mesh_worker.py"), str(out),
            *(",".join(map(str, layout)) for layout in LAYOUTS), rank_files=out)
    views = [view for rank in range(8) for view in json.loads((out / f"rank{rank}.json").read_text())]
    assert len(views) == 8 * len(LAYOUTS)
    return views


@pytest.mark.multiprocess
def test_every_rank_sees_the_documented_groups_and_coordinates(mesh_views):
    for view in mesh_views:
        dp, pp, tp = (int(x) for x in view["layout"].split(","))
        dims = ParallelDims(dp=dp, pp=pp, tp=tp)
        rank = view["rank"]
        assert view["names"] == ["pp", "dp", "tp"]
        for dim in ("pp", "dp", "tp"):
            assert view["groups"][dim] == dims.group_ranks(dim, rank), (view, dim)
        assert RankCoords(**{d: view["local"][d] for d in ("dp", "pp", "tp")}) == dims.coords(rank), view


@pytest.mark.multiprocess
def test_tensor_parallel_groups_are_consecutive_ranks(mesh_views):
    for view in mesh_views:
        tp_group = view["groups"]["tp"]
        assert tp_group == list(range(tp_group[0], tp_group[0] + len(tp_group))), view


@pytest.mark.multiprocess
def test_a_full_tensor_is_cut_where_it_lies_as_dtensor_cuts_it(mesh_views):
    # weight_init's _copy_slice: a host draw is sliced on the host, so only the shard moves to the GPU.
    checked = [view["slices"] for view in mesh_views if "slices" in view]
    assert len(checked) == 8 and all(c["compared"] >= 10 for c in checked)
    assert not [c["wrong"] for c in checked if c["wrong"]]
