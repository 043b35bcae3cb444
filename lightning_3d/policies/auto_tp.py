"""The tensor-parallel part of the "auto" plan, for a model no policy was written for.

The blocks are those of every list ``auto.block_lists`` finds (a model may hold an encoder's and a decoder's,
or two stacks it runs in turns). One block of each kind (class and parameter shapes) is traced on a meta copy of the model, with the inputs
the model itself gives it (:mod:`~lightning_3d.policies.block_trace`), and split from what it computes
(:mod:`~lightning_3d.policies.tp_structure`): attention and MLP regions, fused or not, in one module or over
siblings, ``nn.Linear`` or ``Conv1D``. Every block of that kind takes the same split:

* each region's column projections split their outputs (``ColumnSplit``; fused ones per part), its row
  projection its inputs (``RowSplit``), which reduces (or, with sequence parallelism, reduce-scatters) into
  the residual stream;
* the region's hidden states become a replicated DTensor once, at the module that takes them whole
  (``HiddenStates``), so its columns share one gradient reduction; else each column takes them itself;
* the integer attributes the block reshapes by are set per rank, as the trace found them.

Outside the blocks, the token embedding and the output head split over the vocabulary
(``policies.vocab_parallel``; a tied pair stays one tensor).

**Never a silent no-op**: with more than ``MAX_REPLICATED`` of the block parameters left whole, planning
stops (:class:`~lightning_3d.errors.PolicyError`) with what was not understood and how to write the policy
lines, unless ``allow_replicated=True``. What was split is said once per job (rank 0).

**Sequence parallelism**: between the regions the hidden states stay split along the sequence: the
LayerNorm/RMSNorm layers of each block outside the regions run on sequence shards, each region gathers its
input and its row projection reduce-scatters. The residual stream is split entering the first block and
gathered leaving the last (the final norm and the head see every position); a model with several lists of
blocks is refused, as where each list's hidden states may be split and gathered cannot be told from its
structure. A block holding other weights between the regions is refused: they could mix positions.
Parameter-free code there (a token shift) cannot be seen, so it must act on each position alone.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from lightning_3d.common import join_fqn, parent_fqn
from lightning_3d.policies.auto_pipeline import tied_parameters
from lightning_3d.policies.base import Plan, PlanOptions, PolicyError
from lightning_3d.policies.block_inputs import block_inputs, required_positionals
from lightning_3d.policies.block_trace import is_projection, meta_copy, projection_sizes
from lightning_3d.policies.experts import ExpertsSplit, is_experts, is_stacked_experts, stacked_matrices
from lightning_3d.policies.head_inputs import HeadInputs, in_words
from lightning_3d.policies.head_weights import HeadWeights
from lightning_3d.policies.hidden_states import HiddenStates
from lightning_3d.policies.projections import ColumnSplit, OnSplitFeatures, RowSplit, SummedGradients
from lightning_3d.policies.tp_per_rank import attribute_values
from lightning_3d.policies.tp_structure import BlockSplit, split_block
from lightning_3d.policies.vocab_parallel import vocab_parallel_styles

MAX_REPLICATED = 0.10
"""The largest share of the block parameters "auto" may leave whole on every tp rank without being told."""


def structural_tp_plan(root: nn.Module, block_lists: list[list[str]], options: PlanOptions) -> Plan:
    """The plan that splits the blocks of every list of ``block_lists`` of ``root`` over ``options.tp`` ranks
    (see the module docstring); its ``blocks``, what the pipeline cuts, are the first list's."""
    if options.sequence_parallel and len(block_lists) > 1:
        raise PolicyError(_several_lists_refusal(block_lists))
    blocks = [block for found in block_lists for block in found]
    between = Shard(1) if options.sequence_parallel else Replicate()
    splits = block_splits(root, blocks, options.tp)
    tp_plan: dict[str, ParallelStyle] = {}
    fixes: dict[str, dict] = {}
    sharded_rng: list[str] = []
    covered: dict[str, list[str]] = {}
    for block, split in splits.items():
        covered[block] = []
        for region in split.regions:
            column_input = {}
            if region.feeders:  # all on local tensors, each rank's gradient a share summed where they enter
                tp_plan[join_fqn(block, region.input_module)] = HiddenStates(input=(between, Replicate()),
                                                                             partial_gradient=True)
                column_input = dict(local_input=True)
                for feeder, divides in region.feeders.items():
                    tp_plan[join_fqn(block, feeder)] = (ColumnSplit(local_input=True, gather_output=True)
                                                        if divides else SummedGradients())
                tp_plan.update({join_fqn(block, m): SummedGradients() for m in region.on_feeders})
                covered[block] += [join_fqn(block, m) for m in (*region.feeders, *region.on_feeders)]
            elif region.narrow_input:  # the module sees this rank's hidden features; its columns gather them
                tp_plan[join_fqn(block, region.input_module)] = HiddenStates(input=(between, Shard(-1)))
                column_input = dict(input_layouts=Shard(-1))
            elif region.input_module is not None:
                tp_plan[join_fqn(block, region.input_module)] = HiddenStates(input=(between, Replicate()),
                                                                             use_local_output=False)
            else:
                column_input = dict(input_layouts=between)
            changed = region.changed_in_place
            for column in region.columns:
                tp_plan[join_fqn(block, column)] = ColumnSplit(parts=region.parts[column], whole=region.whole[column],
                                                               picked=region.picked.get(column),
                                                               copy_output=column in changed,
                                                               **column_input)
            tp_plan[join_fqn(block, region.row)] = RowSplit(output_layouts=between, copy_output=region.row in changed)
            for inner in region.inner_rows:  # its output stays in the region: whole, or each rank's heads' slice
                tp_plan[join_fqn(block, inner)] = (RowSplit(output_layouts=Shard(-1)) if inner in region.owned
                                                   else RowSplit(output_layouts=Replicate(), summed_gradient=True))
            tp_plan.update({join_fqn(block, m): SummedGradients() for m in region.on_inner_rows})
            for holder, values in attribute_values(root.get_submodule(block), region.fixes).items():
                fixes.setdefault(join_fqn(block, holder), {}).update(values)
            tp_plan.update({join_fqn(block, m): OnSplitFeatures(dim=d) for m, d in region.inner.items()})
            tp_plan.update({join_fqn(block, m): SummedGradients(shared_by_heads=True) for m in region.on_local})
            for holder, names in region.head_weights.items():
                fqn = join_fqn(block, holder)
                cuts = {n: region.depthwise[m] for n in names
                        if (m := join_fqn(holder, parent_fqn(n))) in region.depthwise}
                cuts.update(region.weight_parts.get(holder, {}))
                tp_plan[fqn] = HeadWeights(names, inner=tp_plan.get(fqn), parts={n: p for n, (p, _) in cuts.items()},
                                           whole={n: w for n, (_, w) in cuts.items()})
                covered[block] += [f"{fqn}.{name}" for name in names]
            covered[block] += [join_fqn(block, name) for name in (*region.columns, region.row, *region.inner,
                                                                  *region.inner_rows, *region.on_inner_rows,
                                                                  *region.on_local)]
        for name in split.gathered:  # used whole: split by outputs, gathered (per position under SP)
            tp_plan[join_fqn(block, name)] = ColumnSplit(input_layouts=between, output_layouts=between)
            covered[block].append(join_fqn(block, name))
        for name, layout in split.experts.items():
            tp_plan[join_fqn(block, name)] = ExpertsSplit(layout)
            covered[block].append(join_fqn(block, name))
    vocabulary, said = vocab_parallel_styles(root, blocks, options.tp, options.vocab_parallel_loss)
    tp_plan.update(vocabulary)
    _judge(root, [found[0] for found in block_lists], splits, tp_plan, options, said)
    if options.sequence_parallel:
        for block in blocks:
            norms, dropouts = sequence_parallel_parts(root, block, covered[block])
            tp_plan.update({norm: SequenceParallel(use_local_output=True) for norm in norms})
            sharded_rng += dropouts
    if options.sequence_parallel and blocks:
        first, last = blocks[0], blocks[-1]
        ends = {first: HiddenStates(input=(Replicate(), Shard(1))),
                last: HiddenStates(input=(Replicate(), Shard(1)) if first == last else None, output=(Shard(1), Replicate()))}
        for block, style in ends.items():  # a block's own weights split per channel keep their style around it
            own = tp_plan.get(block)
            tp_plan[block] = (HeadWeights(own.names, inner=style, parts=own.parts, whole=own.whole)
                              if isinstance(own, HeadWeights) else style)
    for block, split in splits.items():  # after the blocks' own styles: they run first
        for region in split.regions:
            if region.head_inputs:
                tp_plan[block] = HeadInputs(region.head_inputs, region.heads, inner=tp_plan.get(block))
    return Plan(blocks=block_lists[0], tp_plan=tp_plan, attribute_fixes=fixes, sharded_rng_regions=sharded_rng,
                tied_parameters=tied_parameters(root))


