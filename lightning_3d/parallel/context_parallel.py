"""Context parallelism: the ranks of a "cp" group each keep a part of every sequence through the blocks.

Where the sequence is split. The blocks run on this rank's part; everything outside them runs on the whole
sequence, as in one process: the embeddings (so positions are the sequence's own, whatever the model
computes them from), the head, the loss and the user's step. At each block's call, every input that runs
along the sequence -- the hidden states entering the first block, rotary tables, position ids -- is cut to
this rank's part; the last block's output is gathered back to the whole sequence.

Load balance. The sequence is cut into ``2 * cp`` chunks and cp rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r``, so under a causal mask every rank attends to the same number of key positions (the
head-tail split of torchtitan and Megatron-LM)::

    cp=2, 8 positions:  chunks [0 1] [2 3] [4 5] [6 7]   rank 0 keeps 0 1 6 7, rank 1 keeps 2 3 4 5

Attention. While steps run (:func:`context_parallel_attention`), ``F.scaled_dot_product_attention`` is
replaced, as torch's own ``context_parallel`` replaces it: the keys and values of every cp rank are gathered
(their gradients reduce-scattered back; recomputed in backward, so only this rank's part is kept between
forward and backward), put in sequence order, and each chunk of this rank's queries attends
to the keys up to its own end, causally aligned at the lower right; an explicit mask is cut to this rank's query
rows. The result is exact: one process's attention, row by row.

Gradients. The loss is the whole sequence's, the same on every cp rank. The gathered output's backward keeps
this rank's rows scaled by ``cp``, and the split's backward gathers every rank's rows and divides by ``cp``:
the weights outside the blocks then get one process's gradient on every cp rank, and each block weight ``cp``
times this rank's share of it, so that the mean over the ranks that hold the same weights (dp x cp, what DDP
and FSDP2 compute) is one process's gradient at every weight.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.errors import ParallelConfigError


def local_positions(length: int, cp: int, rank: int) -> Tensor:
    """The positions of a sequence of ``length`` that cp rank ``rank`` keeps: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp``."""
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def check_length(length: int, cp: int) -> None:
    if length % (2 * cp):
        raise ParallelConfigError(
            f"context_parallel_size={cp} cuts each sequence into 2 x {cp} = {2 * cp} chunks, but the sequence"
            f" length is {length}. Use a sequence length divisible by {2 * cp} (pad the batch, or change the"
            f" block size), or another context_parallel_size.")


@dataclass
class ContextParallel:
    """The cp group and what this step's sequences look like on this rank."""

    group: dist.ProcessGroup
    cp: int
    rank: int
    sequence_parallel: dist.ProcessGroup | None = None
    """Under sequence parallelism, the tp group: the stream between blocks is then each tp rank's slice of the
    sequence (of the whole one before the first block and after the last, of this rank's part in between)."""
    length: int = 0
    """The whole sequence's length in this step (set at the first block's call)."""
    positions: Tensor | None = None
    order: Tensor | None = None
    """Chunk order: gathered chunks (rank-major, two per rank) -> sequence order."""
    attention_calls: int = 0
    """Attention products computed over the whole sequence so far (each block must compute one)."""
    checked: set = field(default_factory=set)
    """The blocks seen computing one."""

    def start(self, length: int, device: torch.device) -> None:
        if length == self.length and self.positions is not None and self.positions.device == device:
            return
        check_length(length, self.cp)
        self.length = length
        self.positions = local_positions(length, self.cp, self.rank).to(device)
        cp = self.cp
        self.order = torch.tensor([2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)],
                                  device=device)

    @property
    def local_length(self) -> int:
        return self.length // self.cp

    def split(self, x: Tensor, dim: int) -> Tensor:
        return _Split.apply(x, dim, self)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        return _Gather.apply(x, dim, self)

    def split_stream(self, x: Tensor) -> Tensor:
        """The stream entering the first block (the whole sequence, or under sequence parallelism this tp rank's
        slice of it) -> this rank's part (or this tp rank's slice of the part)."""
        if self.sequence_parallel is None:
            return self.split(x, 1)
        return _tp_slice(self.split(_tp_gather(x, self.sequence_parallel), 1), self.sequence_parallel)

    def gather_stream(self, x: Tensor) -> Tensor:
        """The inverse of :meth:`split_stream`, for the last block's output: this rank's part (or this tp rank's
        slice of it) -> the whole sequence (or this tp rank's slice of it). A part whole over tp -- the plan
        gathered the sequence slices leaving the block, as ``policy="auto"``'s does under sequence parallelism
        -- is gathered whole."""
        if self.sequence_parallel is None or x.shape[1] == self.local_length:
            return self.gather(x, 1)
        return _tp_slice(self.gather(_tp_gather(x, self.sequence_parallel), 1), self.sequence_parallel)

    def gather_chunks(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's part of ``x`` along ``dim`` (this rank's two chunks there), in sequence order; its
        gradient is summed over the ranks and cut back to this rank's part (no scaling: for keys and values)."""
        return _gather_in_order(x, dim, self, _AllGatherSum.apply(x, self.group, self.cp))


