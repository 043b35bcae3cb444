"""A split region as one tp rank holds it: the block shrunk to the rank's share, traced again, and checked
against the rank's part of the whole block's trace (:mod:`~lightning_3d.policies.tp_structure` decides the
split). The per-rank values of the integer attributes the block reshapes by are found here, as the smallest
set whose division makes every rank's trace right; so are the modules with weights inside a region and the
dimension of their input that tp cuts. ``region`` is a :class:`~lightning_3d.policies.tp_structure.Region`
(not imported here: tp_structure imports this module)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.common import join_fqn
from lightning_3d.fused_parts import FusedParts
from lightning_3d.policies import head_inputs
from lightning_3d.policies.block_trace import BlockTrace, meta_copy, meta_like, trace_block
from lightning_3d.policies.feature_weights import split_dim
from lightning_3d.policies.split_inputs import SplitInputs
from lightning_3d.policies.read_sizes import changes_trace
from lightning_3d.policies.reductions import across_ranks

_MAX_FIXES = 4
"""The most attributes one region's fix may change (the search is over subsets of the candidates)."""


def attention_events(trace: BlockTrace, columns) -> list:
    """The attention products whose q, k and v come from ``columns`` only."""
    return [e for e in trace.attention if _channels(e) and _channels(e) <= set(columns)]


def _channels(event) -> set[str]:
    return {name for side in (event.q, event.k, event.v, event.scores) for head in side for name in head}


def find_fixes(block: nn.Module, args, kwargs, whole: BlockTrace, region: Region, tp: int) -> str:
    """Set ``region.fixes`` to the smallest set of divided attributes under which every rank's shrunk block
    traces as the whole one does on that rank; the reason when none does."""
    candidates = [c for c in _candidates(block, whole, region, tp) if _read(whole, c[0], c[1])
                  # a config size only if the block computes with it
                  and (not c[1].startswith("config.")
                       or changes_trace(block, args, kwargs, whole, attribute_values(block, {c[0]: {c[1]: c[3]}})))]
    first, failures = "", {}  # the try as it is; per way of cutting the inputs, its last try
    # Inputs of one slice per head are cut only when no set of attributes does without them; a narrowed
    # input costs an all-gather per region: tried only when neither does.
    per_head = head_inputs.candidates(args, kwargs, region.heads) if region.heads else []
    for narrow in (False, True) if region.input_module is not None else (False,):
        region.narrow_input = narrow
        for cut in [[]] + [[key] for key in per_head]:
            region.head_inputs = cut
            reference = whole
            if cut:  # its elements followed in the whole block too: which reach each head's scores
                whole_args, whole_kwargs, marked = head_inputs.traced(args, kwargs, cut, region.heads)
                reference = trace_block(block, whole_args, whole_kwargs, inputs=marked)
            for chosen in _subsets(candidates):
                fixes = _as_fixes(chosen, tp)
                why = _check_rank(block, args, kwargs, reference, region, fixes, 0, tp)
                if why:
                    if first:
                        failures[region.narrow_input, tuple(cut)] = f"{_attempt(chosen, region)}: {why}"
                    else:
                        first = f"as it is: {why}"
                    continue
                for rank in range(1, tp):
                    why = _check_rank(block, args, kwargs, reference, region, fixes, rank, tp)
                    if why:
                        return f"rank {rank} of tp would compute otherwise: {why}"
                region.fixes = fixes
                return ""
    region.narrow_input, region.head_inputs = False, []
    ints = {f"{m or '<block>'}.{a}": v for m, a, v, _ in candidates}
    return (f"split over tp it does not compute what one process does ({'; '.join([first, *failures.values()])});"
            f" the integer attributes tried: {ints or 'none'}")


def _read(whole: BlockTrace, holder: str, attribute: str) -> bool:
    """Whether the whole block's forward read ``attribute`` (``config.<name>``: a value of its config) of the
    module ``holder``: one it never read cannot change what a rank computes."""
    owner, _, name = join_fqn(holder, attribute).rpartition(".")
    return name in whole.attribute_reads.get(owner, ())


