"""Random draws the user's step makes before the model call, made alike on every stage.

A step that masks tokens (MLM) or mixes samples draws random numbers before it calls the model: the first
stage, capturing the model's inputs, makes those draws; the last stage, running the same step per
micro-batch to compute the loss, makes them again for the labels. Unless both start from the same random
state, the labels belong to other masks than the inputs -- silently. So the engine captures the inputs per
micro-batch, micro-batch ``i`` from state ``S_i`` (``S_0`` the state at the start of the step, ``S_i+1``
where capture ``i`` left it), and the last stage runs micro-batch ``i`` of the step from ``S_i`` too. With
the draws of one micro-batch following the previous one's, a draw over the micro-batches in turn is the
draw one process makes over the whole batch whenever the generator fills a tensor in order (``torch.rand``,
``randint``, ``bernoulli`` on CPU).

Every stream a step draws from is kept: torch's host generator, the accelerator's, Python's ``random`` and
NumPy's global state.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch


@dataclass
class RandomState:
    """The random streams of this process at one moment. Plain bytes and NumPy's tuple, no tensor: one rank
    sends it to the others pickled, and a pickled tensor would carry its device."""

    host: bytes
    device: bytes | None
    python: Any
    numpy: Any

    @classmethod
    def now(cls, device: torch.device) -> "RandomState":
        on_device = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(state_bytes(torch.get_rng_state()), None if on_device is None else state_bytes(on_device),
                   random.getstate(), np.random.get_state())

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(state_tensor(self.host))
        if self.device is not None:
            torch.cuda.set_rng_state(state_tensor(self.device), device)
        random.setstate(self.python)
        np.random.set_state(self.numpy)

    def same_as(self, other: "RandomState") -> bool:
        numpy_same = all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                         for a, b in zip(self.numpy, other.numpy))
        return self.host == other.host and self.device == other.device and self.python == other.python and numpy_same


def state_bytes(state: torch.Tensor) -> bytes:
    """A generator state (torch's ``ByteTensor``, on the host) as bytes."""
    return state.numpy().tobytes()


def state_tensor(data: bytes) -> torch.Tensor:
    """The generator state ``torch.set_rng_state`` takes, from :func:`state_bytes`."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@contextmanager
def replayed(state: RandomState | None, device: torch.device) -> Iterator[None]:
    """Run from ``state`` (no-op for None); this process's own streams continue afterwards as before."""
    if state is None:
        yield
        return
    own = RandomState.now(device)
    state.restore(device)
    try:
        yield
    finally:
        own.restore(device)
