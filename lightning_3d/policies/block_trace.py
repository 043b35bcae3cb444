"""What one transformer block computes, recorded on the meta device: which projection feeds which, and where
each output feature of a projection goes.

``policy="auto"`` finds a model's tensor-parallel structure here rather than from module names. One block runs
on a meta copy (no memory, no data, no random numbers), with the inputs the model itself gives it, under a
dispatch mode that follows two things through every op:

* **provenance** -- for each tensor, the projections (``nn.Linear``, transformers' ``Conv1D``) whose outputs it
  derives from, or ``STREAM`` for the block's input, the residual stream. A projection that reads the stream
  alone is a *column* candidate; one whose output is added back to the stream is an *exit*; an exit that
  reads only column outputs closes a region (attention, MLP), wherever the two sit among the block's modules
  (BERT's ``attention.self.query`` and ``attention.output.dense`` are siblings' children).
* **features** -- for each output feature of a projection, its index, carried by a small integer tensor of
  the same shape (a *shadow*) through the ops that only move values (view, split, transpose, slice, cat,
  expand, elementwise arithmetic), on the host. Where a shadow meets an attention product (``q @ k.T``,
  ``attn @ v``, ``scaled_dot_product_attention``) the trace records which features make up each head; where it
  reaches a projection, which features sit at each of its inputs. A fused ``q|k|v`` or ``gate|up`` output is
  then seen for what it is: which of its columns are which head's q, k, v, or which gate goes with which up.

The trace is data for :mod:`lightning_3d.policies.tp_structure`, which decides the split and checks it by
tracing again as one tp rank holds the block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_3d.common import join_fqn, parent_fqn
from lightning_3d.policies.conv_channels import grouped_slots
from lightning_3d.policies.experts import experts_stood_in, is_experts, is_stacked_experts
from lightning_3d.policies.feature_weights import set_apart, tracked_weights
from lightning_3d.policies.meta_values import MetaValues
from lightning_3d.policies.reductions import Reduction, reduced_dims, reduced_together
from lightning_3d.policies.scan_kernels import kernel_name, scan_heads
from lightning_3d.policies.score_terms import gathered, rows, weighed


STREAM = "<stream>"
"""The provenance tag of the block's input hidden states (and of what is added to them)."""

aten = torch.ops.aten
_MOVES = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.select.int,
    aten.unbind.int, aten.clone.default, aten.alias.default, aten.cat.default, aten.stack.default,
    aten.chunk.default, aten.narrow.default, aten.flatten.using_ints, aten.unflatten.int, aten.repeat.default,
    aten.repeat_interleave.self_int, aten.contiguous.default, aten.detach.default, aten.lift_fresh.default,
}
"""Ops that only move values: applied to the shadows as they are."""
_KEEP_SHAPE = {aten._to_copy.default, aten._softmax.default, aten.native_dropout.default,
               aten.native_layer_norm.default, aten._fused_rms_norm.default, aten.masked_fill.Tensor}
"""Ops that keep each value in its place (a cast, dropout, a softmax over heads' rows, a norm over features:
Persimmon's per-head LayerNorm of q and k; a masked fill of the scores with a value given as a tensor)."""
_VIEWS = {
    aten.view.default, aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor,
    aten.select.int, aten.narrow.default, aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.chunk.default, aten.unflatten.int,
}
"""Of the moves, those whose outputs are views of their input: a copy into such a view writes its base."""
_SELECTS = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.argmax.default, aten.argmin.default,
            aten.max.dim, aten.min.dim, aten.kthvalue.default, aten.argsort.default, aten.argsort.stable}
"""Ops that choose among values (a router picking experts)."""
_ADDS = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
"""Ops that join an output to the residual stream: a sum, or a difference (nGPT's step towards the update,
``h + rate * (out - h)``)."""
_PRODUCTS = {aten.bmm.default, aten.mm.default, aten.baddbmm.default}
_FACTORIES = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
              aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}
