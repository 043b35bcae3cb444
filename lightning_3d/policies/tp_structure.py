"""How to split one block over tp, decided from what it computes (:mod:`~lightning_3d.policies.block_trace`)
and checked by running it as each tp rank would hold it.

A **region** is a set of column projections that read the residual stream (through a norm, or directly) and
the one row projection that reads only their outputs and adds back to the stream: attention (q, k, v -> o),
an MLP (up, gate -> down), fused or not, in one module or spread over siblings. Each rank keeps

* in an attention region, the q heads ``[r H/tp, (r+1) H/tp)`` and their kv heads, i.e. of every column
  projection exactly the output features those heads read (a fused ``q|k|v`` included);
* in an MLP region, the row projection's inputs ``[r I/tp, (r+1) I/tp)`` and, of every column projection,
  the features that reach them (a fused ``gate|up``: this rank's gates and their ups).

A column projection's kept features must be one placement of its weight: a contiguous slice per rank
(``Shard``: separate projections, GPT-NeoX's head-major fused ``query_key_value``) or the same slice of each
of k equal parts (``_StridedShard``: nanoGPT's ``[q | k | v]``, Phi-3's ``[gate | up]``), or its chunk of
each of unequal parts (Phi-3's ``[q | k | v]`` with fewer kv heads: stored in rank order,
``lightning_3d.fused_parts``).

Then the integer attributes the block's modules (and their configs) reshape by must become per-rank values.
No names are assumed: candidates are the integers that equal a size the split divides, and the smallest set
of them whose division makes the block, shrunk to one rank, trace the same heads and the same features at
the row projection as the whole block restricted to that rank, is the answer -- checked on every rank. Where
no set does, because the code reads a size from its input (``B, T, C = x.size()``), the region's input
module is given this rank's slice of the hidden features (its columns gather them back, one all-gather) and
the search runs again (:mod:`~lightning_3d.policies.tp_per_rank`). A region no set of fixes makes right is
not split, with the reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_3d.common import join_fqn
from lightning_3d.fused_parts import FusedParts
from lightning_3d.policies.block_trace import STREAM, BlockTrace, _features, is_projection, trace_block
from lightning_3d.policies.experts import ExpertsLayout, experts_layouts
from lightning_3d.policies.feature_weights import split_with_features
from lightning_3d.policies.inner_rows import head_slices
from lightning_3d.policies.reductions import across_ranks
from lightning_3d.policies.tp_per_rank import attention_events, find_fixes, find_inner, prefixes, split_columns
from lightning_3d.policies.read_sizes import attribute_reads


@dataclass
class Region:
    """One tensor-parallel region of a block (FQNs relative to the block)."""

    columns: list[str]
    row: str
    heads: int | None = None
    """Query heads (attention regions), else None."""
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Column -> the sizes of its fused parts, of which each rank keeps one chunk each (one part: a slice)."""
    whole: dict[str, tuple[bool, ...]] = field(default_factory=dict)
    """Column -> per part, whether every rank keeps it whole (k and v of fewer kv heads than tp ranks)."""
    owned: dict[str, list[Tensor]] = field(default_factory=dict)
    """Column (or inner row whose outputs split with the heads) -> per tp rank, the output features it keeps
    (global indices, in order)."""
    picked: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Column the heads cut into slices of unequal sizes, some empty (ZAYA's two value projections: the first
    kv heads' values come from one, the others' from the other) -> per tp rank, its slice: no placement holds
    that, so every rank keeps the weight whole (one whole part) and computes its slice's outputs only."""
    input_module: str | None = None
    """The module whose first input is this region's hidden states and holds no other reader of them (it
    gathers them once for every column); None: each column gathers its own input."""
    changed_in_place: set[str] = field(default_factory=set)
    """Its projections whose outputs the block changes in place: they get their own copy of the local output
    (a DTensor's local tensor may not be changed in place under autograd)."""
    narrow_input: bool = False
    """The input module takes this rank's slice of the hidden features and the columns gather them back: for
    code that reads sizes from its input's width (nanoGPT's ``B, T, C = x.size()``, then ``view(B, T, C)``)."""
    head_inputs: list = field(default_factory=list)
    """The block's inputs of one slice per head (ALiBi), which each rank gets cut to its heads
    (:mod:`~lightning_3d.policies.head_inputs`)."""
    head_weights: dict[str, list[str]] = field(default_factory=dict)
    """Module holding the region -> its own weights of one value per head (attention sinks), split with the
    heads (:mod:`~lightning_3d.policies.head_weights`)."""
    weight_parts: dict[str, dict[str, tuple[tuple[int, ...], tuple[bool, ...]]]] = field(default_factory=dict)
    """Module holding the region -> its own weights and buffers of one value per feature that split with the
    features (in ``head_weights``) -> the sizes of the parts along their split dimension, of which each rank
    keeps one chunk each, and which of them every rank keeps whole
    (:mod:`~lightning_3d.policies.feature_weights`)."""
    depthwise: dict[str, tuple[tuple[int, ...], tuple[bool, ...]]] = field(default_factory=dict)
    """Depthwise convolution on the columns' outputs (a short convolution, Mamba's ``conv1d``) -> the sizes of
    the parts of its channels, of which each rank keeps one chunk each, and which of them every rank keeps
    whole: its weights, one filter per channel, split with the channels (in ``head_weights``, under the module
    holding both)."""
    feeders: dict[str, bool] = field(default_factory=dict)
    """The low-rank projections that read the hidden states and feed the columns (MLA's ``q_a_proj``,
    ``kv_a_proj_with_mqa``, whose rotary part also reaches every head's key directly) -> whether its outputs
    divide by tp. Every rank computes their whole output: split by output features and gathered, or whole.
    Inside such a region all computes on local tensors, whose gradients are each rank's share, summed once
    where the hidden states enter (``HiddenStates(partial_gradient=True)``)."""
    inner_rows: list[str] = field(default_factory=list)
    """Projections inside the region that read only its columns and feed its heads (Mamba's ``x_proj``: every
    channel's step size, and the B and C all channels share): split by their inputs, their outputs summed over
    tp, both ways -- each rank's gradient of them is its own channels' share. One in ``owned`` (Doge's
    ``dt_proj``: each rank's heads read their own slice of its outputs) is reduce-scattered instead
    (:mod:`~lightning_3d.policies.inner_rows`)."""
    on_inner_rows: list[str] = field(default_factory=list)
    """Modules with weights on an inner row's output (Jamba's norms of B, C and the step size): whole on every
    rank, their gradients summed over tp."""
    on_local: list[str] = field(default_factory=list)
    """Modules with weights on the columns' split outputs that compute each rank's share from its share alone (a
    relative position bias's bank of profiles, which every head's states mix): whole on every rank, run on its
    local tensors, their gradients summed over tp (:func:`~lightning_3d.policies.tp_per_rank.find_inner`)."""
    on_feeders: list[str] = field(default_factory=list)
    """The other modules with weights inside such a region (MLA's ``q_a_layernorm`` on a feeder's output, a
    sparse-attention indexer): whole on every rank, their gradients summed over tp."""
    fixes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Module -> attribute -> its value on each tp rank (``config.<name>``: a value of the module's config);
    :func:`attribute_values` turns them into what to set."""
    inner: dict[str, int] = field(default_factory=dict)
    """Module with weights of its own that runs on the columns' split outputs (Qwen3's per-head ``q_norm``,
    OLMo 2's ``q_norm`` over all of q) -> the dimension of its input that tp splits. Its weights stay whole on
    every rank and it runs on a DTensor of this rank's share, which completes what the share alone would get
    wrong: a per-head weight's gradient (this rank's heads only) is summed over tp; a norm over the split
    features is taken over all of them."""


@dataclass
class BlockSplit:
    regions: list[Region] = field(default_factory=list)
    experts: dict[str, ExpertsLayout] = field(default_factory=dict)
    """Experts module (:mod:`~lightning_3d.policies.experts`) -> where its intermediate features are."""
    gathered: list[str] = field(default_factory=list)
    """Projections outside every region that read the residual stream and whose output the block uses whole,
    in no region's computation (RWKV's receptance gate on its MLP's output): split by output features, their
    output gathered (:func:`_gathered`)."""
    left: dict[str, str] = field(default_factory=dict)
    """Projection (or experts module) left whole -> why."""
    problem: str | None = None
    """Why the block could not be traced at all (then every projection is left whole)."""
    routed: bool = False
    """The block chooses among values by a projection's output (top-k, argmax: a router's logits)."""


def split_block(block: nn.Module, args: tuple, kwargs: dict, tp: int) -> BlockSplit:
    """The regions of ``block`` (on the meta device, run on its captured inputs) and how each splits."""
    with attribute_reads(block) as read:
        whole = trace_block(block, args, kwargs)
    if whole.problem:
        return BlockSplit(problem=whole.problem)
    whole.attribute_reads = {fqn: frozenset(names) for fqn, names in read.items()}
    on_stream = _on_stream(whole)
    if on_stream:  # what they compute is replicated as the stream is: what reads them reads the stream
        whole.reads = {p: (r - on_stream) | {STREAM} if r & on_stream and p not in on_stream else r
                       for p, r in whole.reads.items()}
    split = BlockSplit(left={p: "it computes from the residual stream what scales it, the same on every rank"
                             for p in on_stream}, routed=bool(whole.selects))
    claimed: set[str] = set()
    for row in whole.order:
        reads = whole.reads[row]
        if row not in whole.exits or not reads or STREAM in reads:
            continue
        region, feeders, columns, inner, why = _read_region(whole, reads, row, tp)
        if region is None:
            _leave(split, [*feeders, *columns, *inner, row], why)
            continue
        region.input_module = _input_module(whole, [c for c in whole.order if c in feeders or c in columns
                                                    and whole.reads[c] == frozenset({STREAM})], only_columns=not feeders)
        if feeders:
            if region.input_module is None:
                _leave(split, [*feeders, *columns, row], "its low-rank projections and the columns they feed"
                       " are in no one module that takes the hidden states")
                continue
            region.feeders = {f: whole.sizes[f][1] % tp == 0 for f in feeders}
        region.changed_in_place = whole.changed_in_place & {row, *columns}
        region.head_weights = _head_weights(block, whole, region)
        event = next(iter(attention_events(whole, [*columns, *feeders, *inner])), None)
        for holder, cuts in split_with_features(block, whole, row, event, region.heads, tp, _parts).items():
            held = region.head_weights.setdefault(holder, [])
            held += [n for n in cuts if n not in held]
            region.weight_parts.setdefault(holder, {}).update(cuts)
        why = _channel_weights(block, whole, region, tp)
        if why:
            _leave(split, [*feeders, *columns, row], why)
            continue
        why = (find_fixes(block, args, kwargs, whole, region, tp) or find_inner(block, args, kwargs, whole, region, tp)
               or _find_whole_inside(block, region) or _reductions_cut(whole, region, tp))
        if why:
            _leave(split, [*region.feeders, *columns, *inner, row], why)
            continue
        region.on_inner_rows = [m for m, (reads_of, _) in whole.weighted_inputs.items()
                                if inner and reads_of and reads_of <= set(inner)]
        split.regions.append(region)
        claimed.update([row, *columns, *region.feeders, *inner, *region.on_feeders, *region.on_inner_rows])
    for name, (layout, why) in experts_layouts(block, args, kwargs, tp).items():
        if layout is None:
            split.left[name] = why
        else:
            split.experts[name] = layout
    split.gathered = _gathered(block, whole, claimed | set(split.left), tp)
    for name in whole.order:
        if name not in claimed and name not in split.left and name not in split.gathered:
            split.left[name] = ("it reads the residual stream but no row projection of a region reads it"
                                if whole.reads[name] == frozenset({STREAM}) else "it is in no attention or MLP region")
    for name, module in block.named_modules():  # a cross-attention called without encoder states
        if is_projection(module) and name not in whole.sizes and name not in whole.grouped:
            split.left.setdefault(name, "it does not run in the block's forward as the model calls it (traced on"
                                  " the block's captured inputs): no split of it can be checked")
    return split


def _gathered(block: nn.Module, trace: BlockTrace, taken: set[str], tp: int) -> list[str]:
    """The projections outside every region (``taken``: those in regions, and those of regions that could not
    be split) that can split by output features and gather their output whole: each reads the residual stream
    alone (replicated on every rank), computes a projection only (its class's own forward is the plain one),
    and feeds no projection of a region (so what reads its output computes the same on every rank, and its
    gradient is whole there). Not a router: the experts it picks would be read off a gathered output at every
    step, for a few features each."""
    return [p for p in trace.order if p not in taken and trace.reads[p] == frozenset({STREAM})
            and trace.sizes[p][1] % tp == 0 and p not in trace.selects and _plain(block.get_submodule(p))
            and not any(p in trace.reads.get(q, ()) for q in taken)]


def _plain(projection: nn.Module) -> bool:
    """An ``nn.Linear`` or ``Conv1D`` whose forward is its class's own (a subclass may return more: a router's
    choice)."""
    own = type(projection).forward
    return own is nn.Linear.forward or (type(projection).__name__ == "Conv1D" and "Conv1D" in own.__qualname__)


def _on_stream(trace: BlockTrace) -> set[str]:
    """The projections whose output reaches other projections only mixed with the residual stream (AXK2's
    norm, scaled by a small MLP of the stream), and those that feed only them: each stays whole and computes
    the same on every rank, so what reads it reads the stream."""
    found: set[str] = set()
    while True:  # and the projections that feed only those (the small MLP's first layer)
        more = {p for p in trace.order if p not in found and p not in trace.exits
                and (readers := [q for q in trace.order if p in trace.reads[q]])
                and all(STREAM in trace.reads[q] or q in found for q in readers)}
        if not more:
            return found
        found |= more


def _leave(split: BlockSplit, names: list[str], why: str) -> None:
    for name in names:
        split.left.setdefault(name, why)


def _feeders(trace: BlockTrace, reads: frozenset[str]) -> tuple[list[str], str]:
    """The low-rank projections behind a row's columns (MLA's ``q_a_proj`` and ``kv_a_proj_with_mqa``): the
    projections read by a column of the row, each of which reads the residual stream alone; and why not, when
    a column reads something else or one of them gives the heads their values."""
    feeders: list[str] = []
    for column in trace.order:
        if column not in reads or trace.reads[column] == frozenset({STREAM}):
            continue
        for source in sorted(trace.reads[column]):
            if source == STREAM or trace.reads.get(source) != frozenset({STREAM}):
                return feeders, "it reads projections that do not read the residual stream, nor projections that do"
            if source not in feeders:
                feeders.append(source)
    values = [f for f in feeders if any(f in head for event in trace.attention for head in event.v)]
    if values:  # (Doge's v_proj, which dt_proj reads: an inner row)
        return feeders, f"{', '.join(values)} give the heads their values: not low-rank projections feeding columns"
    return [f for f in trace.order if f in feeders], ""


def _read_region(trace: BlockTrace, reads: frozenset[str], row: str, tp: int):
    """(region or None, feeders, columns, inner rows, why not) of the projections ``row`` reads: its columns
    with the low-rank projections feeding them (MLA), else with the projections inside that read only them
    (Mamba's ``x_proj``)."""
    tried = []
    for inner in ([], _inner_rows(trace, reads)):
        if tried and not inner:
            break
        feeders, why = _feeders(trace, reads - set(inner))
        columns = [c for c in trace.order if c in reads and c not in feeders and c not in inner]
        region = None
        if not why:
            region, why = _region(trace, columns, row, tp, feeders, inner)
        if region is not None:
            return region, feeders, columns, inner, ""
        tried.append((feeders, columns, inner, why))
    return None, *tried[0]


def _inner_rows(trace: BlockTrace, reads: frozenset[str]) -> list[str]:
    """The projections a row reads that read only the row's columns and do not exit (Mamba's ``x_proj``, from
    every channel to the step sizes and the B and C all channels share)."""
    columns = {c for c in reads if trace.reads[c] == frozenset({STREAM})}
    return [p for p in trace.order if p in reads and p not in columns and p not in trace.exits
            and trace.reads[p] and trace.reads[p] <= columns]


def _region(trace: BlockTrace, columns: list[str], row: str, tp: int,
            feeders: list[str] = (), inner: list[str] = ()) -> tuple[Region | None, str]:
    width = trace.sizes[row][0]
    if width % tp:
        return None, f"{row}'s {width} inputs do not divide by tensor_parallel_size={tp}"
    if inner and (feeders or not attention_events(trace, [*columns, *inner])):
        return None, f"{', '.join(inner)} read{'s' if len(inner) == 1 else ''} the columns' outputs outside an attention or scan"
    events = attention_events(trace, [*columns, *feeders, *inner])
    if len(events) > 1:
        return None, "it holds more than one attention product"
    owned: dict[str, list[set[int]]] = {c: [set() for _ in range(tp)] for c in columns}
    heads = None
    if events:
        event = events[0]
        heads = len(event.q)
        if heads % tp:
            return None, f"its {heads} heads do not divide by tensor_parallel_size={tp}"
        if len(event.v) != heads:
            return None, (f"the product of its {heads} heads' scores with their values was not found (values of"
                          f" {len(event.v)} heads): what each head reads is not known")
        for h in range(heads):
            rank = h // (heads // tp)
            # (and the terms added to its scores: a relative position bias, sinks, from projections of their own)
            for side in (event.q[h], event.k[h], event.v[h], *event.scores[h:h + 1]):
                for name, feats in side.items():
                    if name not in feeders and name not in inner:  # (MLA's shared rotary key; Mamba's B and C)
                        owned[name][rank] |= feats
        # What else reaches the row with the heads' outputs is this rank's too: a gate on each head's output
        # (gated attention: its own projection, or fused with q), read off the row's input positions.
        for name, slots in trace.row_inputs.get(row, {}).items():
            for rank in range(tp if name in owned else 0):
                part = slice(rank * width // tp, (rank + 1) * width // tp)
                owned[name][rank] |= set(_features(s[part] for s in slots))
    else:
        inputs = trace.row_inputs.get(row, {})
        if set(inputs) != set(columns):
            return None, "its features could not be followed to the row projection"
        for name, slots in inputs.items():
            for rank in range(tp):
                part = slice(rank * width // tp, (rank + 1) * width // tp)
                owned[name][rank] = set(_features(s[part] for s in slots))
    region = Region(columns=columns, row=row, heads=heads)
    for name in columns:
        out = trace.sizes[name][1]
        sets = owned[name]
        if not any(sets):  # it reaches the heads only past what moves features (a sum over a window): whole
            sets[:] = [set(range(out)) for _ in range(tp)]
        holders = Counter(f for share in sets for f in share)
        shared = {f for f, count in holders.items() if count == tp}  # fewer kv heads than ranks: every rank's
        if set(holders) != set(range(out)) or any(count not in (1, tp) for count in holders.values()):
            kv = " (fewer key/value heads than tp ranks, but more than one?)" if heads else ""
            return None, f"the ranks' shares of {name}'s {out} outputs overlap or leave some out{kv}"
        parts = _parts([sorted(share) for share in sets], out, tp, shared if tp > 1 else set())
        if parts is None and not shared and _uneven_slices(sets):
            region.picked[name] = tuple(tuple(sorted(share)) for share in sets)
            parts = (out,), (True,)
        if parts is None:
            return None, (f"each rank's share of {name}'s outputs is not its chunk of each of consecutive parts (one"
                          " slice, or one chunk of each of a fused projection's parts, or a part every rank keeps)")
        region.parts[name], region.whole[name] = parts
        region.owned[name] = [torch.tensor(sorted(s), dtype=torch.long) for s in sets]
    for name in inner:
        why = _inner_row_split(trace, name, owned, tp)
        if why:
            return None, why
        slices = head_slices(events[0], name, trace.sizes[name][1], heads, tp)
        if slices is not None:  # rank r keeps its slice of the summed outputs
            region.owned[name] = slices
    region.inner_rows = list(inner)
    return region, ""


def _uneven_slices(shares: list[set[int]]) -> bool:
    """Whether the ranks' shares are consecutive slices in rank order, some empty or of other sizes."""
    flat = [f for share in shares for f in sorted(share)]
    return flat == list(range(len(flat))) and len({len(share) for share in shares}) > 1


def _inner_row_split(trace: BlockTrace, name: str, owned: dict[str, list[set[int]]], tp: int) -> str:
    """Why the inner row ``name`` does not split by its inputs as the columns' features it reads do: rank r's
    slice of its inputs must hold features rank r keeps."""
    width = trace.sizes[name][0]
    if width % tp:
        return f"{name}'s {width} inputs do not divide by tensor_parallel_size={tp}"
    for column, slots in trace.row_inputs.get(name, {}).items():
        for rank in range(tp):
            part = slice(rank * width // tp, (rank + 1) * width // tp)
            if column not in owned or not set(_features(s[part] for s in slots)) <= owned[column][rank]:
                return f"{name} reads at each rank's inputs features another rank keeps"
    return "" if trace.row_inputs.get(name) else f"{name}'s inputs could not be followed to the columns"


def _parts(owned: list[list[int]], out: int, tp: int,
           shared: set[int]) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """The sizes of the consecutive parts of which rank r keeps chunk r each (one part: one slice per rank;
    a fused ``q|k|v``: three, unequal with fewer kv heads), and which of them every rank keeps whole (the
    ``shared`` features: key/value heads fewer than the ranks); None if the shares are not such a cut. The
    parts are read off rank 0's share (each run of consecutive features, all shared or none, is its chunk of
    one part or a whole part), then every rank is checked against them."""
    runs, start = [], 0
    mine = owned[0]
    for i in range(1, len(mine) + 1):
        if i == len(mine) or mine[i] != mine[i - 1] + 1 or (mine[i] in shared) != (mine[i - 1] in shared):
            runs.append((mine[start], i - start, mine[start] in shared))
            start = i
    sizes = tuple(length if whole else length * tp for _, length, whole in runs)
    whole = tuple(w for _, _, w in runs)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    if sum(sizes) != out or [s for s, _, _ in runs] != starts:
        return None
    held = FusedParts(0, sizes, tp, whole)
    if all(owned[r] == held.held_by(r) for r in range(tp)):
        return sizes, whole
    return None


def _input_module(trace: BlockTrace, columns: list[str], only_columns: bool = True) -> str | None:
    """The innermost module that received the region's input as its first tensor, holds every column, and
    in which nothing but the columns read that input (``only_columns``; else anything may)."""
    seen = [set(trace.input_id.get(c, [])) for c in columns]
    common = set.intersection(*seen) if seen else set()
    candidates = [m for m in common if m and all(_inside(c, m) for c in columns)]
    for module in sorted(candidates, key=lambda m: -m.count(".")):
        readers = [stack for stack in trace.input_readers.get(columns[0], []) if module in stack]
        if not only_columns or all(any(c in stack for c in columns) for stack in readers):
            return module
    return None


def _find_whole_inside(block: nn.Module, region: Region) -> str:
    """In a region computed on local tensors (one with feeders), set ``region.on_feeders``: every other module
    with weights inside the region's input module (the feeders' norms; a sparse-attention indexer), each whole
    on every rank with its gradients summed over tp; not one whose weights all split with the heads (Kimi's
    forget gate: ``A_log`` per head, ``dt_bias`` per feature). The reason when the input module holds weights
    itself."""
    if not region.feeders:
        return ""
    styled = {*region.columns, region.row, *region.feeders, *region.inner}
    own = [n for n, _ in block.get_submodule(region.input_module).named_parameters(recurse=False)
           if n not in region.head_weights.get(region.input_module, [])]
    if own:
        return (f"{region.input_module} holds weights of its own ({', '.join(own)}) beside its low-rank projections,"
                " which tp would see as each rank's share")
    region.on_feeders = [name for name, module in block.named_modules()
                         if name != region.input_module and _inside(name, region.input_module)
                         and not any(_inside(name, s) for s in styled)
                         and any(n not in region.head_weights.get(name, []) for n, _ in module.named_parameters(recurse=False))]
    return ""


def _reductions_cut(whole: BlockTrace, region: Region, tp: int) -> str:
    """Why not, when code outside the region's inner modules reduces over features several ranks hold."""
    for reduction in across_ranks(whole.reductions, region.owned, tp):
        if not any(_inside(m, inner) for m in reduction.stack for inner in region.inner):
            where = reduction.stack[-1] if reduction.stack else "the block"
            return (f"{where} reduces over features of {', '.join(reduction.features)} that the split puts on"
                    " different ranks (a norm or sum over all of them, not in a module of its own): each rank"
                    " would reduce its share only")
    return ""


def _inside(fqn: str, module: str) -> bool:
    return fqn == module or fqn.startswith(module + ".")


def _head_weights(block: nn.Module, whole: BlockTrace, region: Region) -> dict[str, list[str]]:
    """The weights of one value (or row) per head of the modules holding an attention region (its row and the
    columns it splits, not one every rank keeps whole): their own, and
    those of a projection they hold but never call, whose weight they read per head (Mamba's ``dt_proj``)."""
    if not region.heads:
        return {}
    found = {}
    for holder in sorted({prefix for name in [region.row, *split_columns(region)] for prefix in prefixes(name)}):
        module = block.get_submodule(holder)
        names = [n for n, p in module.named_parameters(recurse=False) if p.dim() and p.shape[0] == region.heads]
        for child, sub in module.named_children():
            if (is_projection(sub) and join_fqn(holder, child) not in whole.sizes
                    and sub.weight.shape[0] == region.heads):
                names += [f"{child}.{n}" for n, _ in sub.named_parameters()]
        if names:
            found[holder] = names
    return found


def _channel_weights(block: nn.Module, whole: BlockTrace, region: Region, tp: int) -> str:
    """Set ``region.depthwise``, the depthwise convolutions on the region's columns (one filter per channel)
    and how their channels split: rank r keeps the channels whose features it keeps, which must be its chunk of
    each of consecutive parts (one slice; a convolution over ``[q | k | v]``: three). Their weights go to
    ``region.head_weights``, under the innermost module holding the region and the convolution: the model may
    read them from there without calling the convolution's own forward (transformers' ``causal_conv1d_forward``)."""
    for module, channels in whole.depthwise.items():
        if not channels or not all(set(c) <= set(region.columns) for c in channels):
            continue
        owned = [{n: set(region.owned[n][r].tolist()) for n in region.columns} for r in range(tp)]
        held = [[c for c, feats in enumerate(channels) if all(f <= owned[r][n] for n, f in feats.items())]
                for r in range(tp)]
        holders = Counter(c for share in held for c in share)
        shared = {c for c, count in holders.items() if count == tp}  # B and C of fewer groups than ranks
        parts = _parts(held, len(channels), tp, shared if tp > 1 else set())
        if parts is None or set(holders) != set(range(len(channels))) or set(holders.values()) - {1, tp}:
            return f"{module}'s channels do not split as the features they hold do"
        region.depthwise[module] = parts
        names = [region.row, *region.columns, module]
        holder = max(set.intersection(*(set(prefixes(n)) for n in names)), key=lambda m: m.count(".") + bool(m))
        relative = module[len(holder) + 1:] if holder else module
        region.head_weights.setdefault(holder, []).extend(
            f"{relative}.{name}" for name, _ in block.get_submodule(module).named_parameters(recurse=False))
    return ""