def _several_lists_refusal(block_lists: list[list[str]]) -> str:
    lists = ", ".join(f"{parent_fqn(found[0])} ({len(found)})" for found in block_lists)
    return (
        f"policy='auto' cannot plan sequence parallelism for a model with {len(block_lists)} lists of blocks"
        f" ({lists}): the hidden states are split along the sequence entering a list's first block and gathered"
        " leaving its last, which is right only if the forward runs each list through, first block to last,"
        " before anything else reads them, and the structure does not say whether it does (a model may run two"
        " stacks in turns, or one list's blocks between another's). Train with sequence_parallel=False (tensor"
        " parallelism still splits every list), or register a policy that places the sequence splits"
        " (lightning_3d.policies.register_policy; see policies/llama.py)."
    )


def block_splits(root: nn.Module, blocks: list[str], tp: int) -> dict[str, BlockSplit]:
    """Block FQN -> its split; one trace per kind of block (class and parameter shapes)."""
    callers = _callers(root, blocks)
    by_kind: dict[tuple, BlockSplit] = {}
    splits = {}
    for block in blocks:
        module = root.get_submodule(block)
        kind = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
        if kind not in by_kind:
            by_kind[kind] = _split_one(callers, block, module, tp)
        splits[block] = by_kind[kind]
    return splits