def _gather_in_order(x: Tensor, dim: int, cp: ContextParallel, stacked: Tensor) -> Tensor:
    """``stacked`` (cp, *x.shape): every rank's part; -> the whole sequence along ``dim``, in order."""
    dim = dim % x.dim()
    chunk = x.shape[dim] // 2
    shape = list(x.shape)
    pieces = stacked.reshape(cp.cp, *shape[:dim], 2, chunk, *shape[dim + 1:])
    pieces = pieces.movedim(0, dim).flatten(dim, dim + 1)  # (..., cp * 2, chunk, ...): rank-major chunks
    return pieces.index_select(dim, cp.order).flatten(dim, dim + 1)


class _AllGatherSum(torch.autograd.Function):
    """(cp, *x.shape): every cp rank's ``x``; backward: the gradients summed over the ranks, this rank's part."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
        ctx.group = group
        return _all_gather(x, group, size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.flatten(0, 1), group=ctx.group)
        return out, None, None


class _Split(torch.autograd.Function):
    """This rank's part of the whole sequence; backward: every rank's gradient (``cp`` times its share, module
    doc) gathered in order and divided by ``cp``."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, cp: ContextParallel) -> Tensor:
        ctx.dim, ctx.cp = dim, cp
        return x.index_select(dim, cp.positions)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp = ctx.cp
        stacked = _all_gather(grad, cp.group, cp.cp)
        return _gather_in_order(grad, ctx.dim, cp, stacked) / cp.cp, None, None


class _Gather(torch.autograd.Function):
    """The whole sequence from every rank's part; backward: this rank's rows of the gradient, times ``cp``."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, cp: ContextParallel) -> Tensor:
        ctx.dim, ctx.cp = dim, cp
        return _gather_in_order(x, dim, cp, _all_gather(x, cp.group, cp.cp))

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp = ctx.cp
        return grad.index_select(ctx.dim, cp.positions) * cp.cp, None, None


def _tp_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The tp ranks' slices of the sequence (dim 1) joined; backward: summed over them, this rank's slice."""
    size = dist.get_world_size(group)
    return _AllGatherSum.apply(x, group, size).movedim(0, 1).flatten(1, 2)