def _attempt(chosen, region: Region) -> str:
    """How one try of :func:`find_fixes` shrank the block, in words."""
    names = [f"{holder or '<block>'}.{attribute}" for holder, attribute, _, _ in chosen]
    said = [f"with {', '.join(names)} divided"] if names else []
    if region.narrow_input:
        said.append(f"{region.input_module or '<block>'} given each rank's hidden features")
    said += [f"the block's {head_inputs.in_words(key)} cut to each rank's heads" for key in region.head_inputs]
    return ", ".join(said) or "as it is"


def _subsets(candidates: list[tuple[str, str, int, int]]):
    """The sets of candidates to try, smallest first: of the modules' own attributes, then of these and their
    configs' values (fewer, and what a forward reads most often, come first: Mamba-2's mixer has 6 attributes
    and 8 config values of a size the split divides)."""
    own = [c for c in candidates if not c[1].startswith("config.")]
    for size in range(min(len(own), _MAX_FIXES) + 1):
        yield from itertools.combinations(own, size)
    if len(own) < len(candidates):
        for size in range(1, min(len(candidates), _MAX_FIXES) + 1):
            yield from (chosen for chosen in itertools.combinations(candidates, size)
                        if any(c[1].startswith("config.") for c in chosen))


def _candidates(block: nn.Module, whole: BlockTrace, region: Region, tp: int) -> list[tuple[str, str, int, int]]:
    """(module, attribute, value, its value on each rank) for the integer attributes, on the modules holding the
    region's projections (and their ``config``), whose value is a size the split changes: one it divides, or
    the sum of consecutive parts of a fused output or of a convolution's channels, some of which every rank
    keeps whole (Mamba-2's ``conv_dim``: x, B and C, with B and C of one group whole on every rank)."""
    local = _local_sizes(block, whole, region, tp)
    holders = sorted({prefix for name in [region.row, *split_columns(region)] for prefix in prefixes(name)}
                     | {m for m in region.depthwise if m in whole.weighted_inputs}  # a convolution that ran itself
                     | {owner for owner, _ in _split_weights(block, region)})  # RG-LRU: heads of its split gates
    found: list[tuple[str, str, int, int]] = []
    for holder in holders:
        module = block.get_submodule(holder)
        found += [(holder, a, v, local[v]) for a, v in sorted(vars(module).items()) if type(v) is int and v in local]
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (nn.Module, Tensor)):
            found += [(holder, f"config.{a}", v, local[v]) for a, v in sorted(vars(config).items())
                      if type(v) is int and v in local]
    return found