def _callers(root: nn.Module, blocks: list[str]) -> list[tuple[str, nn.Module]]:
    """What ``training_step`` may call to run the blocks, as (FQN, meta copy): the root's children holding them
    (unless one is their list), and the root (unless it is the LightningModule, whose copy would copy its
    trainer)."""
    found = [prefix for prefix in dict.fromkeys(_model_prefix([block]) for block in blocks)
             if prefix and not isinstance(root.get_submodule(prefix), (nn.ModuleList, nn.ModuleDict))]
    if not isinstance(root, LightningModule):
        found.append("")
    return [(fqn, meta_copy(root.get_submodule(fqn))) for fqn in found]


def _split_one(callers: list[tuple[str, nn.Module]], block: str, module: nn.Module, tp: int) -> BlockSplit:
    width = next((projection_sizes(m)[0] for m in module.modules() if is_projection(m)), None)
    if width is None:
        return BlockSplit(problem="it holds no nn.Linear or Conv1D")
    why_not = []
    for fqn, model in callers:
        if fqn and not block.startswith(fqn + "."):  # another list's model
            continue
        meta_block = model.get_submodule(block[len(fqn) + 1:] if fqn else block)
        inputs = block_inputs(model, meta_block, width)
        if not isinstance(inputs, str):
            return split_block(meta_block, *inputs, tp)
        why_not.append(f"{type(model).__name__} on the meta device: {inputs}")
    # The model cannot be called: the block alone, on hidden states (and None for what else it requires).
    meta_block = meta_copy(module)
    rest = (None,) * (required_positionals(meta_block) - 1)
    split = split_block(meta_block, (torch.zeros(1, 4, width, device="meta"), *rest), {}, tp)
    if split.problem and why_not:  # the cause is the call that would have given the block its inputs
        split.problem = (f"the model's forward did not reach it ({'; '.join(why_not)}), and the block alone on"
                         f" hidden states failed ({split.problem})")
    return split


