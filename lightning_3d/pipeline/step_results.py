"""What the last stage's per-micro-batch runs of the user's step become: one process's results for the batch.

One process runs ``training_step`` once per batch: each ``self.log`` call logs one value for the whole
batch, and the step returns one loss (or dict). Under the pipeline the last stage runs the step once per
micro-batch (equal slices of the batch); here those runs are combined into what the one call would have given:

* ``self.log`` values by their ``reduce_fx``: the mean of the micro-batches' values for "mean" (a mean over
  equal slices is the mean over the batch), their sum for "sum", max for "max", min for "min" -- on the
  device, in float64, as a tensor of the default dtype (what Lightning makes of a logged number), so no
  value is copied to the host mid-step; a
  ``batch_size=`` given per micro-batch becomes their sum, the batch's (Lightning weighs the batches of an
  epoch by it). Lightning then aggregates the batches of an epoch (``on_epoch=True``) and syncs
  (``sync_dist=True``) as it always does.
* a torchmetrics ``Metric`` logged as an object travels as :class:`MetricRef` (its name in the module): every
  rank logs its own copy of that metric, whose state ``step_metrics.StepMetrics`` keeps equal to the last
  stage's.
* the step's return value: floating-point scalars (the loss, means) averaged, integer scalars (counts)
  summed, tensors with a batch dimension concatenated, anything else from the last micro-batch; a dict keeps
  its keys and reaches ``on_train_batch_end`` on every rank.

The last stage's ``self.log`` calls are recorded here (:func:`recording_logs`), combined, and after the step
replayed on every rank (:func:`replay_logs`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchmetrics import Metric
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# reduce_fx as Lightning accepts it (strings or the torch functions) -> how micro-batch values combine
_COMBINE: dict[Any, Callable[[Tensor], Tensor]] = {
    "mean": torch.mean, "avg": torch.mean, torch.mean: torch.mean,
    "sum": torch.sum, torch.sum: torch.sum,
    "max": torch.max, torch.max: torch.max,
    "min": torch.min, torch.min: torch.min,
}


@dataclass(frozen=True)
class MetricRef:
    """A logged torchmetrics Metric, by its name in the LightningModule (each rank logs its own copy)."""

    fqn: str


@contextmanager
def recording_logs(module: nn.Module) -> Iterator[list[tuple]]:
    """``module.log(name, value, *args, **kwargs)`` calls recorded as tuples in the yielded list, not logged.
    Values are detached as Lightning's ``log`` detaches them (``enable_graph=True`` keeps them whole): a logged
    loss kept whole until the step's end would keep its graph, and under zero bubble with it the tensors the
    input gradient saved for the weight gradient."""
    recorded: list[tuple] = []
    # LightningModule.log has no hook to defer a call; an instance attribute shadows it for the duration.
    module.log = lambda name, value, *args, **kwargs: recorded.append(
        (name, value if kwargs.get("enable_graph") else detached(value), args, kwargs))
    try:
        yield recorded
    finally:
        del module.log


def replay_logs(module: nn.Module, calls: list[tuple]) -> None:
    """Log ``combine_logs``' calls on this rank; a :class:`MetricRef` logs this rank's copy of the metric."""
    for name, value, args, kwargs in calls:
        if isinstance(value, MetricRef):
            value = module.get_submodule(value.fqn)
        module.log(name, value, *args, **kwargs)


def combine_logs(per_microbatch: list[list[tuple]], metric_names: dict[int, str], device: torch.device) -> list[tuple]:
    """One ``self.log`` call per name, as one process logging the whole batch would make it (module doc).
    ``metric_names`` maps ``id(metric)`` to its name in the module, for Metric objects logged as values;
    numbers logged as Python values are put on ``device``."""
    calls: dict[str, tuple] = {}
    values: dict[str, list] = {}
    batch_sizes: dict[str, list] = {}
    for recorded in per_microbatch:
        for name, value, args, kwargs in recorded:
            calls[name] = (args, kwargs)  # the arguments of the last call (Lightning refuses calls that differ)
            values.setdefault(name, []).append(value)
            batch_sizes.setdefault(name, []).append(kwargs.get("batch_size"))
    combined = []
    for name, (args, kwargs) in calls.items():
        seen = values[name]
        if None not in batch_sizes[name]:  # a batch_size given per micro-batch: the whole batch's, its sum
            kwargs = {**kwargs, "batch_size": sum(batch_sizes[name])}
        if isinstance(seen[-1], Metric):
            if id(seen[-1]) not in metric_names:
                raise TypeError(f"self.log({name!r}, ...) logged a torchmetrics {type(seen[-1]).__name__} that is"
                                " not an attribute of the LightningModule; under pipeline parallelism a logged"
                                " Metric must be one (e.g. self.accuracy = Accuracy(...) in __init__).")
            combined.append((name, MetricRef(metric_names[id(seen[-1])]), args, kwargs))
            continue
        reduce_fx = kwargs.get("reduce_fx", "mean")
        numbers = torch.stack([_whole(v).detach().to(device, torch.float64).reshape(()) if isinstance(v, Tensor)
                               else torch.tensor(v, dtype=torch.float64, device=device) for v in seen])
        combine = _COMBINE.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx, reduce_fx)
        combined.append((name, combine(numbers).to(torch.get_default_dtype()), args, kwargs))
    return combined


def combine_outputs(results: list[Any]) -> Any:
    """The step's return values over the micro-batches as one return value for the batch (module doc)."""
    if not results or any(r is None for r in results):
        return None
    flat = [tree_flatten(r) for r in results]
    spec = flat[0][1]
    if any(f[1] != spec for f in flat):
        return results[-1]
    return tree_unflatten([_combine_leaf(list(leaves)) for leaves in zip(*(f[0] for f in flat))], spec)


def _combine_leaf(leaves: list[Any]) -> Any:
    if not all(isinstance(x, Tensor) for x in leaves):
        return leaves[-1]
    if leaves[0].dim() == 0:  # a float is a mean over its micro-batch (the loss), an integer a count
        stacked = torch.stack([x.detach() for x in leaves])
        return stacked.mean() if stacked.is_floating_point() else stacked.sum()
    return torch.cat([x.detach() for x in leaves])


def _whole(value: Tensor) -> Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value  # a loss over tp shards: replicated


def detached(result: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, result)


def loss_of(result: Any) -> Tensor | None:
    """The loss in what a step returned (the tensor, or the dict's "loss"); None if there is no scalar one."""
    loss = result.get("loss") if isinstance(result, dict) else result
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None