def _local_sizes(block: nn.Module, whole: BlockTrace, region: Region, tp: int) -> dict[int, int]:
    """Size -> its value on each rank, for the sizes the split changes (see :func:`_candidates`)."""
    sizes = {whole.sizes[region.row][0], *(whole.sizes[c][1] for c in split_columns(region))}
    if region.heads:
        sizes |= {region.heads} | _kv_head_counts(region, whole)
    local = {s: s // tp for s in sizes if s and s % tp == 0}
    fused = [(parts, region.whole.get(c) or (False,) * len(parts)) for c, parts in region.parts.items()]
    for parts, kept in [*fused, *region.depthwise.values()]:
        for i in range(len(parts)):
            for j in range(i + 1, len(parts) + 1):
                total = sum(parts[i:j])
                mine = sum(size if keep else size // tp for size, keep in zip(parts[i:j], kept[i:j]))
                if total != mine:
                    local.setdefault(total, mine)
    for module, (parts, kept) in region.depthwise.items():  # a grouped convolution's groups (one per head)
        groups, held = getattr(block.get_submodule(module), "groups", None), len(FusedParts(0, parts, tp, kept).held_by(0))
        if type(groups) is int and groups > 1 and groups * held % sum(parts) == 0:
            local.setdefault(groups, groups * held // sum(parts))
    for owner, weight in _split_weights(block, region):  # its heads or features, a size the module may reshape by
        size = weight.shape[split_dim(weight)]
        if size % tp == 0:
            local.setdefault(size, size // tp)
    split = {join_fqn(holder, name) for holder, names in region.head_weights.items() for name in names}
    for name, groups in whole.stacks.items():  # the groups of heads a batched product reads a split weight as
        if name in split and groups % tp == 0:
            local.setdefault(groups, groups // tp)
    return local


def _split_weights(block: nn.Module, region: Region) -> list[tuple[str, Tensor]]:
    """(owner, weight) of the weights split with the region's features, not a convolution's (its channels are
    the parts above)."""
    found = []
    for holder, names in region.head_weights.items():
        for name in names:
            owner, _, leaf = join_fqn(holder, name).rpartition(".")
            if owner not in region.depthwise:
                found.append((owner, getattr(block.get_submodule(owner), leaf)))
    return found


def _kv_head_counts(region: Region, whole: BlockTrace) -> set[int]:
    event = attention_events(whole, [*region.columns, *region.feeders, *region.inner_rows])[0]
    return {len({frozenset(sorted((n, tuple(sorted(f))) for n, f in head.items())) for head in event.k})}


def split_columns(region: Region) -> list[str]:
    """The columns of ``region`` that its split divides: not those every rank keeps whole, whose modules reshape
    by no size the split changes (DeepSeek-V4's compressor of its one key/value head, whose window of 4 tokens
    is no head count)."""
    return [c for c in region.columns if not all(region.whole.get(c, (False,)))]


def prefixes(fqn: str) -> list[str]:
    """The modules holding ``fqn`` (the block itself as ""), not ``fqn``."""
    atoms = fqn.split(".")
    return [".".join(atoms[:i]) for i in range(len(atoms))]


def _as_fixes(chosen, tp: int) -> dict[str, dict[str, int]]:
    fixes: dict[str, dict[str, int]] = {}
    for holder, attribute, _, value in chosen:
        fixes.setdefault(holder, {})[attribute] = value
    return fixes


def attribute_values(block: nn.Module, fixes: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """``fixes`` (module -> attribute -> per-rank value, ``config.<name>`` for a value of the module's config)
    as the attributes to set on ``block``'s modules: a config value becomes a copy of that module's config
    with it changed (the model's config object is shared by all its modules, and stays as it is)."""
    values: dict[str, dict[str, Any]] = {}
    for holder, attributes in fixes.items():
        module = block.get_submodule(holder)
        plain = {a: v for a, v in attributes.items() if not a.startswith("config.")}
        in_config = {a.split(".", 1)[1]: v for a, v in attributes.items() if a.startswith("config.")}
        if in_config:
            config = copy.copy(module.config)
            for name, value in in_config.items():
                setattr(config, name, value)
            plain["config"] = config
        values[holder] = plain
    return values


def find_inner(block: nn.Module, args, kwargs, whole: BlockTrace, region: Region, tp: int) -> str:
    """Set ``region.inner``: the modules with weights that read only the region's columns, each with the one
    dimension of its input a rank holds 1/tp of; the reason when such a module's input is split otherwise. And
    ``region.on_local``: those of them that compute each rank's share from its share alone."""
    inside = _inner_modules(whole, region)
    if not inside:
        return ""
    region.on_local = _on_local(block, args, kwargs, whole, region, inside, tp)
    local = _rank_trace(block, args, kwargs, whole, region, region.fixes, 0, tp)
    for module in [m for m in inside if m not in region.on_local]:
        shape, mine = _module_input(whole, module)[1], _module_input(local, module)[1]
        split = [d for d, (a, b) in enumerate(zip(shape, mine)) if a != b]
        if len(shape) != len(mine) or len(split) != 1 or mine[split[0]] * tp != shape[split[0]]:
            return (f"{module} ({type(block.get_submodule(module)).__name__}) holds weights and runs on the split"
                    f" outputs, but its input {list(shape)} is not cut along one dimension on a tp rank ({list(mine)})")
        region.inner[module] = split[0]
    return ""


def _on_local(block: nn.Module, args, kwargs, whole: BlockTrace, region: Region, inside: list[str], tp: int) -> list[str]:
    """Of the modules ``inside`` the region that move their input's features to other places, those that compute
    each rank's share of their output from its share of their input alone (a relative position bias: a bank of
    profiles each head's states mix, gathered by distance): no reduction in them takes features several ranks
    hold, and every rank's block, with them run as they are on its local share, traces right. On the ranks they
    run so, whole, their gradients summed over tp (a DTensor would not carry them through ``gather`` by a plain
    index); else none are."""
    cut = {m for r in across_ranks(whole.reductions, region.owned, tp) for m in r.stack}
    region.on_local = [m for m in inside if m in whole.moved_features and m not in cut]
    right = region.on_local and not any(_check_rank(block, args, kwargs, whole, region, region.fixes, rank, tp)
                                        for rank in range(tp))
    found, region.on_local = (region.on_local if right else []), []
    return found


def _inner_modules(whole: BlockTrace, region: Region) -> list[str]:
    """The modules that read only the region's columns and either hold weights of their own (not depthwise
    convolutions: their weights split with their channels) or, without weights, pass on their input's features
    while reducing over features of several ranks (a norm without an affine part), outermost only. Not one on
    columns every rank keeps whole, in a region computed on local tensors (the norm of DeepSeek-V4's one
    key/value head): it runs on its whole input there, its gradients summed (``Region.on_feeders``)."""
    columns = set(region.columns)
    whole_columns = {c for c in columns if all(region.whole.get(c, (False,)))} if region.feeders else set()
    cut = {m for r in across_ranks(whole.reductions, region.owned, len(next(iter(region.owned.values()))))
           for m in r.stack}
    found = [m for m, (reads, _) in whole.weighted_inputs.items()
             if reads and reads <= columns and not reads <= whole_columns and m not in whole.depthwise]
    found += [m for m, (reads, _) in whole.plain_inputs.items()
              if reads and reads <= columns and (m in whole.features_in_place or m in whole.moved_features)
              and m in cut]
    return [m for m in found if not any(o != m and m.startswith(o + ".") for o in found)]


def _module_input(trace: BlockTrace, module: str) -> tuple:
    """(provenance, shape) of ``module``'s input in ``trace``."""
    return trace.weighted_inputs.get(module) or trace.plain_inputs.get(module) or (None, ())


def _rank_trace(block: nn.Module, args, kwargs, whole: BlockTrace, region: Region, fixes, rank: int,
                tp: int) -> BlockTrace:
    """The trace of ``block`` as tp rank ``rank`` holds it: the region shrunk, ``fixes`` set.

    A module inside the region with weights, or reducing over several ranks' features, runs on the ranks on a
    DTensor (:class:`~lightning_3d.policies.projections.OnSplitFeatures`), which computes what it computes on the
    whole input -- a norm over all of a split projection's features (OLMo 2's q_norm) too -- whereas its plain
    meta copy would meet this rank's share with whole weights. Here it passes its input through when it keeps
    its features in place (a norm); else it runs on its whole input (:class:`_OnWholeInput`)."""
    local = meta_copy(block)
    for module in [m for m in _inner_modules(whole, region) if m not in region.on_local]:
        inner = local.get_submodule(module)
        if module in whole.features_in_place:
            inner.forward = _pass_through
        elif module in whole.moved_features:
            inner.forward = _OnWholeInput(inner.forward, module, whole, rank, tp)
        else:  # it returns more than its input's features (ZAYA's norm of q and k: both)
            inner.forward = SplitInputs(inner.forward, _module_input(whole, module)[1], rank, tp)
    features = {name: owned[rank] for name, owned in region.owned.items()}
    for name, index in features.items():
        _keep_outputs(local.get_submodule(name), len(index))
    for row in [region.row, *region.inner_rows]:
        _keep_inputs(local.get_submodule(row), whole.sizes[row][0] // tp)
    for holder, names in region.head_weights.items():
        for name in names:
            owner, _, leaf = f"{holder}.{name}".strip(".").rpartition(".")
            module = local.get_submodule(owner)
            weight = getattr(module, leaf)
            dim = 0 if owner in region.depthwise else split_dim(weight)
            parts = region.depthwise.get(owner) or region.weight_parts.get(holder, {}).get(name)
            shape = list(weight.shape)
            shape[dim] = len(FusedParts(dim, parts[0], tp, parts[1]).held_by(rank)) if parts else weight.shape[dim] // tp
            if isinstance(weight, nn.Parameter):
                module.register_parameter(leaf, nn.Parameter(meta_like(weight, shape)))
            else:  # a buffer of one value per feature
                module.register_buffer(leaf, meta_like(weight, shape), persistent=False)
    for holder, attributes in attribute_values(local, fixes).items():
        for attribute, value in attributes.items():
            setattr(local.get_submodule(holder), attribute, value)
    if region.narrow_input:
        local.get_submodule(region.input_module).register_forward_pre_hook(_resize_input(1 / tp), with_kwargs=True)
        for column in region.columns:
            local.get_submodule(column).register_forward_pre_hook(_resize_input(tp), with_kwargs=True)
    marked = {}
    if region.head_inputs:
        args, kwargs, marked = head_inputs.traced(args, kwargs, region.head_inputs, region.heads, rank, tp)
    return trace_block(local, args, kwargs, features, inputs=marked)


def _check_rank(block: nn.Module, args, kwargs, whole: BlockTrace, region: Region, fixes, rank: int, tp: int) -> str:
    """'' if ``block`` as tp rank ``rank`` holds it (the region shrunk, ``fixes`` set) traces this rank's part of
    the whole trace; else what differs."""
    trace = _rank_trace(block, args, kwargs, whole, region, fixes, rank, tp)
    if trace.problem:
        return trace.problem
    width = whole.sizes[region.row][0] // tp
    mine = slice(rank * width, (rank + 1) * width)
    expected = {n: [s[mine] for s in slots] for n, slots in whole.row_inputs.get(region.row, {}).items()}
    got = trace.row_inputs.get(region.row, {})
    if set(expected) != set(got) or any(len(expected[n]) != len(got[n]) or
                                        any(not torch.equal(a, b) for a, b in zip(expected[n], got[n]))
                                        for n in expected):
        return f"{region.row} would read other features"
    for module, (parts, kept) in region.depthwise.items():
        channels = whole.depthwise[module]
        if trace.depthwise.get(module) != [channels[c] for c in FusedParts(0, parts, tp, kept).held_by(rank)]:
            return f"{module}'s channels would hold other features"
    if region.heads:
        event = attention_events(whole, [*region.columns, *region.feeders, *region.inner_rows])[0]
        per_rank = region.heads // tp
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        local_events = attention_events(trace, [*region.columns, *region.feeders, *region.inner_rows])
        if len(local_events) != 1:
            return "the attention product is not found once"
        got_event = local_events[0]
        for side in ("q", "k", "v", "scores"):
            if getattr(got_event, side) != getattr(event, side)[heads]:
                return f"its heads would see other {side} features ({len(getattr(got_event, side))} heads)"
        return _head_inputs_check(event, got_event, heads, region)
    return ""


def _head_inputs_check(event, got_event, heads: slice, region: Region) -> str:
    """'' if this rank's heads (``got_event``) meet the elements of each input cut to them that the whole
    block's heads ``heads`` (of ``event``) meet, added to their scores (set apart by the trace with the weights'
    elements: ``HeadEvent.weights``); else what differs."""
    for key in region.head_inputs:
        name = head_inputs.name(key)
        if not event.weights or any(name not in elements for elements in event.weights):
            return (f"the block's {head_inputs.in_words(key)} reaches not every attention head, so no cut of it to"
                    " each rank's heads can be checked")
        if [mine.get(name) for mine in got_event.weights] != [whole[name] for whole in event.weights[heads]]:
            return f"its heads would add to their scores other elements of the block's {head_inputs.in_words(key)}"
    return ""


def _pass_through(x, *args, **kwargs):
    """``x``, carrying also the features of the other inputs of its shape (a gated norm's gate), as the module's
    own output does."""
    for other in [*args, *kwargs.values()]:
        if isinstance(other, Tensor) and other.shape == x.shape:
            x = x + other * 0
    return x


class _OnWholeInput:
    """The forward of an inner module whose output does not keep its input's shape (xLSTM's per-head norm,
    which needs all heads and flattens them into features), as the ranks run it on a DTensor: this rank's share
    of its input sits at its place in an input of the whole shape (the other ranks' places hold no features),
    the module's own forward runs on that, and the output is cut back to this rank's share along the dimension
    where the whole trace shows the features of each rank's share of the input land."""

    def __init__(self, forward, module: str, whole: BlockTrace, rank: int, tp: int) -> None:
        self.forward, self.module, self.rank, self.tp = forward, module, rank, tp
        self.shape = _module_input(whole, module)[1]
        self.before, self.after = whole.moved_features[module]

    def __call__(self, x: Tensor, *args, **kwargs) -> Tensor:
        split = [d for d, (a, b) in enumerate(zip(self.shape, x.shape)) if a != b]
        if len(self.shape) != x.dim() or len(split) != 1 or x.shape[split[0]] * self.tp != self.shape[split[0]]:
            raise ValueError(f"{self.module}'s input {list(x.shape)} is not its whole input {list(self.shape)}"
                             " cut along one dimension")
        dim, size = split[0], x.shape[split[0]]

        def widened(t: Tensor) -> Tensor:  # (..., size, ...) -> (..., tp * size, ...), this rank's share in place
            pad = [*t.shape[:dim], size * self.rank, *t.shape[dim + 1:]]
            rest = [*t.shape[:dim], size * (self.tp - 1 - self.rank), *t.shape[dim + 1:]]
            return torch.cat([t.new_zeros(pad), t, t.new_zeros(rest)], dim)
        args = [widened(a) if isinstance(a, Tensor) and a.shape == x.shape else a for a in args]
        out = self.forward(widened(x), *args, **kwargs)
        lands = _output_dim(self.before, self.after, dim, self.tp)
        if not isinstance(out, Tensor) or lands is None:
            raise ValueError(f"{self.module}'s output holds the features of each rank's share of its input along"
                             " no one dimension")
        share = out.shape[lands] // self.tp
        return out.narrow(lands, self.rank * share, share)


def _output_dim(before, after, dim: int, tp: int) -> int | None:
    """The dimension of a module's output (shadow ``after``) whose r-th of tp chunks holds the features of the
    r-th chunk along ``dim`` of its input (shadow ``before``), for every r; None if none does."""
    def chunk(shadow, d: int, rank: int) -> dict[str, frozenset[int]]:
        return {name: frozenset(i for s in slots for i in s.tensor_split(tp, d)[rank].flatten().tolist() if i >= 0)
                for name, slots in shadow.items() if name in before}
    sizes = next(iter(after.values()))[0].shape
    return next((d for d in range(len(sizes)) if sizes[d] % tp == 0
                 and all(chunk(after, d, r) == chunk(before, dim, r) for r in range(tp))), None)


def _resize_input(factor: float):
    """A forward pre-hook that gives the module its hidden states ``factor`` times as wide (on meta): its first
    positional argument, else its first tensor passed by keyword (``hidden_states=...``), as
    :class:`~lightning_3d.policies.hidden_states.HiddenStates` converts them on the ranks."""
    def resized(x: Tensor) -> Tensor:
        return torch.empty(*x.shape[:-1], int(x.shape[-1] * factor), dtype=x.dtype, device="meta")

    def hook(_module, args, kwargs):
        if args:
            return ((resized(args[0]), *args[1:]), kwargs) if isinstance(args[0], Tensor) else None
        name = next((k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
        return None if name is None else (args, {**kwargs, name: resized(kwargs[name])})
    return hook


def _keep_outputs(module: nn.Module, count: int) -> None:
    """Shrink a projection (on meta) to ``count`` output features."""
    if isinstance(module, nn.Linear):
        module.weight = meta_like(module.weight, (count, module.in_features))
        module.out_features = count
    else:  # Conv1D: weight (in, out)
        module.weight = meta_like(module.weight, (module.weight.shape[0], count))
        module.nf = count
    if module.bias is not None:
        module.bias = meta_like(module.bias, (count,))


def _keep_inputs(module: nn.Module, count: int) -> None:
    """Shrink a projection (on meta) to ``count`` input features; the bias stays whole."""
    if isinstance(module, nn.Linear):
        module.weight = meta_like(module.weight, (module.out_features, count))
        module.in_features = count
    else:
        module.weight = meta_like(module.weight, (count, module.weight.shape[1]))
        if hasattr(module, "nx"):
            module.nx = count