"""Ops that read only their input's shape: nothing flows from its values (DeepSeek-V4's compressor returns
``kv.new_zeros(...)`` when the sequence is shorter than its window)."""
_SDPA = F.scaled_dot_product_attention


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2's transposed linear)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def projection_sizes(module: nn.Module) -> tuple[int, int]:
    """(in features, out features) of a projection."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: weight (in, out)


Shadow = dict[str, list[Tensor]]
"""Projection FQN -> integer tensors shaped like the traced tensor: the projection's output feature at each
place (several when elementwise arithmetic combines two of its features, as ``act(gate) * up`` does)."""


@dataclass
class HeadEvent:
    """One attention product, per head (rows of the batched product): the features of each side."""

    q: list[dict[str, frozenset[int]]] = field(default_factory=list)
    k: list[dict[str, frozenset[int]]] = field(default_factory=list)
    v: list[dict[str, frozenset[int]]] = field(default_factory=list)
    scores: list[dict[str, frozenset[int]]] = field(default_factory=list)
    """Per head, the features added to its scores besides ``q @ k.T`` (Doge's dynamic mask, from all its values
    through ``dt_proj``, one value per key/value head; the ``attn_mask`` given to
    ``scaled_dot_product_attention``): read with the head's scores as its q and k are."""
    weights: list[dict[str, frozenset[int]]] = field(default_factory=list)
    """Per head, the elements of the weights traced apart (:mod:`~lightning_3d.policies.feature_weights`) on
    any of its sides."""


