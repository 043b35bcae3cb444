"""For the calibration's tests: one check for each optional field of the planner's ``Calibration`` (it survives
a JSON round trip, a dict written before it existed still loads (the field None), ``from_measurements`` takes
it, and a negative, infinite or NaN value is refused with the field's name), and a block to calibrate."""

import json
import math
from typing import Callable

import pytest

from lightning_3d.planner import Calibration, LinkSpeed, PlannerError


def check_optional_field(make: Callable[..., Calibration], name: str, value: float, link: LinkSpeed) -> None:
    """``make(value)``: a calibration with ``name`` set to ``value``; ``link``: the speed given to every
    dimension in ``from_measurements``."""
    measured = make(value)
    assert Calibration.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured
    older = measured.to_dict()
    del older[name]  # a calibration written before the field was measured
    assert getattr(Calibration.from_dict(older), name) is None
    made = Calibration.from_measurements({8: 5e-5}, 3e-4, {"tp": link, "pp": link, "dp": link}, **{name: value})
    assert getattr(made, name) == value
    for bad in (-1e-9, math.inf, math.nan):
        with pytest.raises(PlannerError, match=name):
            make(bad)


def meta_block_and_call() -> tuple:
    """A 32-wide reference GPT block on the meta device and a captured call of it (4 sequences of 16), for
    calibration functions timed with their timing patched, in a gloo world of one rank (their meshes need one;
    conftest ends it)."""
    import torch
    import torch.distributed as dist

    from lightning_3d.models import GPTConfig
    from lightning_3d.models.gpt import Block

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    with torch.device("meta"):
        block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, block_size=16))
    return block, ((torch.empty(4, 16, 32, device="meta"),), {})
