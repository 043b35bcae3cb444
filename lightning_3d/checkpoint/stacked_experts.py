"""Checkpoints that store each expert apart, read as the stacked tensors a transformers experts module holds.

A Hugging Face checkpoint of Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 and the like keeps each expert's projections
under names of their own (``model.layers.0.block_sparse_moe.experts.3.w1.weight``), the layout those models were
published in, and the one transformers' ``save_pretrained`` writes. The model holds them stacked
(``model.layers.0.mlp.experts.gate_up_proj``: the experts along dim 0, gate and up concatenated along dim 1), and
transformers converts as it loads, by the model type's conversion mapping
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``).

:func:`stacked_names` reads that mapping -- its renamings, and its converters that stack a per-expert list
(``MergeModulelist(dim=0)``) and concatenate the parts (``Concatenate(dim=d)``) -- and shows the checkpoint's
tensors under the model's names. A region of a stacked tensor is copied from the per-expert tensors it covers,
so a rank reads only its own experts' slices (expert parallelism), and of those only its tp features. A mapping
with other operations is left out: the model's keys it would have made stay missing, and ``init_from`` says so.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import torch

Copy = Callable[[str, tuple[slice, ...], torch.Tensor], object]
"""``copy_into(name, region, out)``: ``out.copy_(tensor[region])``, the region ``()`` for the whole tensor."""


def conversions_of(module: torch.nn.Module) -> list[Any]:
    """transformers' conversion mappings of the models inside ``module`` (none without transformers)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    found = []
    for model_type in {getattr(getattr(m, "config", None), "model_type", None) for m in module.modules()} - {None}:
        found += get_checkpoint_conversion_mapping(model_type) or []
    return found


def stacked_names(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], copy_into: Copy,
                  conversions: list[Any]) -> tuple[dict, dict, Copy] | None:
    """The checkpoint (``shapes``, ``dtypes``, ``copy_into``) under the names ``conversions`` give its tensors,
    its per-expert tensors stacked; None when no converter of theirs stacks experts found there."""
    renamings = [c for c in conversions if type(c).__name__ == "WeightRenaming"]
    converters = [(c, dim) for c in conversions
                  if type(c).__name__ == "WeightConverter" and (dim := _stacking(c)) is not None]
    renamed = {_renamed(key, renamings): key for key in shapes}
    stacks = {}  # the model's name -> (its parts' per-expert keys, [expert][part], the concatenated dim)
    for converter, dim in converters:
        stacks.update(_stacks(converter, dim, renamed))
    if not stacks:
        return None
    used = {key for parts, _ in stacks.values() for keys in parts for key in keys}
    new_shapes = {name: shapes[key] for name, key in renamed.items() if key not in used}
    new_dtypes = {name: dtypes[key] for name, key in renamed.items() if key not in used}
    for name, (parts, dim) in stacks.items():
        shape = list(shapes[parts[0][0]])
        shape[dim - 1] = sum(shapes[key][dim - 1] for key in parts[0])
        new_shapes[name], new_dtypes[name] = (len(parts), *shape), dtypes[parts[0][0]]

    def copy(name: str, region: tuple[slice, ...], out: torch.Tensor) -> None:
        if name not in stacks:
            copy_into(renamed[name], region, out)
            return
        parts, dim = stacks[name]
        region = region or tuple(slice(0, n) for n in new_shapes[name])
        experts, along = region[0], region[dim]
        offset = 0
        for part in range(len(parts[0])):
            size = shapes[parts[0][part]][dim - 1]
            low, high = max(along.start, offset), min(along.stop, offset + size)
            if low < high:
                source = list(region[1:])
                source[dim - 1] = slice(low - offset, high - offset)
                into = [slice(None)] * (len(region) - 1)
                into[dim - 1] = slice(low - along.start, high - along.start)
                for expert in range(experts.start, experts.stop):
                    copy_into(parts[expert][part], tuple(source), out[expert - experts.start][tuple(into)])
            offset += size

    return new_shapes, new_dtypes, copy


def _stacking(converter: Any) -> int | None:
    """The dim a converter concatenates its parts along once it stacked each part's experts (dim 0), 1 for a
    single part; None for any other operations."""
    names = [type(op).__name__ for op in converter.operations]
    if names[:1] != ["MergeModulelist"] or converter.operations[0].dim != 0 or len(converter.target_patterns) != 1:
        return None
    if names == ["MergeModulelist"] and len(converter.source_patterns) == 1:
        return 1
    if names == ["MergeModulelist", "Concatenate"] and converter.operations[1].dim >= 1:
        return converter.operations[1].dim
    return None


def _stacks(converter: Any, dim: int, renamed: dict[str, str]) -> dict[str, tuple[list[list[str]], int]]:
    """The stacked tensors ``converter`` makes of the checkpoint's keys (by their renamed names), its parts
    concatenated along ``dim``."""
    patterns = [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in converter.source_patterns]
    found: dict[str, dict[tuple[int, int], str]] = defaultdict(dict)  # prefix -> (expert, part) -> key
    for name, key in renamed.items():
        for part, pattern in enumerate(patterns):
            match = pattern.search(name)
            if match:
                found[name[:match.start()]][int(match.group(1)), part] = key
    stacks = {}
    for prefix, keys in found.items():
        count = 1 + max(expert for expert, _ in keys)
        if len(keys) != count * len(patterns):
            continue  # an expert or a part missing: not this converter's layout
        parts = [[keys[expert, part] for part in range(len(patterns))] for expert in range(count)]
        stacks[prefix + converter.target_patterns[0]] = (parts, dim)
    return stacks


def _renamed(key: str, renamings: list[Any]) -> str:
    for renaming in renamings:
        targets = renaming.target_patterns
        for i, pattern in enumerate(renaming.source_patterns):
            key = re.sub(pattern, targets[min(i, len(targets) - 1)], key)
    return key