def _tp_slice(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    part = x.shape[1] // size
    return x.narrow(1, rank * part, part)


def _all_gather(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """(size, *x.shape): every rank's ``x``, stacked in rank order."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group)
    return out.view(size, *x.shape)


# ---------------------------------------------------------------------------------------------- the blocks

def apply_context_parallel(blocks: dict[str, nn.Module], cp: ContextParallel, *, first: str, last: str,
                           stage_starts: set[str] = frozenset()) -> None:
    """Hooks on ``blocks`` (this rank's, by name): each call's inputs along the sequence cut to this rank's
    part; the model's ``first`` block cuts the stream, its ``last`` gathers it (module doc). Under a pipeline
    the stream travels between stages as this rank's part: the first block of a later stage (``stage_starts``)
    receives it cut, and learns the sequence's length from it. At the first step, each block must have
    computed attention over the whole sequence."""
    names = {block: name for name, block in blocks.items()}
    calls_before: dict[nn.Module, int] = {}
    slices = dist.get_world_size(cp.sequence_parallel) if cp.sequence_parallel is not None else 1

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        calls_before[module] = cp.attention_calls
        name = names[module]
        if name != first and name not in stage_starts:
            return _map_sequence(args, cp), _map_sequence(kwargs, cp)
        key = 0 if args else "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs), None)
        hidden = args[0] if args else kwargs.get(key)
        if not isinstance(hidden, Tensor) or hidden.dim() < 2:
            raise TypeError(f"context parallelism: block {name!r}'s input is not a (batch, sequence, ...) tensor"
                            f" but {type(hidden).__name__}")
        if name != first:  # from the previous stage: already this rank's part (of this tp rank's slice)
            cp.start(hidden.shape[1] * slices * cp.cp, hidden.device)
        else:
            cp.start(hidden.shape[1] * slices, hidden.device)
            hidden = cp.split_stream(hidden)
        args, kwargs = _map_sequence(args[1:], cp), _map_sequence({k: v for k, v in kwargs.items() if k != key}, cp)
        return ((hidden, *args), kwargs) if key == 0 else (args, {key: hidden, **kwargs})

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if isinstance(output, Tensor):
            return cp.gather_stream(output)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (cp.gather_stream(output[0]), *output[1:])
        raise TypeError(f"context parallelism: the last block returned {type(output).__name__}, not hidden states")

    def routed(module: nn.Module, args: tuple, output: Any) -> None:
        """A block that computed no attention over the whole sequence mixed positions some other way, or not
        at all: either way its result is not one process's (module doc)."""
        if module in cp.checked:
            return
        if cp.attention_calls == calls_before[module]:
            raise ValueError(
                f"context parallelism: block {names[module]!r} ({type(module).__name__}) ran without calling"
                " torch.nn.functional.scaled_dot_product_attention, so its attention, or whatever else mixes"
                " positions in it (a hand-written softmax(q @ k.T), a convolution or a scan over the sequence),"
                " would see only this rank's part of each sequence. Compute attention with"
                " F.scaled_dot_product_attention (transformers models: attn_implementation='sdpa'), or train"
                " with context_parallel_size=1.")
        cp.checked.add(module)

    for block in blocks.values():
        block.register_forward_pre_hook(before, with_kwargs=True)
        block.register_forward_hook(routed)
    if last in blocks:
        blocks[last].register_forward_hook(after, with_kwargs=True)


def _map_sequence(value: Any, cp: ContextParallel) -> Any:
    """``value`` with every tensor that runs along the whole sequence (dim 1 of the sequence's length) cut to
    this rank's part; tuples, lists and dicts looked into (a rotary table comes as (cos, sin))."""
    if isinstance(value, Tensor):
        return cp.split(value, 1) if value.dim() >= 2 and value.shape[1] == cp.length else value
    if isinstance(value, tuple):
        return tuple(_map_sequence(v, cp) for v in value)
    if isinstance(value, list):
        return [_map_sequence(v, cp) for v in value]
    if isinstance(value, dict):
        return {k: _map_sequence(v, cp) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------- attention

@contextmanager
def context_parallel_attention(cp: ContextParallel) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` over the whole sequence for queries of this rank's part, while the
    context is entered (steps and their backward: a recomputed block calls it again in backward)."""
    plain = F.scaled_dot_product_attention

    def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> Tensor:
        if not cp.length or query.shape[-2] != cp.local_length:  # not on this step's parts: as it is
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
        if dropout_p:
            raise ValueError("context parallelism: attention dropout is not supported (dropout_p="
                             f"{dropout_p}); set the model's attention dropout to 0")
        cp.attention_calls += 1
        # Recomputed in backward: what backward keeps is this rank's queries, keys and values, not the
        # gathered keys and values nor the kernel's own saved tensors (the gather runs again there).
        return checkpoint(partial(_attention, cp, mask=attn_mask, causal=is_causal, scale=scale, gqa=enable_gqa,
                                  plain=plain), query, key, value, use_reentrant=False)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def _attention(cp: ContextParallel, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
               scale: float | None, gqa: bool, plain) -> Tensor:
    keys, values = cp.gather_chunks(k, -2), cp.gather_chunks(v, -2)
    options = dict(scale=scale, enable_gqa=gqa)
    if mask is not None:
        if mask.shape[-2] == cp.length:  # made for the whole sequence: this rank's query rows
            mask = mask.index_select(-2, cp.positions)
        return plain(q, keys, values, attn_mask=mask, **options)
    if not causal:
        return plain(q, keys, values, **options)
    chunk = cp.length // (2 * cp.cp)
    outputs = []
    for half, index in enumerate((cp.rank, 2 * cp.cp - 1 - cp.rank)):
        end = (index + 1) * chunk
        queries = q.narrow(-2, half * chunk, chunk)
        visible = torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(end - chunk)  # lower right
        outputs.append(plain(queries, keys.narrow(-2, 0, end), values.narrow(-2, 0, end), attn_mask=visible,
                             **options))
    return torch.cat(outputs, dim=-2)