def sequence_parallel_parts(root: nn.Module, block: str, regions: list[str]) -> tuple[list[str], list[str]]:
    """The norms of ``block`` outside its tp regions (``regions``: the modules and head weights they cover), which run on
    sequence shards, and its dropout layers there, which then draw on each tp rank's own stream. Other weights
    between the regions are refused: on a sequence shard they would get the gradient of this rank's
    positions only (and might mix positions)."""
    norms, dropouts, unknown = [], [], []
    for name, module in root.get_submodule(block).named_modules():
        fqn = join_fqn(block, name)
        if any(fqn == r or fqn.startswith(r + ".") for r in regions):
            continue
        if _is_norm(module):
            norms.append(fqn)
        elif isinstance(module, nn.Dropout) and module.p > 0:
            dropouts.append(fqn)
        elif (any(f"{fqn}.{n}" not in regions for n, _ in module.named_parameters(recurse=False))
              and not any(fqn.startswith(n + ".") for n in norms)):  # (a region's head weights are in regions)
            unknown.append(f"{fqn} ({type(module).__name__})")
    if unknown:
        raise PolicyError(
            f"policy='auto' cannot keep the hidden states of {block} split along the sequence: besides the"
            f" projections it split over tp ({', '.join(regions) or 'none'}) and LayerNorm/RMSNorm layers, it"
            f" holds {', '.join(unknown)}, whose weights would see only this rank's positions. Register a policy"
            " for the model (see policies/gpt.py), or sequence_parallel=False."
        )
    return norms, dropouts


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm or RMSNorm (PyTorch's, or a model's own class of that name): each position on its own."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


# -- what was split, said once; what was not, refused -------------------------------------------------------
def sharded_share(root: nn.Module, blocks: list[str], tp_plan: dict[str, ParallelStyle]) -> tuple[int, int]:
    """(parameter elements of ``blocks`` the plan shards over tp, all of their parameter elements)."""
    sharded, _, total = _shares(root, blocks, tp_plan)
    return sharded, total


def _shares(root: nn.Module, blocks: list[str], tp_plan: dict[str, ParallelStyle]) -> tuple[int, int, int]:
    """(elements sharded over tp, elements of parts every rank keeps whole by design, all elements) of the
    parameters of ``blocks``."""
    sharded = by_design = total = 0
    for block in blocks:
        for fqn, module in root.get_submodule(block).named_modules():
            mine, designed, held = _module_shares(tp_plan, join_fqn(block, fqn), module)
            sharded, by_design, total = sharded + mine, by_design + designed, total + held
    return sharded, by_design, total


def _module_shares(tp_plan: dict[str, ParallelStyle], fqn: str, module: nn.Module) -> tuple[int, int, int]:
    """As :func:`_shares`, for the own parameters of the module ``fqn``."""
    style = tp_plan.get(fqn)
    sharded = by_design = total = 0
    for name, param in module.named_parameters(recurse=False):
        total += param.numel()
        if isinstance(style, ColumnSplit) and any(style.whole):  # its whole parts are on every rank
            split = sum(size for size, whole in zip(style.parts, style.whole) if not whole)
            sharded += param.numel() * split // sum(style.parts)
            by_design += param.numel() - param.numel() * split // sum(style.parts)
        elif isinstance(style, SummedGradients) and (is_projection(module) or style.shared_by_heads):
            by_design += param.numel()  # a low-rank feeder; a weight all heads apply
        elif (isinstance(style, ColumnSplit) or (isinstance(style, RowSplit) and name == "weight")
                or (isinstance(style, ExpertsSplit) and name != "down_proj_bias")
                or _split_from_above(tp_plan, fqn, name)):
            sharded += param.numel()
    return sharded, by_design, total


def _whole_modules(root: nn.Module, block: str, tp_plan: dict[str, ParallelStyle]) -> list[tuple[str, str, int]]:
    """(FQN relative to ``block``, class name, elements) of the modules of ``block``, not norms, whose own
    weights the plan leaves whole on every rank, largest first."""
    found = []
    for fqn, module in root.get_submodule(block).named_modules():
        sharded, by_design, total = _module_shares(tp_plan, join_fqn(block, fqn), module)
        if total - sharded - by_design and not _is_norm(module):
            found.append((fqn or "<block>", type(module).__name__, total - sharded - by_design))
    return sorted(found, key=lambda m: -m[2])


