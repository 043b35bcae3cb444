"""Mixture-of-experts weights split over tp like any MLP, each expert by its intermediate features.

transformers stores a block's experts as stacked matrices in one module (``MixtralExperts``, ``Qwen3MoeExperts``,
``GptOssExperts``...), called as ``experts(hidden_states, top_k_index, top_k_weights)`` and described by the
flags its ``use_experts_implementation`` decorator sets: ``has_gate`` (``gate_up_proj`` (E, 2I, H), else
``up_proj`` (E, I, H)), ``is_transposed`` (stored (E, H, 2I) and (E, I, H)), ``is_concatenated`` (``[gate | up]``
as two halves, else interleaved pairs) and ``has_bias``. :func:`experts_layout` reads those flags.

At tp, every rank keeps, of every expert, the intermediate features ``[r I/tp, (r+1) I/tp)``: its slice of the
up projection (its gates and their ups: ``_StridedShard`` over the two halves, a plain ``Shard`` of interleaved
pairs) and the same inputs of the down projection. The router stays whole and routes the same tokens on every
rank. Each rank then runs the module's own forward, whatever implementation the config picked, on its local
weights (:class:`ExpertsSplit`), and the ranks' outputs are summed:

* the output is this rank's share of every token's expert sum: summed over tp (forward), its gradient as is;
* the hidden states and the routing weights are read by every rank's share: their gradients are summed over tp
  (the router so gets one process's gradient);
* the down projection's bias is added once, by tp rank 0, and its gradient summed over tp.

A plain module that holds exactly a stacked up and a stacked down projection (two 3-D weights, experts first,
as Llama 4's and some remote-code experts are written, with no flags), or a stacked gate, up and down (three, the
gate shaped as the up: Inkling's shared experts), is split the same way once its layout is known:
:func:`experts_layouts` tries each layout its shapes allow ([gate | up] halves, interleaved pairs, up only;
which dimension holds the intermediate features) on random weights of the module's shapes, with a few
intermediate features, and keeps the one where the sum over tp ranks of the module's own forward, each on its
slice, is the forward on all of them. A forward that is not linear in its intermediate features (a norm on each
expert's output) matches none and is left whole, named.

Each expert stays whole on the expert dimension, so expert parallelism can later split that dimension instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from lightning_3d.policies.local_tensors import gradient_summed, shadowed
from lightning_3d.policies.meta_values import MetaValues

FLAGS = ("has_gate", "is_transposed", "is_concatenated", "has_bias")
"""The attributes transformers' ``use_experts_implementation`` sets on an experts module."""
MAX_CHECK_BYTES = 256 << 20
"""The most memory the check of a plain stacked-experts module's layout may take (its random weights): the
check runs at plan time on every rank."""
FEATURES_CHECKED = 2
"""Intermediate features per tp rank in that check: enough to tell halves from interleaved pairs."""


