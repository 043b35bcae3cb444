"""The recurrent scans of state-space and linear-attention layers, seen by the block trace as attention.

A Mamba-2 layer or a gated-delta-rule layer (Qwen3-Next, Qwen3.5, OLMo-Hybrid...) mixes the positions of
each head on its own, like attention, but through a chunked scan (cumulative sums, triangular solves) whose
ops do not move features the way the trace follows them. transformers runs these scans through named kernel
functions (``kernel_layer_name``: ``mamba2_scan_forward``, ``chunk_gated_delta_rule``...), whose meaning is
fixed: per head, a query-like input, a key-like one and values. The trace runs the kernel as it is (its
output's shape) without following features inside it, and records one attention product from its inputs:

* gated delta rule ``(query, key, value, g, beta)``, each ``(batch, tokens, heads, ...)``: head h reads the
  value head h with its ``g`` and ``beta``, and the query and key head ``h // (value heads / key heads)``;
  Kimi Delta Attention (``chunk_kda``, ``fused_recurrent_kda``) takes the same inputs, its ``g`` one decay
  per key feature of each head;
* the mLSTM backend (a module, not a kernel function: transformers' ``xLSTMBackend``, the ``xlstm`` package's
  ``mLSTMBackend``) ``(query, key, value, igate, fgate)``, each ``(batch, heads, tokens, ...)``: head h reads
  its query, key and value head and its two gates;
* Mamba-2's scan ``(module, x, B, C, dt)``: head h reads its ``head_dim`` features of x and its ``dt``, and the
  B (key-like) and C (query-like) features of its group;
* Mamba-1's selective scan ``(module, x, dt, B, C, gate)``, x ``(batch, channels, tokens)``: each channel is a
  head of one feature, which reads its x, dt and gate, and the B and C every channel shares.

Each head's output carries its value features, as ``attn @ v`` does (with Mamba-1's gate, applied in the scan). The split then follows from the heads as
for attention, and is checked by tracing each rank's block the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

Shadow = dict[str, list[Tensor]]
Features = dict[str, frozenset[int]]


def kernel_name(module: nn.Module) -> str | None:
    """The scan kernel ``module`` is (a transformers kernel function, or an mLSTM backend module), or None."""
    name = getattr(module, "kernel_layer_name", None)
    if name is None and type(module).__name__ in _BACKENDS:
        name = type(module).__name__
    return name if name in _EVENTS else None


def scan_heads(name: str, module: nn.Module, args: tuple, kwargs: dict, shadow_of: Callable[[Tensor], Shadow | None],
               features: Callable) -> tuple[list[Features], list[Features], list[Features], Callable] | None:
    """Per head, the (query, key, value) features the kernel ``name`` reads, and the shadow of its output (a
    function of the output: the values' features at each head's place); None when an input has no features to
    follow."""
    return _EVENTS[name](module, args, kwargs, shadow_of, features)


def _carried(shadows: list[Shadow], positions: int) -> Callable[[Tensor], Shadow]:
    """The shadow of an output shaped as the values (``shadows``: theirs, and a gate's), whose dimension
    ``positions`` (the tokens) the scan mixes: each place holds the features of the values' first position."""
    def shadow(out: Tensor) -> Shadow:
        first = [slice(None)] * out.dim()
        first[positions] = slice(0, 1)
        merged: Shadow = {}
        for source in shadows:
            for name, slots in source.items():
                merged.setdefault(name, []).extend(s[tuple(first)].expand(out.shape).clone() for s in slots)
        return merged
    return shadow


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
    return q, k, v, _carried([sv], 1)


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
    return q, k, v, _carried([sx], 1)


def _mamba_scan(module, args, kwargs, shadow_of, features):
    names = ("module", "hidden_states", "time_step", "B", "C", "gate")
    _, x, dt, b, c, gate = (_argument(args, kwargs, i, n) for i, n in enumerate(names))
    sx, sb, sc = shadow_of(x), shadow_of(b), shadow_of(c)
    if not (sx and sb and sc) or x.dim() != 3 or b.dim() != 3:
        return None
    per_channel = [s for s in (shadow_of(dt), shadow_of(gate)) if s]
    q = [_at(sc, (0, 0, slice(None)), features)] * x.shape[1]
    k = [_at(sb, (0, 0, slice(None)), features)] * x.shape[1]
    v = [_merged(*(_at(s, (0, h, 0), features) for s in [sx, *per_channel])) for h in range(x.shape[1])]
    return q, k, v, _carried([sx, *per_channel], 2)


def _mlstm(module, args, kwargs, shadow_of, features):
    names = ("query", "key", "value", "igate", "fgate")
    query, key, value, igate, fgate = (_argument(args, kwargs, i, n) for i, n in enumerate(names))
    sq, sk, sv = shadow_of(query), shadow_of(key), shadow_of(value)
    if not (sq and sk and sv) or value.dim() != 4 or key.shape[1] != value.shape[1]:
        return None
    gates = [s for s in (shadow_of(igate), shadow_of(fgate)) if s]
    heads = value.shape[1]
    q = [_merged(_at(sq, (0, h, 0), features), *(_at(s, (0, h, 0), features) for s in gates)) for h in range(heads)]
    k = [_at(sk, (0, h, 0), features) for h in range(heads)]
    v = [_at(sv, (0, h, 0), features) for h in range(heads)]
    return q, k, v, _carried([sv], 2)


_BACKENDS = ("xLSTMBackend", "mLSTMBackend")
"""The mLSTM backends (transformers' and the ``xlstm`` package's), modules that run the mLSTM kernels."""

_EVENTS = {
    "chunk_gated_delta_rule": _gated_delta_rule,
    "recurrent_gated_delta_rule": _gated_delta_rule,
    "fused_recurrent_gated_delta_rule": _gated_delta_rule,
    "chunk_kda": _gated_delta_rule,
    "fused_recurrent_kda": _gated_delta_rule,
    "mamba2_scan_forward": _mamba2_scan,
    "mamba_scan_forward": _mamba_scan,
    "xLSTMBackend": _mlstm,
    "mLSTMBackend": _mlstm,
}