def _split_from_above(tp_plan: dict[str, ParallelStyle], module: str, name: str) -> bool:
    """Whether a ``HeadWeights`` on ``module`` or a module holding it splits its weight ``name``."""
    atoms = module.split(".")
    for i in range(len(atoms), -1, -1):
        style = tp_plan.get(".".join(atoms[:i]))
        if isinstance(style, HeadWeights) and ".".join([*atoms[i:], name]) in style.names:
            return True
    return False


def _judge(root: nn.Module, firsts: list[str], splits: dict[str, BlockSplit], tp_plan, options: PlanOptions,
           vocabulary: str) -> None:
    """Refuses the plan if it leaves too much of the blocks of every list whole, else says what it splits in
    the block each list starts with (``firsts``)."""
    blocks = list(splits)
    # k and v of fewer kv heads than ranks, kept whole on every rank, are the split's design, not a gap in it.
    sharded, by_design, total = _shares(root, blocks, tp_plan)
    whole = 1 - (sharded + by_design) / total if total else 0.0
    if whole > MAX_REPLICATED and not options.allow_replicated:
        # The message shows a block with something left whole (blocks of several kinds: dense and MoE layers).
        shown = next((b for b in blocks if splits[b].left or splits[b].problem),
                     max(blocks, key=lambda b: sum(m[2] for m in _whole_modules(root, b, tp_plan))))
        raise PolicyError(_refusal(root, [shown, *blocks], splits[shown], whole, options.tp, tp_plan))
    model = _model_name(root, blocks)
    per_block = ". ".join(f"Per block{f' of {parent_fqn(first)}' if len(firsts) > 1 else ''}:"
                          f" {_split_said(splits[first])}" for first in firsts)
    if by_design:
        per_block += (f"; kept whole on every rank by design (key/value heads fewer than the ranks, low-rank"
                      f" projections, weights all heads apply): {by_design / total:.1%}")
    rank_zero_info(f"policy='auto' splits {sharded / total if total else 0:.1%} of the block parameters of {model}"
                   f" over tp={options.tp}. {per_block}. Outside them: {vocabulary}.")


def _split_said(first: BlockSplit) -> str:
    """What ``first`` splits in each block of its kind, and what it leaves whole."""
    regions = "; ".join([_feeders_said(r) + f"{', '.join(r.columns)} -> {r.row}" + (f" ({r.heads} heads)" if r.heads else "")
                         + "".join(f", {m} inside (split by its inputs, its outputs summed"
                                   + (", each rank keeping the slice its heads read)" if m in r.owned else ")")
                                   for m in r.inner_rows)
                         + "".join(f", {c} fused {_parts_said(k, r.whole.get(c, ()))}"
                                   for c, k in r.parts.items() if len(k) > 1)
                         + "".join(f", {m or '<block>'}.{n} per {'channel' if '.' in n else 'head'}"
                                   for m, ns in r.head_weights.items() for n in ns)
                         + "".join(f", the block's {in_words(k)} cut to each rank's heads" for k in r.head_inputs)
                         for r in first.regions]
                        + [f"{e} (each expert's intermediate features)" for e in first.experts]
                        + [f"{g} (split, its output gathered)" for g in first.gathered])
    left = f"; left whole in every block: {', '.join(first.left)}" if first.left else ""
    return f"{regions or 'nothing'}{left}"


def _feeders_said(region) -> str:
    said = [f"{f} ({'split, gathered' if divides else 'whole'})" for f, divides in region.feeders.items()]
    return f"{', '.join(said)} -> " if said else ""


def _parts_said(sizes: tuple[int, ...], whole: tuple[bool, ...]) -> str:
    return "|".join(f"{size}{' (whole on every rank)' if whole and whole[i] else ''}" for i, size in enumerate(sizes))


def expert_banks(block: nn.Module, split: BlockSplit | None = None) -> list[str]:
    """The mixture-of-experts weights in ``block``, as "FQN (shape)": parameters with an expert dimension
    (transformers' ``experts.gate_up_proj`` of shape (experts, 2 x intermediate, hidden)), and lists of
    same-class modules holding projections (experts written as an ``nn.ModuleList`` of MLPs). Not the stacks
    ``split`` splits with a region's heads (RG-LRU's per-head gates)."""
    with_heads = {join_fqn(holder, name) for region in (split.regions if split else ())
                  for holder, names in region.head_weights.items() for name in names}
    found = []
    for prefix, module in block.named_modules():
        found += [f"{join_fqn(prefix, name)} {tuple(p.shape)}" for name, p in stacked_matrices(module)
                  if join_fqn(prefix, name) not in with_heads]
    for name, module in block.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1
                and any(is_projection(m) for m in module[0].modules())):
            found.append(f"{name} ({len(module)} x {type(module[0]).__name__})")
    return found