@dataclass(frozen=True)
class ExpertsLayout:
    """Where an experts module keeps its intermediate features."""

    up: str
    """``gate_up_proj`` or ``up_proj``."""
    up_dim: int
    """The dimension of ``up`` that holds the intermediate features (1, or 2 when transposed)."""
    halves: bool
    """``[gate | up]`` as two halves of ``up_dim`` (each rank keeps its slice of both)."""
    down_dim: int
    """The dimension of ``down_proj`` that holds the intermediate features (2, or 1 when transposed)."""
    bias: bool
    down: str = "down_proj"
    """The down projection's name."""
    gate: str | None = None
    """A gate stacked apart from ``up``, of its shape (``gate_proj`` beside ``up_proj``), split as ``up`` is."""

    @property
    def intermediate(self) -> str:
        return f"{self.up}.shape[{self.up_dim}]"


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module (see the module docstring)."""
    return all(hasattr(module, flag) for flag in FLAGS) and isinstance(getattr(module, "down_proj", None), Tensor)


def is_dispatched_experts(module: nn.Module) -> bool:
    """A transformers experts module whose forward is the decorator's dispatch to an experts implementation:
    ``forward(hidden_states, top_k_index, top_k_weights)``, for any tokens routed to any of its experts."""
    return is_experts(module) and hasattr(type(module).forward, "__wrapped__")


def experts_layout(module: nn.Module, tp: int) -> tuple[ExpertsLayout | None, str]:
    """How ``module`` (:func:`is_experts`) splits over ``tp`` ranks, or None and why it does not."""
    if getattr(module, "has_post_expert_norm", False) or any(
            any(True for _ in child.parameters()) for child in module.children()):
        return None, "a module with weights (a norm) runs on each expert's output, which tp would see in pieces"
    if not hasattr(type(module).forward, "__wrapped__"):  # the decorator's dispatch wraps the class's forward
        return None, (f"{type(module).__name__}.forward does more than the experts implementation it calls, on"
                      " outputs that tp would see in pieces")
    transposed = bool(module.is_transposed)
    layout = ExpertsLayout(up="gate_up_proj" if module.has_gate else "up_proj", up_dim=2 if transposed else 1,
                           halves=bool(module.has_gate and module.is_concatenated),
                           down_dim=1 if transposed else 2, bias=bool(module.has_bias))
    up, down = getattr(module, layout.up, None), module.down_proj
    if not isinstance(up, Tensor) or up.dim() != 3 or down.dim() != 3:
        return None, f"it holds no 3-D {layout.up} and down_proj (experts, features, features)"
    intermediate = down.shape[layout.down_dim]
    if up.shape[layout.up_dim] != intermediate * (2 if module.has_gate else 1):
        return None, f"{layout.up} {tuple(up.shape)} and down_proj {tuple(down.shape)} disagree on the intermediate size"
    if intermediate % tp:
        return None, f"each expert's {intermediate} intermediate features do not divide by tensor_parallel_size={tp}"
    return layout, ""


def stacked_matrices(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s own 3-D parameters that are a stack of expert matrices: two or more of them with the same
    number of experts first, one reading what another writes (``gate_up_proj`` (E, 2I, H) and ``down_proj``
    (E, H, I)). A convolution's (C, 1, K) or a projection stored (hidden, heads, head_dim) is not."""
    stacks = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and min(p.shape) > 1]
    return [(n, p) for n, p in stacks
            if any(q is not p and q.shape[0] == p.shape[0] and (q.shape[2] == p.shape[1] or p.shape[2] == q.shape[1])
                   for _, q in stacks)]


def is_stacked_experts(module: nn.Module) -> bool:
    """A module whose own parameters are exactly a stacked up and a stacked down projection
    (:func:`stacked_matrices`), and whose forward is not transformers' dispatch to an experts implementation
    (the flags, if it has them, may describe its weights but not what its own forward does with them)."""
    stacks = stacked_matrices(module)
    return (not is_dispatched_experts(module) and len(stacks) in (2, 3) and len(list(module.parameters(recurse=False))) == len(stacks)
            and len({tuple(p.shape) for _, p in stacks}) < 3)  # (of three, a gate of the up's shape)


def routed_experts(root: nn.Module, blocks: list[str]) -> list[str]:
    """The FQNs of the experts modules in ``blocks`` whose forward is transformers' dispatch to an experts
    implementation: called with the router's choices and weights, what expert parallelism routes
    (``lightning_3d.parallel.expert_parallel``)."""
    return [f"{block}.{name}" for block in blocks for name, module in root.get_submodule(block).named_modules()
            if name and is_dispatched_experts(module)]


def experts_layouts(block: nn.Module, args: tuple, kwargs: dict, tp: int) -> dict[str, tuple[ExpertsLayout | None, str]]:
    """Every experts module in ``block`` (a meta copy, called on ``args``/``kwargs``) -> how it splits over ``tp``
    ranks, or None and why it does not. A plain stacked one is checked on random weights (module docstring)."""
    stacked = {name: module for name, module in block.named_modules() if is_stacked_experts(module)}
    found = {name: experts_layout(module, tp) for name, module in block.named_modules()
             if is_experts(module) and name not in stacked}
    if stacked:
        calls: dict[nn.Module, tuple[tuple, dict]] = {}
        try:  # the block on meta, for the arguments each experts module is called with
            with torch.no_grad(), torch.device("meta"), MetaValues(), experts_stood_in(block, calls):
                block(*args, **kwargs)
        except Exception:  # noqa: BLE001 -- the block's trace says why it does not run; the modules not reached say so
            pass
        for name, module in stacked.items():
            found[name] = _stacked_layout(module, calls.get(module), tp)
    return found


