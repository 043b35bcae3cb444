"""How fast these devices compute, measured in seconds at launch, for ``layout="auto"``.

On the real ranks, before the model is sharded: one of the model's own blocks, copied from the meta build,
materialized with random weights on this rank's device, run forward and backward on inputs shaped as the model
really calls it (the call is taken from the user's ``training_step`` run on the meta device up to that block,
so a block that takes masks or rotary tables gets them), at each candidate micro-batch size; the same block
split over each candidate tensor-parallel size by the policy's plan, on real tp groups (its collectives and
DTensor's costs included), at the smallest and largest size; the output head as a matrix multiply of its size
with the cross-entropy over its logits, whole and split over the vocabulary at each candidate tp size (the
vocabulary-parallel loss's collectives included). Seconds per token. What FSDP2's wrapping adds to one call
of the block, and what recomputing its forward in backward (activation checkpointing) adds. And an AdamW
step on the block's parameters: seconds per parameter, and what the step costs more on the same parameters
as DTensors (per block); and one on a tensor of the embedding's shape, per parameter.

Every timing runs in the run's precision (:class:`RunPrecision`: autocast under "bf16-mixed", bf16 weights and
inputs under "bf16-true"): it measures the kernels the run runs. The head is timed on at most
:data:`HEAD_PROBE_LOGITS` logits, whatever the batch: its logits are the largest tensors a timing makes.

The communication -- link speeds per parallel dimension and the pipeline schedule's own cost -- is timed in
``strategies/calibrate_links.py``; how both time a call, in ``strategies/calibrate_timing.py``.

Every rank takes part (collectives), each measures its own, and the slowest rank's numbers are kept (a step
runs at the pace of its slowest rank). The random generators are left as they were found, and the process
groups made for a measurement are destroyed after it.
"""

from __future__ import annotations

import copy
import itertools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_3d.common import local
from lightning_3d.policies.base import Plan
from lightning_3d.strategies.calibrate_timing import (FP32, MIN_REPEAT_SECONDS, RunPrecision, median_extra_seconds,
                                                      median_seconds, release_groups, world_mesh)

class _Captured(Exception):
    """Raised by the hook that took a block's call: the rest of the step is not needed."""