def _model_prefix(blocks: list[str]) -> str:
    """The root's child that holds the blocks ("" if they are the root's own children)."""
    return blocks[0].split(".")[0] if blocks and "." in blocks[0] else ""


def _model_name(root: nn.Module, blocks: list[str]) -> str:
    return type(root.get_submodule(_model_prefix(blocks))).__name__


def _refusal(root: nn.Module, blocks: list[str], split: BlockSplit, whole: float, tp: int,
             tp_plan: dict[str, ParallelStyle]) -> str:
    block = blocks[0] if blocks else "(no repeated blocks found)"  # the block shown
    modules = dict(root.get_submodule(blocks[0]).named_modules()) if blocks else {}
    # Experts modules stood in for while the block is traced are not why it could not be: that is said below.
    stood_in = any(is_experts(m) or is_stacked_experts(m) for m in modules.values())
    # Stacked weights are a mixture of experts' only where the block routes among them (or holds a module of
    # experts), or where the trace could not tell: Zamba's per-head Mamba weights and Zamba2's per-layer adapters
    # are not.
    experts = expert_banks(root.get_submodule(blocks[0]), split) if blocks and not split.experts and not (
        split.problem and stood_in) and (split.routed or stood_in or split.problem) else []
    if experts:
        why = "; ".join(f"{name}: {reason}" for name, reason in split.left.items()
                        if (m := modules.get(name)) is not None and (is_experts(m) or is_stacked_experts(m))) or (
            "they are not a transformers experts module (stacked gate_up_proj / down_proj, the layout"
            " use_experts_implementation describes) nor a module holding exactly a stacked up and down projection,"
            " and which tokens reach an expert is decided by the router at run time, so a trace on the meta device"
            " cannot follow them")
        return (
            f"policy='auto' does not split the mixture-of-experts blocks of {_model_name(root, blocks)} over tp: in"
            f" {block} (every block of its kind), {', '.join(experts)} hold the experts' weights, and {why}. Train it at"
            " tensor_parallel_size=1 (pipeline and data parallel apply as to any model), or write a policy that"
            " splits these weights (lightning_3d.policies.experts.ExpertsSplit for stacked ones), or pass"
            " allow_replicated=True to keep the whole block on every tp rank."
        )
    if split.problem:
        reasons = f"  the block could not be traced on the meta device: {split.problem}"
    else:
        by_reason: dict[str, list[str]] = {}
        for name, why in split.left.items():
            by_reason.setdefault(why, []).append(name)
        reasons = "\n".join(f"  {', '.join(names)}: {why}" for why, names in by_reason.items())
        if not reasons:  # no projection was left: weights in modules of other kinds
            reasons = "\n".join(f"  {fqn} ({kind}, {count:,} weights): a module that is no projection policy='auto'"
                                 " splits, outside every region" for fqn, kind, count in _whole_modules(root, block, tp_plan)[:4])
    pattern = ".".join(["*" if a.isdigit() else a for a in block.split(".")])
    return (
        f"policy='auto' would leave {whole:.0%} of the block parameters of {_model_name(root, blocks)} whole on every"
        f" tp rank at tensor_parallel_size={tp} (more than {MAX_REPLICATED:.0%}): each rank would hold and compute"
        f" them all. In {block} (every block of its kind), not split:\n{reasons}\n"
        f"Write these lines in a policy of your own (lightning_3d.policies.register_policy; see policies/gpt.py):"
        f" a tp_plan such as {{'{pattern}.<q/k/v or up>': ColumnSplit(parts=<fused parts>),"
        f" '{pattern}.<out or down>': RowSplit()}} (lightning_3d.policies.projections) with attribute_fixes for"
        " the head counts the block reshapes by; or pass allow_replicated=True to train with them whole on every"
        " tp rank; or tensor_parallel_size=1."
    )