def _stacked_layout(module: nn.Module, call: tuple[tuple, dict] | None, tp: int) -> tuple[ExpertsLayout | None, str]:
    kind = f"the experts module {type(module).__name__}"
    if any(any(True for _ in child.parameters()) for child in module.children()):
        return None, f"{kind} runs a module with weights (a norm) on what tp would see in pieces"
    if call is None:
        return None, f"{kind} was not reached when the block ran on the meta device, so its layout was not checked"
    own = dict(module.named_parameters(recurse=False))
    said = " and ".join(f"{name} {tuple(p.shape)}" for name, p in own.items())
    candidates = [layout for up in own for down in own if down != up
                  for layout in _candidates(module, up, down, gate=next((g for g in own if g not in (up, down)), None))]
    if not candidates:
        return None, f"{kind}'s {said} agree on no hidden and intermediate size (up (E, kI, H) or (E, H, kI), k = 1 or 2)"
    for layout in candidates:
        intermediate = getattr(module, layout.down).shape[layout.down_dim]
        if intermediate % tp:
            continue
        size = _check_bytes(module, layout, tp)
        if size > MAX_CHECK_BYTES:
            return None, (
                f"checking the layout of {kind} ({said}) would take {size / 2**20:,.0f} MiB of random weights (more than"
                f" {MAX_CHECK_BYTES >> 20} MiB); if its forward is linear in the intermediate features, write the line in a"
                f" policy of your own: ExpertsSplit(ExpertsLayout(up='{layout.up}', up_dim={layout.up_dim},"
                f" halves=<True for [gate | up] halves>, down_dim={layout.down_dim}, bias=False, down='{layout.down}'))")
        if _sums_over_ranks(module, layout, call, tp):
            return layout, ""
    sizes = {getattr(module, c.down).shape[c.down_dim] for c in candidates}
    if all(size % tp for size in sizes):
        return None, (f"each expert's {'/'.join(map(str, sorted(sizes)))} intermediate features of {kind} do not"
                      f" divide by tensor_parallel_size={tp}")
    return None, (f"{kind}.forward is not the sum of its forwards on each tp rank's slice of the intermediate features"
                  f" in any layout of {said} (checked on random weights): it does more than a linear map on them,"
                  " which tp would see in pieces")


def _candidates(module: nn.Module, up: str, down: str, gate: str | None = None) -> list[ExpertsLayout]:
    """The layouts with ``up`` and ``down`` as the up and the down projection (and ``gate`` as a gate stacked
    apart, of the up's shape) that their shapes allow."""
    up_shape, down_shape = getattr(module, up).shape, getattr(module, down).shape
    if gate is not None and getattr(module, gate).shape != up_shape:
        return []
    found = []
    for up_dim in (1, 2):
        for down_dim in (1, 2):
            hidden_agrees = up_shape[3 - up_dim] == down_shape[3 - down_dim]
            gated = up_shape[up_dim] == 2 * down_shape[down_dim]
            if hidden_agrees and (gated or up_shape[up_dim] == down_shape[down_dim]):
                found += [ExpertsLayout(up=up, up_dim=up_dim, halves=halves, down_dim=down_dim, bias=False, down=down,
                                        gate=gate)
                          for halves in ((True, False) if gated and gate is None else (False,))]
    return found


def _check_shapes(module: nn.Module, layout: ExpertsLayout, tp: int) -> tuple[list[int], list[int]]:
    """The shapes of the random up and down weights of the check: the module's, with FEATURES_CHECKED
    intermediate features per rank."""
    up, down = list(getattr(module, layout.up).shape), list(getattr(module, layout.down).shape)
    factor = up[layout.up_dim] // down[layout.down_dim]  # 2 with a gate
    up[layout.up_dim], down[layout.down_dim] = factor * FEATURES_CHECKED * tp, FEATURES_CHECKED * tp
    return up, down