def capture_block_call(module: nn.Module, block: nn.Module, batch: Any, step: Callable[[Any, int], Any]) -> tuple:
    """``(args, kwargs)`` of ``block``'s first call when ``step(batch, 0)`` runs: the user's ``training_step``,
    stopped at that call. ``module`` is on the meta device (or wherever it was built); the batch goes there."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    taken: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        taken["call"] = tree_map(lambda v: v.detach().to("meta") if isinstance(v, Tensor) else v, (args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            step(tree_map(lambda v: v.to(device) if isinstance(v, Tensor) else v, batch), 0)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "call" not in taken:
        raise RuntimeError(f"layout='auto' times one block of the model, but {type(block).__name__} was not"
                           " called by training_step on a batch of the training data.")
    return taken["call"]


def block_seconds_per_token(block: nn.Module, call: tuple, batch_size: int, micro_batch_sizes: list[int],
                            device: torch.device, repeat_s: float = MIN_REPEAT_SECONDS, *,
                            precision: RunPrecision = FP32) -> dict[int, float]:
    """Forward + backward seconds per token of ``block`` (a meta copy is fine) at each micro-batch size, the
    call's batch dimension (size ``batch_size``) resized to it, each repetition at least ``repeat_s``
    (:func:`repeat_seconds`), in the run's ``precision`` (every timing of a block here takes it: the weights and
    inputs in its ``param_dtype``, the forward under its autocast). Collective (every rank times at once)."""
    return _seconds_per_token(materialized(block, device, dtype=precision.param_dtype), call, batch_size,
                              micro_batch_sizes, device, repeat_s, precision)


def tp_block_seconds_per_token(block_name: str, block: nn.Module, plans: Mapping[int, Plan], call: tuple,
                               batch_size: int, micro_batch_sizes: list[int], device: torch.device,
                               repeat_s: float = MIN_REPEAT_SECONDS, *,
                               precision: RunPrecision = FP32) -> dict[int, dict[int, float]]:
    """As :func:`block_seconds_per_token`, with the block split by each tensor-parallel size's plan (``plans``:
    tp -> the policy's plan for the model; ``block_name`` the block's name in it) over groups of tp consecutive
    ranks, every group timing at once as a dp x tp layout runs: the even split of the matmuls, the block's
    collectives, and what the split adds (smaller matmuls, DTensor's dispatch). Collective."""
    from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel

    result = {}
    for tp, plan in sorted(plans.items()):
        # The block alone, under the name the plan gives it (the plan's patterns are the model's names).
        root, (*path, leaf) = nn.Module(), block_name.split(".")
        parent = root
        for part in path:
            parent.add_module(part, nn.Module())
            parent = parent.get_submodule(part)
        parent.add_module(leaf, copy.deepcopy(block))
        with _tp_mesh(tp, device) as tp_mesh:
            apply_tensor_parallel(root, plan, tp_mesh)
            split = materialized(root.get_submodule(block_name), device, in_place=True,  # (root is our own copy)
                                 dtype=precision.param_dtype)
            result[tp] = _seconds_per_token(split, call, batch_size, micro_batch_sizes, device, repeat_s, precision)
    return result


def fsdp_block_call_seconds(block: nn.Module, call: tuple, batch_size: int, micro_batch_size: int,
                            device: torch.device, repeat_s: float = MIN_REPEAT_SECONDS, *,
                            precision: RunPrecision = FP32) -> float:
    """What FSDP2 adds to one forward + backward of ``block`` at ``micro_batch_size``: the block wrapped by
    ``replicate`` over a mesh of the world, as data parallelism wraps each block under a pipeline or tensor
    parallelism, its gradient reduction off (the step-time model charges that apart), against the block alone.
    Its hooks and its parameters' copies in and out of their DTensors are paid per call, whatever the tokens,
    and on a small block they cost more than the block itself. Seconds per call, >= 0.
    Collective."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    mesh = world_mesh(device)
    alone = materialized(block, device, dtype=precision.param_dtype)
    wrapped = copy.deepcopy(alone)
    replicate(wrapped, mesh=mesh)
    wrapped.set_requires_gradient_sync(False)
    base, _ = _call_run(alone, call, batch_size, micro_batch_size, device, precision)
    extra, _ = _call_run(wrapped, call, batch_size, micro_batch_size, device, precision)
    return median_extra_seconds(base, extra, device, repeat_s)


def recompute_share(block: nn.Module, call: tuple, batch_size: int, micro_batch_size: int, seconds_per_token: float,
                    device: torch.device, repeat_s: float = MIN_REPEAT_SECONDS, *,
                    precision: RunPrecision = FP32) -> float:
    """What recomputing ``block``'s forward during its backward adds to one forward + backward of the block, as
    a share of that forward + backward (``seconds_per_token`` at ``micro_batch_size``, as
    :func:`block_seconds_per_token` measured it), >= 0: the block under activation checkpointing (torch's
    composable ``checkpoint``, as ``activation_checkpointing`` applies it to each block) against the block
    alone, timed in pairs. A forward's FLOPs are a third of forward + backward; the checkpoint's own work (the
    random state kept and restored, the forward's tensors made twice) comes on top. Collective."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    alone = materialized(block, device, dtype=precision.param_dtype)
    recomputed = copy.deepcopy(alone)
    checkpoint(recomputed)
    base, tokens = _call_run(alone, call, batch_size, micro_batch_size, device, precision)
    extra, _ = _call_run(recomputed, call, batch_size, micro_batch_size, device, precision)
    return median_extra_seconds(base, extra, device, repeat_s) / (seconds_per_token * tokens)


def zero_bubble_split_seconds_per_token(block: nn.Module, call: tuple, batch_size: int,
                                        micro_batch_sizes: list[int], device: torch.device,
                                        repeat_s: float = MIN_REPEAT_SECONDS, *,
                                        precision: RunPrecision = FP32) -> dict[int, float]:
    """What splitting ``block``'s backward as zero bubble does -- the input's gradient first (``retain_graph``,
    after a walk of the autograd graph in Python that groups the weights' nodes), the weights' later -- adds to
    one forward + backward of the block, per token of each micro-batch size, >= 0: the split against the whole
    backward, timed in pairs. Much of it is per call, so it is timed at sizes, not scaled: on 8 gloo ranks over
    2 cores, a 64-wide block's split added 0.61 of its forward + backward at 1 sequence of 64 tokens and 0.36
    at 4. ``{micro-batch size: seconds per token}``. Collective."""
    alone = materialized(block, device, dtype=precision.param_dtype)
    result = {}
    for b in micro_batch_sizes:
        base, tokens = _call_run(alone, call, batch_size, b, device, precision)
        split, _ = _call_run(alone, call, batch_size, b, device, precision, split_backward=True)
        result[b] = median_extra_seconds(base, split, device, repeat_s) / tokens
    return result


def _seconds_per_token(timed: nn.Module, call: tuple, batch_size: int, micro_batch_sizes: list[int],
                       device: torch.device, repeat_s: float, precision: RunPrecision) -> dict[int, float]:
    result = {}
    for b in micro_batch_sizes:
        seconds, tokens = _call_seconds(timed, call, batch_size, b, device, repeat_s, precision)
        result[b] = seconds / tokens
    return result


def _call_seconds(timed: nn.Module, call: tuple, batch_size: int, micro_batch_size: int, device: torch.device,
                  repeat_s: float, precision: RunPrecision) -> tuple[float, int]:
    """Seconds of one forward + backward of ``timed`` on the captured call resized to ``micro_batch_size``, and
    the tokens of that call. Collective."""
    run, tokens = _call_run(timed, call, batch_size, micro_batch_size, device, precision)
    return median_seconds(run, device, barrier=True, min_seconds=repeat_s), tokens


def _call_run(timed: nn.Module, call: tuple, batch_size: int, micro_batch_size: int, device: torch.device,
              precision: RunPrecision = FP32, *, split_backward: bool = False) -> tuple[Callable[[], None], int]:
    """One forward + backward of ``timed`` on the captured call resized to ``micro_batch_size``, as a call to
    time, and the tokens of that call: its floating inputs in ``precision.param_dtype``, the forward under its
    autocast. ``split_backward``: the backward as zero bubble runs it, the input's gradient and then the
    weights' (``torch.distributed.pipelining``'s own two functions)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    args, kwargs = _inputs(call, batch_size, micro_batch_size, device, precision.param_dtype)
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
    hidden = inputs[0]
    tokens = hidden.shape[0] * hidden.shape[1] if hidden.ndim >= 3 else hidden.shape[0]

    def run() -> None:
        with precision.forward(device):
            output = timed(*_fresh_state(args), **_fresh_state(kwargs))
        out = next(t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad)
        if not split_backward:
            out.backward(torch.ones_like(out))
            return
        _, groups = stage_backward_input([out], [torch.ones_like(out)], inputs, timed.parameters())
        stage_backward_weight(timed.parameters(), groups)
        for tensor in inputs:
            tensor.grad = None  # stage_backward_input accumulates into the inputs, as into a stage's receive buffer

    return run, tokens


HEAD_PROBE_LOGITS = 2**26
"""The most logits (tokens x this rank's share of the vocabulary) one timing of the head makes: 256 MiB in
fp32, about 1 GiB with the loss's fp32 log-softmax and the gradients. A micro-batch of more tokens is timed
on as many as fit this bound and its seconds per token taken as they are (a head's time grows linearly with
its tokens once a call's fixed cost is spread over a few hundred): timed whole, 4 x 8192 tokens of a 128k
vocabulary at tp 2 made 8.6 GB of fp32 logits, ~25 GB with the loss and gradients, at launch."""


def head_probe_tokens(tokens: int, vocab_share: int) -> int:
    """The tokens one timing of the head takes for a micro-batch of ``tokens``: all of them, up to
    :data:`HEAD_PROBE_LOGITS` logits of ``vocab_share`` (the vocabulary, or one tp rank's share of it) each;
    at least one."""
    return max(1, min(tokens, HEAD_PROBE_LOGITS // max(1, vocab_share)))


def head_seconds_per_token(hidden_size: int, vocab_size: int, micro_tokens: int, device: torch.device,
                           repeat_s: float = MIN_REPEAT_SECONDS, *, precision: RunPrecision = FP32) -> float:
    """Forward + backward seconds per token of the output head and its loss: a ``hidden_size x vocab_size``
    matrix multiply and the cross-entropy over its logits (the softmax over the vocabulary, which on a large
    vocabulary costs as much again as the matmul's non-matmul work), in the run's ``precision`` (the loss over
    fp32 logits, as autocast computes it), on at most :func:`head_probe_tokens` of ``micro_tokens``. Collective
    (every rank times at once)."""
    dtype = precision.param_dtype
    micro_tokens = head_probe_tokens(micro_tokens, vocab_size)
    x = torch.randn(micro_tokens, hidden_size, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab_size, hidden_size, device=device, dtype=dtype, requires_grad=True) * 0.02
    targets = torch.randint(0, vocab_size, (micro_tokens,), device=device)

    def run() -> None:
        with precision.forward(device):
            loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, weight).float(), targets)
        loss.backward(retain_graph=True)

    return median_seconds(run, device, barrier=True, min_seconds=repeat_s) / micro_tokens


def tp_head_seconds_per_token(hidden_size: int, vocab_size: int, seq_length: int, micro_batch_sizes: list[int],
                              tps: list[int], device: torch.device, repeat_s: float = MIN_REPEAT_SECONDS, *,
                              precision: RunPrecision = FP32) -> dict[int, dict[int, float]]:
    """As :func:`head_seconds_per_token`, with the head split over the vocabulary on groups of each ``tps``
    size of consecutive ranks (every group timing at once), as tensor parallelism runs it: a column-parallel
    matrix multiply that leaves its logits sharded, and the vocabulary-parallel cross-entropy over them (its
    all-reduces, DTensor's dispatch), at each micro-batch size of ``seq_length`` tokens per sequence (on at most
    :func:`head_probe_tokens` of them). ``{tp: {micro-batch size: seconds per token}}``. Collective."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_3d.parallel.loss import vocab_parallel_ops

    result: dict[int, dict[int, float]] = {}
    for tp in sorted(tps):
        head = nn.Linear(hidden_size, vocab_size, bias=False, device=device, dtype=precision.param_dtype)
        nn.init.normal_(head.weight, std=0.02)
        with _tp_mesh(tp, device) as tp_mesh:
            parallelize_module(head, tp_mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                              use_local_output=False))
            for b in micro_batch_sizes:
                tokens = head_probe_tokens(b * seq_length, -(-vocab_size // tp))
                x = torch.randn(tokens, hidden_size, device=device, dtype=precision.param_dtype, requires_grad=True)
                targets = torch.randint(0, vocab_size, (tokens,), device=device)

                def run() -> None:
                    with vocab_parallel_ops():
                        with precision.forward(device):
                            loss = torch.nn.functional.cross_entropy(head(x), targets)
                        loss.backward()

                result.setdefault(tp, {})[b] = (median_seconds(run, device, barrier=True, min_seconds=repeat_s)
                                                / tokens)
    return result


def host_cores_per_rank(per_node: int, device: torch.device) -> float | None:
    """The host's cores (those this process may run on) over its ranks' compute threads; None on GPUs."""
    if device.type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores / (per_node * torch.get_num_threads())


_MESH_NUMBERS = itertools.count()
"""Numbers the calibration's tp meshes' dimension names (the same on every rank: they make them in turn)."""


@contextmanager
def _tp_mesh(tp: int, device: torch.device) -> Iterator:
    """The tp dimension of a 2-D mesh of the world (groups of tp consecutive ranks) for one timing. When the
    timing ends -- on a collective of the world, so every rank is done with the mesh -- its process groups are
    destroyed and the mesh's hold on them dropped: DTensor's caches keep the mesh, and a destroyed gloo group
    still held kept its threads (4 gloo ranks timing the head at tp 2 and 4: 3 threads more per rank until the
    hold was dropped). Kept for the rest of the run, as they were, a layout="auto" fit held two groups per tp
    size it timed (on 8 ranks, 6 groups more than its layout's own); on GPUs each one used is an NCCL
    communicator with its buffers: device memory that no plan counts. A timing that raises leaves them (a
    destroy while other ranks may still wait in its collectives could hang them).

    The mesh's dimension names are its own: DTensor's caches take an equal mesh made later (the same ranks and
    names: the run's own tp dimension, or the next calibration's) for one they have seen, and would hand back
    the destroyed groups."""
    from torch.distributed.device_mesh import init_device_mesh

    number = next(_MESH_NUMBERS)
    names = (f"calibration{number}_rest", f"calibration{number}_tp")
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=names)
    yield mesh[names[1]]
    release_groups(*(mesh.get_group(dim) for dim in range(mesh.ndim)))
    mesh._pg_registry.clear()  # (the root mesh's: its dimensions' groups by name)


def _fresh_state(values: Any) -> Any:
    """The call's arguments for one more call: tensors as they are, any other object (a Hugging Face
    ``DynamicCache``, which a decoder layer appends its keys and values to) a copy of the captured one. Each step
    of the run makes its own; reused across timed calls, a cache would grow and carry the previous call's
    autograd graph into the next backward ("Trying to backward through the graph a second time")."""
    plain = (Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)
    return tree_map(lambda value: value if isinstance(value, plain) else copy.deepcopy(value), values)


def materialized(block: nn.Module, device: torch.device, *, in_place: bool = False,
                 dtype: torch.dtype = torch.float32) -> nn.Module:
    """A copy of ``block`` on ``device`` with random weights, its floating parameters and buffers in ``dtype``
    (the run's, :class:`RunPrecision`'s ``param_dtype``): values do not matter for timing, only that they are
    ordinary numbers (uninitialized memory can hold NaNs or denormals, which run slower on CPUs).

    ``in_place``: ``block`` itself, for a block already split over a tp mesh. A deep copy of its DTensors copies
    their mesh, and a mesh's copy looks its process groups up again and holds them: destroyed after the timing
    (``_tp_mesh``), they stayed alive in the copy, which DTensor's caches keep: one auto fit on 8 gloo ranks left
    5 groups per rank, 15 threads, for the rest of the process; on GPUs an NCCL communicator each."""
    timed = (block if in_place else copy.deepcopy(block)).to_empty(device=device).to(dtype)
    with torch.no_grad():
        for param in timed.parameters():
            local(param).normal_(0.0, 0.02)  # a tp shard: its own numbers (no DTensor random op, no collective)
        for buffer in timed.buffers():
            if buffer.is_floating_point():
                buffer.fill_(1.0)
            else:
                buffer.zero_()
    return timed.train()


def _inputs(call: tuple, batch_size: int, micro_batch_size: int, device: torch.device,
            dtype: torch.dtype = torch.float32) -> tuple:
    """The captured call's tensors made real on ``device``, the batch dimension resized: the first floating
    tensor of the call's shape (b, s, h) is the hidden state (it needs a gradient), the rest random
    (floating; an fp32 one in ``dtype``, the run's weights' dtype, which its activations take), zeros (integers)
    or True (masks)."""
    first = True

    def real(value: Any) -> Any:
        nonlocal first
        if not isinstance(value, Tensor):
            return value
        shape = list(value.shape)
        if shape and shape[0] == batch_size:
            shape[0] = micro_batch_size
        if value.is_floating_point():
            tensor = torch.randn(shape, dtype=dtype if value.dtype == torch.float32 else value.dtype, device=device)
            if first:
                first = False
                tensor.requires_grad_(True)
            return tensor
        if value.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool, device=device)
        return torch.zeros(shape, dtype=value.dtype, device=device)

    return tree_map(real, call)
