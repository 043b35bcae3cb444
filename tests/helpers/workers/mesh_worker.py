"""Run under torchrun with 8 ranks: build the device mesh of several layouts and report each rank's view.

Writes one JSON file per rank (stdout lines of 8 ranks can interleave): per layout, the rank's coordinates and
the global ranks of its tp, dp and pp sub-meshes, as the DeviceMesh itself reports them.

    python -m torch.distributed.run --nproc-per-node 8 mesh_worker.py OUT_DIR 2,2,2 8,1,1 ...
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from helpers.launchers import end_process_group
from lightning_3d import ParallelConfig, ParallelDims


def main(out_dir: str, layouts: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    views = []
    for layout in layouts:
        dp, pp, tp = (int(x) for x in layout.split(","))
        dims = ParallelDims.from_config(
            ParallelConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp),
            dist.get_world_size(),
        )
        mesh = dims.build_mesh("cpu")
        view = {dim: mesh[dim].mesh.flatten().tolist() for dim in ("pp", "dp", "tp")}
        local = {dim: mesh[dim].get_local_rank() for dim in ("pp", "dp", "tp")}
        views.append({"layout": layout, "rank": rank, "groups": view, "local": local,
                      "names": list(mesh.mesh_dim_names)})
        if layout == "2,2,2":
            views[-1]["slices"] = _slices(mesh)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(views))


def _slices(mesh) -> dict:
    """``weight_init._copy_slice`` against DTensor's own cut (``distribute_tensor``), for even and uneven
    shapes over the (dp, tp) mesh, and for a fused projection stored in rank order: the mismatches, and how
    many slices were compared."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_3d.fused_parts import FusedParts
    from lightning_3d.parallel.weight_init import _copy_slice

    compared, wrong = 0, []
    for shape in [(8, 6), (7, 5), (3, 9)]:
        full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        for placements in [(Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Replicate()), (Shard(0), Shard(0))]:
            expected = distribute_tensor(full, mesh["dp", "tp"], placements, src_data_rank=None).to_local()
            target = distribute_tensor(torch.full(shape, -1.0), mesh["dp", "tp"], placements, src_data_rank=None)
            _copy_slice(full, target)
            got = target.to_local()
            if expected.numel() == 0:  # an empty shard: nothing to compare
                continue
            compared += 1
            if got.shape != expected.shape or not torch.equal(got, expected):
                wrong.append(f"{shape} {placements}")
    # A fused projection of unequal parts stored in rank order over tp (parts of 8, 4 and 4 rows), with and
    # without FSDP2's dp cut of the tp-local piece: the single-device tensor lands where the stored one is cut.
    parts = FusedParts(0, (8, 4, 4), 2)
    full = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    for placements in [(Replicate(), Shard(0)), (_StridedShard(0, split_factor=2), Shard(0))]:
        expected = distribute_tensor(parts.stored(full), mesh["dp", "tp"], placements, src_data_rank=None).to_local()
        target = distribute_tensor(torch.full((16, 3), -1.0), mesh["dp", "tp"], placements, src_data_rank=None)
        _copy_slice(full, target, parts)
        compared += 1
        if not torch.equal(target.to_local(), expected):
            wrong.append(f"stored in rank order {placements}")
    return {"compared": compared, "wrong": wrong}
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