def _check_bytes(module: nn.Module, layout: ExpertsLayout, tp: int) -> int:
    up, down = _check_shapes(module, layout, tp)
    ups = 2 if layout.gate else 1
    return 2 * 8 * (ups * torch.Size(up).numel() + torch.Size(down).numel())  # float64, whole and sliced


def _sums_over_ranks(module: nn.Module, layout: ExpertsLayout, call: tuple[tuple, dict], tp: int) -> bool:
    """Whether ``module``'s forward on random weights of ``layout`` is the sum of its forwards on each rank's
    slice of them (of gate and up alike, and the matching inputs of down)."""
    generator = torch.Generator().manual_seed(0)  # every rank draws the same, and so decides the same
    up_shape, down_shape = _check_shapes(module, layout, tp)
    up, down = (torch.randn(shape, dtype=torch.float64, generator=generator) for shape in (up_shape, down_shape))
    gate = torch.randn(up_shape, dtype=torch.float64, generator=generator) if layout.gate else None
    experts = up.shape[0]

    def random(value):  # an input of the traced call's shape: routing indices among the experts
        if not isinstance(value, Tensor):
            return value
        if value.is_floating_point():
            return torch.randn(value.shape, dtype=torch.float64, generator=generator)
        high = 2 if value.dtype == torch.bool else experts
        return torch.randint(0, high, value.shape, generator=generator).to(value.dtype)

    args, kwargs = [random(a) for a in call[0]], {k: random(v) for k, v in call[1].items()}

    def forward(up: Tensor, down: Tensor, gate: Tensor | None):
        weights = {layout.up: up, layout.down: down, **({layout.gate: gate} if layout.gate else {})}
        with torch.no_grad(), shadowed(module, weights):
            return module(*args, **kwargs)

    try:
        whole = forward(up, down, gate)
        shares = [forward(_rank_slice(up, layout.up_dim, layout.halves, tp, rank), down.chunk(tp, layout.down_dim)[rank],
                          None if gate is None else gate.chunk(tp, layout.up_dim)[rank])
                  for rank in range(tp)]
    except Exception:  # noqa: BLE001 -- a forward that cannot run on this layout's slices is not linear in it
        return False
    if not isinstance(whole, Tensor) or not all(isinstance(s, Tensor) and s.shape == whole.shape for s in shares):
        return False
    scale = whole.abs().max()
    return bool(scale > 0) and torch.allclose(sum(shares), whole, rtol=1e-5, atol=1e-5 * float(scale))


def _rank_slice(up: Tensor, dim: int, halves: bool, tp: int, rank: int) -> Tensor:
    """``rank``'s slice of the up projection: of each half ([gate | up]) or of the whole (interleaved, up only)."""
    if halves:
        return torch.cat([half.chunk(tp, dim)[rank] for half in up.chunk(2, dim)], dim)
    return up.chunk(tp, dim)[rank]


class ExpertsSplit(ParallelStyle):
    """Splits an experts module's intermediate features over tp (see the module docstring).

    Example (Mixtral)::

        {"model.layers.*.mlp.experts": ExpertsSplit(layout)}  # layout = experts_layout(module, tp)[0]
    """

    def __init__(self, layout: ExpertsLayout) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, self._partition)
        module.forward = _SplitForward(module, module.forward, device_mesh)
        return module

    def placements(self) -> dict[str, Placement]:
        """Where the tp split puts each of the experts module's weights, by name."""
        layout = self.layout
        up = _StridedShard(layout.up_dim, split_factor=2) if layout.halves else Shard(layout.up_dim)
        return {layout.up: up, **({layout.gate: up} if layout.gate else {}), layout.down: Shard(layout.down_dim),
                f"{layout.up}_bias": _StridedShard(1, split_factor=2) if layout.halves else Shard(1),
                f"{layout.down}_bias": Replicate()}

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # the module's own weights only
            return
        for param, placement in self.placements().items():
            tensor = getattr(module, param, None)
            # (a DTensor already where expert parallelism placed it on ("ep", "tp"): parallel/expert_parallel.py)
            if isinstance(tensor, nn.Parameter) and not isinstance(tensor, DTensor):
                sharded = distribute_tensor(tensor, mesh, [placement], src_data_rank=self.src_data_rank)
                module.register_parameter(param, nn.Parameter(sharded, requires_grad=tensor.requires_grad))

    def __repr__(self) -> str:
        return f"ExpertsSplit({self.layout.intermediate})"


