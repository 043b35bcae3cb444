"""The recurrent scans of state-space and linear-attention layers, seen by the block trace as attention.

A Mamba-2 layer or a gated-delta-rule layer (Qwen3-Next, Qwen3.5, OLMo-Hybrid...) mixes the positions of
each head on its own, like attention, but through a chunked scan (cumulative sums, triangular solves) whose
ops do not move features the way the trace follows them. transformers runs these scans through named kernel
functions (``kernel_layer_name``: ``mamba2_scan_forward``, ``chunk_gated_delta_rule``...), whose meaning is
fixed: per head, a query-like input, a key-like one and values. The trace runs the kernel as it is (its
output's shape) without following features inside it, and records one attention product from its inputs:

* gated delta rule ``(query, key, value, g, beta)``, each ``(batch, tokens, heads, ...)``: head h reads the
  value head h with its ``g`` and ``beta``, and the query and key head ``h // (value heads / key heads)``;
* Mamba-2's scan ``(module, x, B, C, dt)``: head h reads its ``head_dim`` features of x and its ``dt``, and the
  B (key-like) and C (query-like) features of its group.

Each head's output carries its value features, as ``attn @ v`` does. The split then follows from the heads as
for attention, and is checked by tracing each rank's block the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

Shadow = dict[str, list[Tensor]]
Features = dict[str, frozenset[int]]


def kernel_name(module: nn.Module) -> str | None:
    """The scan kernel ``module`` is (a transformers kernel function), or None."""
    name = getattr(module, "kernel_layer_name", None)
    return name if name in _EVENTS else None


def scan_heads(name: str, module: nn.Module, args: tuple, kwargs: dict, shadow_of: Callable[[Tensor], Shadow | None],
               features: Callable) -> tuple[list[Features], list[Features], list[Features], Tensor] | None:
    """Per head, the (query, key, value) features the kernel ``name`` reads, and the input whose shadow its
    output carries (its values); None when an input has no features to follow."""
    return _EVENTS[name](module, args, kwargs, shadow_of, features)


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _at(shadow: Shadow, index, features) -> Features:
    return {name: features(slot[index] for slot in slots) for name, slots in shadow.items()}


def _merged(*sides: Features) -> Features:
    merged: dict[str, frozenset[int]] = {}
    for side in sides:
        for name, feats in side.items():
            merged[name] = merged.get(name, frozenset()) | feats
    return merged


def _gated_delta_rule(module, args, kwargs, shadow_of, features):
    query, key, value = (_argument(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    g, beta = _argument(args, kwargs, 3, "g"), _argument(args, kwargs, 4, "beta")
    sq, sk, sv = shadow_of(query), shadow_of(key), shadow_of(value)
    if not (sq and sk and sv) or value.dim() != 4 or value.shape[2] % key.shape[2]:
        return None
    heads, group = value.shape[2], value.shape[2] // key.shape[2]
    gates = [s for s in (shadow_of(g), shadow_of(beta)) if s]
    q = [_merged(_at(sq, (0, 0, h // group), features), *(_at(s, (0, 0, h), features) for s in gates))
         for h in range(heads)]
    k = [_at(sk, (0, 0, h // group), features) for h in range(heads)]
    v = [_at(sv, (0, 0, h), features) for h in range(heads)]
    return q, k, v, value


def _mamba2_scan(module, args, kwargs, shadow_of, features):
    mixer, x, b, c, dt = (_argument(args, kwargs, i, n) for i, n in enumerate(("module", "hidden_states", "B", "C", "dt")))
    sx, sb, sc, sdt = (shadow_of(t) for t in (x, b, c, dt))
    groups = getattr(mixer, "n_groups", None)
    if not (sx and sb and sc) or not isinstance(groups, int) or x.dim() != 3:
        return None
    heads = dt.shape[-1]
    if x.shape[-1] % heads or heads % groups or b.shape[-1] % groups:
        return None
    width, state, per_group = x.shape[-1] // heads, b.shape[-1] // groups, heads // groups

    def group_of(shadow, h):
        g = h // per_group
        return _at(shadow, (0, 0, slice(g * state, (g + 1) * state)), features)

    q = [group_of(sc, h) for h in range(heads)]
    k = [group_of(sb, h) for h in range(heads)]
    v = [_merged(_at(sx, (0, 0, slice(h * width, (h + 1) * width)), features), *([_at(sdt, (0, 0, h), features)] if sdt else []))
         for h in range(heads)]
    return q, k, v, x


_EVENTS = {
    "chunk_gated_delta_rule": _gated_delta_rule,
    "recurrent_gated_delta_rule": _gated_delta_rule,
    "fused_recurrent_gated_delta_rule": _gated_delta_rule,
    "mamba2_scan_forward": _mamba2_scan,
}
