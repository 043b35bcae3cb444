"""Run under torchrun with 8 ranks: build the device mesh of several layouts and report each rank's view.

Prints one JSON line per (layout, rank): the rank's coordinates and the global ranks of its tp, dp and pp
sub-meshes, as the DeviceMesh itself reports them."""

import json
import sys

import torch.distributed as dist

from lightning_3d import ParallelConfig, ParallelDims


def main(layouts: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for layout in layouts:
        dp, pp, tp = (int(x) for x in layout.split(","))
        dims = ParallelDims.from_config(
            ParallelConfig(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp),
            dist.get_world_size(),
        )
        mesh = dims.build_mesh("cpu")
        view = {dim: mesh[dim].mesh.flatten().tolist() for dim in ("pp", "dp", "tp")}
        local = {dim: mesh[dim].get_local_rank() for dim in ("pp", "dp", "tp")}
        print("MESH " + json.dumps({"layout": layout, "rank": rank, "groups": view, "local": local,
                                    "names": list(mesh.mesh_dim_names)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