class _SplitForward:
    """The experts module's own forward, run on this rank's weights; its output summed over tp."""

    def __init__(self, module: nn.Module, forward, mesh: DeviceMesh) -> None:
        self.module, self.forward, self.mesh = module, forward, mesh

    def __call__(self, *args, **kwargs) -> Tensor:
        # Every rank's share reads the hidden states and the routing weights: their gradients are summed over tp.
        args = [self._read_by_every_rank(a) for a in args]
        kwargs = {k: self._read_by_every_rank(v) for k, v in kwargs.items()}
        with _local_weights(self.module, self.mesh):
            share = self.forward(*args, **kwargs)
        return DTensor.from_local(share, self.mesh, [Partial()], run_check=False).redistribute(
            placements=[Replicate()]).to_local()

    def _read_by_every_rank(self, value):
        return gradient_summed(value, self.mesh) if isinstance(value, Tensor) and value.is_floating_point() else value


def _local_weights(module: nn.Module, mesh: DeviceMesh):
    """``module``'s split weights seen as this rank's local tensors while its forward runs; the replicated down
    bias as its once-added share."""
    local = {}
    for name, param in module.named_parameters(recurse=False):
        if not isinstance(param, DTensor):
            continue
        if param.placements[-1].is_replicate():  # down_proj_bias: added by rank 0, its gradient summed over tp
            local[name] = gradient_summed(param.to_local(), mesh) * (1.0 if mesh.get_local_rank() == 0 else 0.0)
        else:
            local[name] = param.to_local()
    return shadowed(module, local)


@contextlib.contextmanager
def experts_stood_in(block: nn.Module, calls: dict[nn.Module, tuple[tuple, dict]] | None = None):
    """While a block runs without data (traced on the meta device, checked on fake tensors), its experts modules
    (transformers' and plain stacked ones) run :class:`_StandIn`: routing reads values, and grouped matmuls have
    no fake kernel for every dtype. ``calls``, if given, receives each one's first arguments."""
    experts = {m: m.__dict__.get("forward") for m in block.modules() if is_experts(m) or is_stacked_experts(m)}
    for module in experts:
        module.forward = _StandIn(module, calls)
    try:
        yield
    finally:
        for module, own in experts.items():
            del module.forward
            if own is not None:
                module.forward = own


class _StandIn:
    """Reads every floating-point input, as the experts do (the hidden states, the routing weights), and returns
    a tensor of the first one's shape, as their output has."""

    def __init__(self, module: nn.Module, calls: dict | None) -> None:
        self.module, self.calls = module, calls

    def __call__(self, *args, **kwargs) -> Tensor:
        if self.calls is not None:
            self.calls.setdefault(self.module, (args, kwargs))
        read = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.is_floating_point()]
        out = read[0]
        for other in read[1:]:  # per token where it has the tokens' shape (top_k_weights)
            per_token = other.shape[:-1] == out.shape[:-1]
            out = out * (other.sum(-1, keepdim=True) if per_token else other.sum()).to(out.dtype)
        return out


class ExpertsStandIn(nn.Module):
    """Stands in for an experts module in its parent where the module's own hooks must not run: FSDP2's
    pre-forward (the experts of an expert-parallel layer are a unit of their own) would unshard them into the fake
    tensors of a shape check, and keep those. Calls return :class:`_StandIn`'s output; attribute reads reach the
    experts module."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        vars(self)["_stood_for"] = experts  # not a submodule: the stand-in holds no weights of its own

    def __getattr__(self, name: str):
        return getattr(vars(self)["_stood_for"], name)

    def forward(self, *args, **kwargs) -> Tensor:
        return _StandIn(vars(self)["_stood_for"], None)(*args, **kwargs)