@dataclass
class BlockTrace:
    """What :func:`trace_block` records (FQNs relative to the block)."""

    order: list[str] = field(default_factory=list)
    """Projections in the order they ran."""
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    reads: dict[str, frozenset[str]] = field(default_factory=dict)
    """Projection -> the provenance of its input (``STREAM`` and/or projections)."""
    exits: set[str] = field(default_factory=set)
    """Projections whose output was added to the residual stream."""
    row_inputs: dict[str, Shadow] = field(default_factory=dict)
    """Projection -> the shadow of its input's last dimension (position -> features), at one token."""
    row_weights: dict[str, Shadow] = field(default_factory=dict)
    """Projection -> the elements of the weights traced apart at each of its input positions (last dimension),
    at every token (rows)."""
    attention: list[HeadEvent] = field(default_factory=list)
    input_id: dict[str, list[str]] = field(default_factory=dict)
    """Projection -> the modules (outermost first) whose forward received exactly its input tensor."""
    changed_in_place: set[str] = field(default_factory=set)
    """Projections whose output the block then changes in place (``mlp_output += attention_output``)."""
    input_readers: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    """Projection -> for each op that read its input tensor, the module stack that op ran in."""
    weighted_inputs: dict[str, tuple[frozenset[str], tuple[int, ...]]] = field(default_factory=dict)
    """Module with weights of its own, not a projection (a norm) -> the provenance and shape of its input."""
    plain_inputs: dict[str, tuple[frozenset[str], tuple[int, ...]]] = field(default_factory=dict)
    """As ``weighted_inputs``, for the modules without weights (a norm without an affine part)."""
    selects: set[str] = field(default_factory=set)
    """Projections whose outputs choose among values (top-k, sort, argmax: a router's logits)."""
    reductions: list[Reduction] = field(default_factory=list)
    """The reductions over traced features (:mod:`~lightning_3d.policies.reductions`)."""
    depthwise: dict[str, list[dict[str, frozenset[int]]]] = field(default_factory=dict)
    """Module whose weight a convolution of grouped channels used (depthwise, one filter per channel: a short
    convolution, Mamba's ``conv1d``; grouped, one group per head: ZAYA's) -> per output channel, the features of
    its group's input channels (:mod:`~lightning_3d.policies.conv_channels`)."""
    features_in_place: set[str] = field(default_factory=set)
    """Of those, the modules whose output holds the features of their input at the same places (a norm)."""
    moved_features: dict[str, tuple[Shadow, Shadow]] = field(default_factory=dict)
    """Of those, the others whose output holds features (xLSTM's per-head norm, which flattens heads into
    features) -> the shadows of their input and of their output."""
    stacks: dict[str, int] = field(default_factory=dict)
    """Traced weight -> the number of matrices a batched product read it as (its heads, or its groups)."""
    grouped: set[str] = field(default_factory=set)
    """Projections whose own forward multiplies by their weight as a stack of matrices (a grouped, block-diagonal
    projection: DeepSeek-V4's ``o_a_proj``, one matrix per group of heads): the features are followed through
    them as through a traced weight, so they are not among the projections above."""
    attribute_reads: dict[str, frozenset[str]] = field(default_factory=dict)
    """Module FQN (``FQN.config``: its config) -> the attributes read off it while the block ran (recorded by
    :func:`~lightning_3d.policies.tp_structure.split_block` for the whole block's trace)."""
    problem: str | None = None


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every parameter and buffer on the meta device (nothing is allocated)."""
    memo = {id(t): meta_like(t, t.shape) for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def meta_like(tensor: Tensor, shape) -> Tensor:
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def trace_block(block: nn.Module, args: tuple, kwargs: dict, features: dict[str, Tensor] | None = None,
                inputs: dict[int, tuple[str, Tensor]] | None = None) -> BlockTrace:
    """Run ``block`` (on the meta device) on ``args``/``kwargs`` (its first tensor argument is the residual
    stream) and record what it computes. ``features``: projection FQN -> the global output feature of each of
    its local output columns (a tp rank's share, when ``block`` is shrunk to one rank); default: all, in order.
    ``inputs``: tensor id of an input -> a name and the index of each of its elements, followed as a weight's
    elements are (apart from the projection features)."""
    recorder = _Recorder(block, features or {})
    for key, (name, index) in (inputs or {}).items():
        recorder.shadow[key] = {name: [index]}
        recorder.tracked_names.add(name)
    hidden = next((a for a in [*args, *kwargs.values()] if isinstance(a, Tensor)), None)
    if hidden is None:
        return BlockTrace(problem="the block takes no tensor")
    recorder.prov[id(hidden)] = frozenset({STREAM})
    handles = recorder.hook_modules()
    handles.append(register_module_forward_pre_hook(recorder.kernel_enter))
    handles.append(register_module_forward_hook(recorder.kernel_leave, with_kwargs=True))
    try:
        # MetaValues: what the block derives from constants (a distribution's parameters) and a router's choice
        # of experts carry host values, for code in the block that reads them.
        with (torch.no_grad(), torch.device("meta"), _FunctionLevel(recorder), recorder, MetaValues(),
              experts_stood_in(block)):
            block(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 -- what meta cannot run, or a shape the split broke
        recorder.trace.problem = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        for handle in handles:
            handle.remove()
    recorder.trace.input_readers = {name: recorder.readers.get(i, []) for name, i in recorder.projection_inputs.items()}
    set_apart(recorder.trace, recorder.tracked_names)
    return recorder.trace


class _Recorder(TorchDispatchMode):
    def __init__(self, block: nn.Module, features: dict[str, Tensor]) -> None:
        super().__init__()
        self.block, self.features = block, features
        self.trace = BlockTrace()
        self.prov: dict[int, frozenset[str]] = {}
        self.shadow: dict[int, Shadow] = {}
        self.keep: list[Tensor] = []  # every traced tensor stays alive: ids are keys
        self.stack: list[str] = []
        self.output_of: dict[int, str] = {}  # a projection output's id -> the projection
        self.readers: dict[int, list[tuple[str, ...]]] = {}  # tensor id -> stacks of the ops that read it
        self.projection_inputs: dict[str, int] = {}  # projection -> its input's id
        self.input_seen: dict[int, list[str]] = {}  # tensor id -> the modules whose first input it was
        self.view_of: dict[int, tuple] = {}  # a view's id -> (its base, the op, its args, kwargs, which output)
        self.param_owner = {id(p): fqn for fqn, module in block.named_modules() for p in module.parameters(recurse=False)}
        # weights whose elements are followed as features
        self.own_forward = _own_forward_weights(block)  # (a grouped projection's, followed through)
        self.tracked = {**tracked_weights(block, is_projection), **_matrix_stacks(block), **self.own_forward}
        self.tracked_names = set(self.tracked.values())
        self.in_sdpa = False
        self.scores: dict[int, HeadEvent] = {}  # a tensor holding an attention product's scores -> the product
        self.in_kernel = 0  # inside a scan kernel (scan_kernels): its output is recorded whole, as one product

    # -- modules ---------------------------------------------------------------------------------------------
    def hook_modules(self) -> list:
        handles = []
        for fqn, module in self.block.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(fqn), with_kwargs=True))
            handles.append(module.register_forward_hook(self._leave(fqn, module)))
        return handles

    def _enter(self, fqn: str):
        def hook(module, args, kwargs):
            self.stack.append(fqn)
            first = next((a for a in [*args, *kwargs.values()] if isinstance(a, Tensor)), None)
            if first is not None:
                self._note_input(fqn, module, first)
        return hook

    def _leave(self, fqn: str, module: nn.Module):
        def hook(_module, args, output):
            self.stack.pop()
            if (fqn in self.trace.weighted_inputs or fqn in self.trace.plain_inputs) and isinstance(output, Tensor) and args:
                # Its input's features at their places, with those of its other inputs of that shape (a gated
                # norm's gate), as tp_structure's stand-in for it passes them on.
                inputs = [self.shadow.get(id(a)) for a in args if isinstance(a, Tensor) and a.shape == args[0].shape]
                before: Shadow = {}
                for shadow in inputs if inputs and inputs[0] else ():
                    for name, slots in (shadow or {}).items():
                        before.setdefault(name, []).extend(slots)
                after = self.shadow.get(id(output))
                if before and after and before.keys() == after.keys() and all(
                        len(before[n]) == len(after[n]) and all(torch.equal(a, b) for a, b in zip(before[n], after[n]))
                        for n in before):
                    self.trace.features_in_place.add(fqn)
                elif before and after:
                    self.trace.moved_features[fqn] = (before, after)
            if fqn in self.trace.grouped:  # its output keeps the features and provenance of its input
                self._not_a_projection(fqn)
            elif is_projection(module) and isinstance(output, Tensor):
                self.prov[id(output)] = frozenset({fqn})
                self.output_of[id(output)] = fqn
                index = self.features.get(fqn)
                if index is None:
                    index = torch.arange(output.shape[-1], device="cpu")
                self.shadow[id(output)] = {fqn: [index.expand(output.shape).clone()]}
                self.keep.append(output)
        return hook

    def _not_a_projection(self, fqn: str) -> None:
        trace = self.trace
        trace.order.remove(fqn)
        for recorded in (trace.sizes, trace.reads, trace.input_id, trace.row_inputs, trace.row_weights,
                         self.projection_inputs):
            recorded.pop(fqn, None)

    def _note_input(self, fqn: str, module: nn.Module, x: Tensor) -> None:
        self.input_seen.setdefault(id(x), []).append(fqn)
        if not is_projection(module):
            # weights followed element by element are no module's opaque weights (RG-LRU's are its heads')
            weighted = any(id(p) not in self.tracked for p in module.parameters(recurse=False))
            inputs = self.trace.weighted_inputs if weighted else self.trace.plain_inputs
            inputs[fqn] = (self.prov.get(id(x), frozenset()), tuple(x.shape))
            return
        t = self.trace
        t.order.append(fqn)
        t.sizes[fqn] = projection_sizes(module)
        t.reads[fqn] = self.prov.get(id(x), frozenset())
        t.input_id[fqn] = list(self.input_seen.get(id(x), []))[:-1]
        self.projection_inputs[fqn] = id(x)
        shadow = self.shadow.get(id(x))
        if shadow:  # features at one token; weights' elements at every token (a recurrence's decay enters late)
            features = {name: slots for name, slots in shadow.items() if name not in self.tracked_names}
            if features:
                t.row_inputs[fqn] = {name: [s.reshape(-1, s.shape[-1])[0] for s in slots] for name, slots in features.items()}
            weights = {name: [s.reshape(-1, s.shape[-1]) for s in slots] for name, slots in shadow.items()
                       if name in self.tracked_names}
            if weights:
                t.row_weights[fqn] = weights

    def kernel_enter(self, module, args) -> None:
        if kernel_name(module):
            self.in_kernel += 1

    def kernel_leave(self, module, args, kwargs, output) -> None:
        name = kernel_name(module)
        if not name:
            return
        self.in_kernel -= 1
        if self.in_kernel:
            return
        found = scan_heads(name, module, args, kwargs, lambda t: self.shadow.get(id(t)) if isinstance(t, Tensor) else None,
                           _features)
        out = output[0] if isinstance(output, (tuple, list)) else output
        if found is None or not isinstance(out, Tensor):
            return
        q, k, v, carried = found
        self.trace.attention.append(HeadEvent(q=q, k=k, v=v))
        try:
            self.shadow[id(out)] = carried(out)
        except RuntimeError:  # an output not shaped as the values: its features are lost here
            return
        self.keep.append(out)

    # -- ops -------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        if flat_in and not any(a.device.type == "meta" for a in flat_in):
            return out  # the trace's own work on the shadows
        for a in flat_in:
            self.readers.setdefault(id(a), []).append(tuple(self.stack))
            if id(a) in self.tracked and id(a) not in self.shadow:
                self.shadow[id(a)] = {self.tracked[id(a)]: [torch.arange(a.numel(), device="cpu").view(a.shape)]}
        if func.overloadpacket.__name__.endswith("_") and args and id(args[0]) in self.output_of:
            self.trace.changed_in_place.add(self.output_of[id(args[0])])
        provs = [self.prov[id(a)] for a in flat_in if id(a) in self.prov]
        union = frozenset().union(*provs) if provs else frozenset()
        if func in _SELECTS:
            self.trace.selects.update(union - {STREAM})
        if func in _ADDS and STREAM in union and len(provs) >= 2:
            # Added to the residual stream: the other side's projections exit into it -- also when that side is
            # scaled by something the stream gives (a hyper-connection's ``post * out + residual``).
            pure = any(p == frozenset({STREAM}) for p in provs)
            self.trace.exits.update(n for p in provs if pure or STREAM not in p for n in p - {STREAM})
            union = frozenset({STREAM})
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        for o in outs:
            # No gradient flows through indices or masks, nor from a tensor whose shape alone is read (but a scan
            # kernel's buffer, which it fills in place out of the trace's sight, carries what fills it).
            if union and (o.is_floating_point() or o.is_complex()) and (func not in _FACTORIES or self.in_kernel):
                self.prov[id(o)] = union
            self.keep.append(o)
        if self.in_kernel:
            return out
        scored = next((self.scores[id(a)] for a in flat_in if id(a) in self.scores), None)
        if scored is not None and (func in _MOVES or func in _KEEP_SHAPE or torch.Tag.pointwise in func.tags):
            self.scores.update((id(o), scored) for o in outs)  # scaled, masked, softmaxed: still the scores
        if func in _VIEWS and isinstance(args[0], Tensor):
            for i, o in enumerate(outs):
                self.view_of[id(o)] = (args[0], func, args, kwargs, i)
        if func is aten.copy_.default:
            self._copy_into(args[0], args[1])
            return out
        self._follow_features(func, args, kwargs, out, flat_in, outs)
        return out

    def _view_base(self, tensor: Tensor) -> tuple[Tensor, list[tuple]]:
        """The tensor ``tensor`` views (itself if none), and the ops from it to ``tensor``, last first."""
        chain, base = [], tensor
        while id(base) in self.view_of:
            parent, func, args, kwargs, i = self.view_of[id(base)]
            chain.append((func, args, kwargs, i))
            base = parent
        return base, chain

    def _copy_into(self, dst: Tensor, src: Tensor) -> None:
        """``dst.copy_(src)``, where ``dst`` may be a view (``key[..., :d].copy_(k_nope)``, as MLA builds its keys
        in place): the provenance and features of ``src`` reach the tensor ``dst`` views, at the places it views."""
        base, chain = self._view_base(dst)
        prov = self.prov.get(id(src), frozenset())
        for t in (dst, base):
            self.prov[id(t)] = self.prov.get(id(t), frozenset()) | prov
        source = self.shadow.get(id(src))
        if not source:
            return
        shadow = self.shadow.setdefault(id(base), {})
        written: Shadow = {}
        try:
            for name in {*shadow, *source}:
                slots = source.get(name) or [torch.full(src.shape, -1, dtype=torch.long, device="cpu")]
                held = shadow.setdefault(name, [torch.full(base.shape, -1, dtype=torch.long, device="cpu")])
                held.extend(held[-1].clone() for _ in range(len(slots) - len(held)))
                written[name] = []
                for j, whole in enumerate(held):
                    view = whole
                    for func, args, kwargs, i in reversed(chain):
                        view = func(view, *args[1:], **kwargs)
                        view = view[i] if isinstance(view, (tuple, list)) else view
                    view.copy_(torch.broadcast_to(slots[min(j, len(slots) - 1)], view.shape))
                    written[name].append(view)
        except Exception:  # noqa: BLE001 -- a view the host cannot write (an expanded one): the features are lost
            self.shadow.pop(id(base), None)
            return
        self.shadow[id(dst)] = written

    def _follow_features(self, func, args, kwargs, out, flat_in, outs) -> None:
        shadowed = [a for a in flat_in if id(a) in self.shadow]
        if not shadowed:
            return
        if func in _PRODUCTS:
            if not self.in_sdpa:
                self._product(func, args, outs)
            return
        dims = reduced_dims(func, args, kwargs)
        if dims is not None and isinstance(args[0], Tensor) and self._has_features(self.shadow.get(id(args[0]))):
            together = reduced_together({n: s for n, s in self.shadow[id(args[0])].items() if n not in self.tracked_names},
                                        dims, _features)
            if together:
                self.trace.reductions.append(Reduction(tuple(self.stack), together))
        if func in _MOVES:
            self._move(func, args, kwargs, out, flat_in)
        elif func is aten.convolution.default:
            self._grouped_convolution(args, out)
        elif func is aten.constant_pad_nd.default:  # the padding holds no feature
            self.shadow[id(out)] = {name: [aten.constant_pad_nd(s, args[1], -1) for s in slots]
                                    for name, slots in self.shadow[id(args[0])].items()}
        elif func is aten.view_as_complex.default:  # (..., n, 2) -> (..., n): each number holds two features
            self.shadow[id(out)] = {name: [s[..., k] for s in slots for k in (0, 1)]
                                    for name, slots in self.shadow[id(args[0])].items()}
        elif func is aten.view_as_real.default:  # (..., n) -> (..., n, 2): both parts hold both features
            self.shadow[id(out)] = {name: [torch.stack([s, s], -1) for s in slots]
                                    for name, slots in self.shadow[id(args[0])].items()}
        elif func is aten.gather.default and id(args[0]) in self.shadow:  # a bias gathered by distance
            found = {name: gathered(slots, args[1], out.shape) for name, slots in self.shadow[id(args[0])].items()}
            if all(slots is not None for slots in found.values()):
                self.shadow[id(out)] = found
        elif func is aten._softmax.default and id(args[0]) in self.scores:  # each weight reads its row's terms
            self.shadow[id(out)] = {name: rows(slots, args[1]) for name, slots in self.shadow[id(args[0])].items()}
        elif func in _KEEP_SHAPE or torch.Tag.pointwise in func.tags:
            merged: Shadow = {}
            for o in outs[:1]:
                for a in shadowed:
                    for name, slots in self.shadow[id(a)].items():
                        merged.setdefault(name, []).extend(_broadcast(s, o.shape) for s in slots)
                if merged and all(all(s is not None for s in v) for v in merged.values()):
                    self.shadow[id(o)] = merged

    def _move(self, func, args, kwargs, out, flat_in) -> None:
        """Apply the op to each slot of each shadow. A tensor argument without a shadow (a cache's keys, a
        constant) takes one of -1s, "no feature"; one with fewer slots repeats its last."""
        names = {name: max(len(self.shadow[id(a)].get(name, ())) for a in flat_in if id(a) in self.shadow)
                 for a in flat_in if id(a) in self.shadow for name in self.shadow[id(a)]}
        result: dict[str, list] = {}
        for name, count in names.items():
            for slot in range(count):
                def swap(x):
                    if not isinstance(x, Tensor):
                        return x
                    slots = self.shadow.get(id(x), {}).get(name)
                    if not slots:
                        return torch.full(x.shape, -1, dtype=torch.long, device="cpu")
                    return slots[min(slot, len(slots) - 1)]
                try:
                    moved = func(*tree_map(swap, args), **tree_map(swap, kwargs))
                except Exception:  # noqa: BLE001 -- an op the host cannot mirror: the features are lost here
                    return
                result.setdefault(name, []).append(moved)
        pieces = tree_flatten(out)[0]
        if any(len(tree_flatten(s)[0]) != len(pieces) for slots in result.values() for s in slots):
            return
        for i, piece in enumerate(pieces):
            if isinstance(piece, Tensor):
                self.shadow[id(piece)] = {name: [tree_flatten(s)[0][i] for s in slots] for name, slots in result.items()}

    def _grouped_convolution(self, args, out: Tensor) -> None:
        """A 1-d convolution of channels in groups (one filter per channel: depthwise) keeps each group's features
        in its output channels (:mod:`~lightning_3d.policies.conv_channels`); one of a single group loses them."""
        x, weight, groups = args[0], args[1], args[8]
        shadow = self.shadow.get(id(x))
        if not shadow or x.dim() != 3 or groups < 2 or weight.shape[1] * groups != x.shape[1]:
            return
        moved: Shadow = {}
        for name, slots in shadow.items():
            for s in slots:
                found = grouped_slots(s, groups, out.shape)
                if found is None:
                    return
                moved.setdefault(name, []).extend(found)
        self.shadow[id(out)] = moved
        owner = self.param_owner.get(id(self._view_base(weight)[0]))
        if owner is not None:
            self.trace.depthwise[owner] = [{name: _features(s[0, c, :1] for s in slots) for name, slots in moved.items()}
                                           for c in range(out.shape[1])]

    def _product(self, func, args, outs) -> None:
        a, b = (args[1], args[2]) if func is aten.baddbmm.default else (args[0], args[1])
        if func is aten.mm.default and self._has_features(self.shadow.get(id(a))) and self._hand_weight(b) and not (
                set(self.shadow[id(a)]) & self.trace.exits):  # (not the stream's: a router's logits)
            self.shadow[id(outs[0])] = {name: weighed(slots, outs[0].shape) for name, slots in self.shadow[id(a)].items()}
            return
        if a.dim() != 3 or b.dim() != 3 or not self.prov.get(id(a), frozenset()) - {STREAM}:
            return  # (nor a product of what the stream alone gives: a hyper-connection mixing its streams)
        # Which product it is: the scores of an earlier one times values (the scores may carry features added to
        # them: Doge's mask), else from projection features alone (scores with a weight added are not values).
        sa, sb = self.shadow.get(id(a)), self.shadow.get(id(b))
        scored = self.scores.get(id(a))
        if scored is not None and self._has_features(sb):
            self._values(scored, sa, sb, outs[0])
        elif self._has_features(sa) and self._has_features(sb):  # q @ k.T: features on both sides of the contraction
            self.trace.attention.append(HeadEvent(q=_per_head(sa, lambda s, n: s[n, 0, :]),
                                                  k=_per_head(sb, lambda s, n: s[n, :, 0])))
            added = self.shadow.get(id(args[0])) if func is aten.baddbmm.default else None
            terms = {name: [_broadcast(s, outs[0].shape) for s in slots] for name, slots in (added or {}).items()}
            if terms and all(s is not None for slots in terms.values() for s in slots):
                self.shadow[id(outs[0])] = terms  # baddbmm's added term joins the scores (BLOOM's ALiBi bias)
            self.scores[id(outs[0])] = self.trace.attention[-1]
        elif self._has_features(sb) and self.trace.attention:  # attn @ v, its scores followed no further
            self._values(self.trace.attention[-1], None, sb, outs[0])
        elif self._has_features(sa) and sb and set(sb) <= self.tracked_names and a.shape[0] == b.shape[0]:
            self._batched_projection(func, args, outs[0], sa, sb)

    def _values(self, event: HeadEvent, sa: Shadow | None, sb: Shadow, o: Tensor) -> None:
        """``attn @ v`` of ``event``: v's features leave with the heads; what the scores carry was added to them."""
        event.v = _per_head(sb, lambda s, n: s[n, 0, :])
        event.scores = _per_head(sa, lambda s, n: s[n]) if sa else []
        self.shadow[id(o)] = {name: [s[:, :1, :].expand(o.shape).clone() for s in slots] for name, slots in sb.items()}

    def _batched_projection(self, func, args, out: Tensor, sa: Shadow, sb: Shadow) -> None:
        """Features ``a`` (G, N, K) times a traced weight ``b`` (G, K, M), batched over the same leading dim (a
        block-diagonal per-head projection, RG-LRU's gates): output (g, n, m) carries the features of ``a`` at
        (g, n, every k) and the weight's elements (g, every k, m); baddbmm's added term (a per-head bias) its own."""
        a = args[1] if func is aten.baddbmm.default else args[0]
        contraction = a.shape[2]
        for name in sb:
            self.trace.stacks[name] = a.shape[0]
            if name in self.own_forward.values() and parent_fqn(name) == self.stack[-1]:  # while it runs
                self.trace.grouped.add(self.stack[-1])
        shadow: Shadow = {}
        for name, slots in sa.items():
            shadow.setdefault(name, []).extend(s[:, :, k:k + 1].expand(out.shape).clone() for s in slots
                                               for k in range(contraction))
        for name, slots in sb.items():
            shadow.setdefault(name, []).extend(s[:, k:k + 1, :].expand(out.shape).clone() for s in slots
                                               for k in range(contraction))
        added = self.shadow.get(id(args[0])) if func is aten.baddbmm.default else None
        for name, slots in (added or {}).items():
            shadow.setdefault(name, []).extend(_broadcast(s, out.shape) for s in slots)
        if all(s is not None for slots in shadow.values() for s in slots):
            self.shadow[id(out)] = shadow

    def _hand_weight(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is (a view of) a weight a module applies by hand (a relative bias's bank of
        profiles): its own parameter, not a projection's, and not followed element by element."""
        owner = self.param_owner.get(id(self._view_base(tensor)[0]))
        return id(tensor) not in self.shadow and owner is not None and not is_projection(self.block.get_submodule(owner))

    def _has_features(self, shadow: Shadow | None) -> bool:
        """Whether ``shadow`` holds projection features, not only weights' elements."""
        return bool(shadow) and any(name not in self.tracked_names for name in shadow)

    def sdpa(self, args, kwargs, out) -> None:
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        sq, sk, sv = (self.shadow.get(id(t)) for t in (q, k, v))
        if not (sq and sk and sv) or q.dim() != 4:
            return
        heads, kv_heads = q.shape[1], k.shape[1]
        group = heads // kv_heads if kv_heads and heads % kv_heads == 0 else 1

        def by_head(shadow, pick):
            return [{name: _features(pick(s, h) for s in slots) for name, slots in shadow.items()}
                    for h in range(heads)]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")  # added to the scores (Doge's)
        sm = self.shadow.get(id(mask)) if isinstance(mask, Tensor) and mask.dim() == 4 else None
        self.trace.attention.append(HeadEvent(q=by_head(sq, lambda s, h: s[0, h, 0, :]),
                                              k=by_head(sk, lambda s, h: s[0, h // group, 0, :]),
                                              v=by_head(sv, lambda s, h: s[0, h // group, 0, :]),
                                              scores=by_head(sm, lambda s, h: s[0, h % s.shape[1]]) if sm else []))
        index = torch.arange(heads, device="cpu") // group
        self.shadow[id(out)] = {name: [s[:, index, :1, :].expand(out.shape).clone() for s in slots]
                                for name, slots in sv.items()}
        self.keep.append(out)


class _FunctionLevel(TorchFunctionMode):
    """Sees ``scaled_dot_product_attention`` whole (its kernels differ by device; its heads do not)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__getitem__:
            return self._getitem(args, kwargs)
        if func is not _SDPA:
            return func(*args, **kwargs)
        self.recorder.in_sdpa = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.recorder.in_sdpa = False
        self.recorder.sdpa(args, kwargs, out)
        return out


    def _getitem(self, args, kwargs):
        """``x[index]`` as written: an index list becomes a tensor on the meta device, whose values the
        dispatch level cannot read, so the shadows take the Python index here."""
        out = Tensor.__getitem__(*args, **kwargs)
        source, index = args[0], args[1]
        shadow = self.recorder.shadow.get(id(source))
        pieces = index if isinstance(index, tuple) else (index,)
        if shadow and isinstance(out, Tensor) and not any(isinstance(p, Tensor) for p in pieces):
            self.recorder.shadow[id(out)] = {name: [s[index] for s in slots] for name, slots in shadow.items()}
            self.recorder.keep.append(out)
        return out


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _matrix_stacks(block: nn.Module) -> dict[int, str]:
    """Tensor id -> FQN of the own weights of the modules, holding no projection, that hold a stack of matrices
    (a weight of 3 dimensions or more, several first): a per-head block-diagonal projection and its biases
    (RG-LRU's gates). Not a convolution's filters, nor experts (stood in for while the block is traced)."""
    return {id(p): join_fqn(fqn, name) for fqn, module in block.named_modules()
            if not isinstance(module, _CONVOLUTIONS) and not is_experts(module)
            and not is_stacked_experts(module) and not any(is_projection(m) for m in module.modules())
            and any(p.dim() >= 3 and p.shape[0] > 1 for p in module.parameters(recurse=False))
            for name, p in module.named_parameters(recurse=False)}


def _own_forward_weights(block: nn.Module) -> dict[int, str]:
    """Tensor id -> FQN of the weights of the ``nn.Linear`` subclasses with a forward of their own: one that
    multiplies by its weight as a stack of matrices (DeepSeek-V4's grouped output projection) is then followed
    through as a block-diagonal product, not as a projection (``BlockTrace.grouped``)."""
    return {id(m.weight): join_fqn(fqn, "weight") for fqn, m in block.named_modules()
            if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward}


def _per_head(shadow: Shadow, pick) -> list[dict[str, frozenset[int]]]:
    rows = next(iter(shadow.values()))[0].shape[0]
    return [{name: _features(pick(s, n) for s in slots) for name, slots in shadow.items()} for n in range(rows)]


def _features(pieces) -> frozenset[int]:
    """The features (non-negative indices) in shadow pieces."""
    return frozenset(int(i) for piece in pieces for i in piece.flatten().tolist() if i >= 0)


def _broadcast(shadow: Tensor, shape) -> Tensor | None:
    try:
        return torch.broadcast_to(shadow, shape).clone()
    except RuntimeError:
        return None
