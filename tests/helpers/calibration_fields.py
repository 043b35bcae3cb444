"""One check for each optional field of the planner's ``Calibration``: it survives a JSON round trip, a dict
written before it existed still loads (the field None), ``from_measurements`` takes it, and a negative, infinite
or NaN value is refused with the field's name."""

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
