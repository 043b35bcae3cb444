"""The "auto" policy: a registered policy when a known model class is inside, else one found by structure.

For an unknown model, inside each repeated block (the longest list of same-class layers):

* **attention** -- a module with separate query/key/value/output ``nn.Linear`` children, by their usual names
  (``q_proj/k_proj/v_proj/o_proj``, ``q/k/v/o``, ``query/key/value/out``, ``wq/wk/wv/wo``, ``out_proj``; or,
  for the output, the one other ``nn.Linear``, such as nanoGPT's ``c_proj``):
  q, k, v column-wise (heads split over tp), output row-wise. Its integer head-count and width attributes
  (``HEAD_ATTRIBUTES``: ``num_heads``, ``n_heads``, ``n_kv_heads``, ``embed_dim``, ...) are divided by tp, since
  such modules often reshape by them; per-head sizes (``head_dim``) stay. A module that reshapes by a count
  under another name would then attend over parts of heads without any error: that is refused, found by
  running it on the meta device (``policies.head_check``).
* **MLP** -- a module whose ``nn.Linear`` children are widening ones (``C -> H``: up, gate) and exactly one
  narrowing one (``H -> C``): the widening ones column-wise, the narrowing one row-wise.

Everything else -- embeddings, the output head, norms, a fused qkv projection -- stays replicated, and one
warning names the weight-holding modules left that way.

**Sequence parallelism** (``sequence_parallel=True``): between the attention and MLP the hidden states stay
split along the sequence, as in the reference GPT's policy: the LayerNorm/RMSNorm layers of each block
outside those two run on sequence shards, each region gathers its input and its row-wise layer
reduce-scatters its output. The residual stream is split entering the first block and gathered leaving the
last (so the final norm and the head, whatever they are, see every position). A block that holds other
weights between the regions is refused: they could mix positions. Parameter-free code there (a token shift)
cannot be seen, so it must act on each position alone.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_3d.errors import LayoutError
from lightning_3d.common import join_fqn
from lightning_3d.policies.base import Plan, PlanOptions, Policy, PolicyError, find_submodule
from lightning_3d.policies.head_check import check_heads_stay_whole
from lightning_3d.policies.hidden_states import HiddenStates
from lightning_3d.policies.registry import register_policy, registered_policies

log = logging.getLogger(__name__)

ATTENTION_NAMES = [
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("q", "k", "v", "o"),
    ("query", "key", "value", "out"),
    ("wq", "wk", "wv", "wo"),
]
# Head counts and widths an attention module may reshape by, as model codebases name them: Hugging Face
# (num_heads, num_attention_heads, num_key_value_heads, num_kv_heads, embed_dim, hidden_size; BERT's
# all_head_size, T5's inner_dim), nanoGPT (n_head, n_embd), Meta's Llama reference and torchtitan (n_heads,
# n_kv_heads, n_local_heads, n_local_kv_heads). Per-head sizes (head_dim, head_size) and ratios (n_rep,
# num_key_value_groups) are the same on every rank and stay.
HEAD_ATTRIBUTES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
                   "n_kv_head", "n_kv_heads", "n_local_heads", "n_local_kv_heads", "embed_dim", "hidden_size",
                   "n_embd", "all_head_size", "inner_dim")


@register_policy("auto")
class AutoPolicy(Policy):
    """Delegates to the registered policy whose ``model_classes`` the model contains; otherwise plans by
    structure (see the module docstring)."""

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        policy = self.known_policy(root)
        if policy is not None:
            log.info("policy='auto' uses policy=%r for %s", policy.name, type(root).__name__)
            return policy.plan(root, options)
        blocks = repeated_blocks(root)
        if not blocks:
            log.warning(
                "policy='auto' found no repeated blocks in %s. Register a policy"
                " (lightning_3d.policies.register_policy) to name them.", type(root).__name__,
            )
        if options.tp == 1:
            return Plan(blocks=blocks)
        return structural_tp_plan(root, blocks, options.tp, options.sequence_parallel)

    @staticmethod
    def known_policy(root: nn.Module) -> Policy | None:
        for cls in registered_policies().values():
            if cls.model_classes and find_submodule(root, cls.model_classes) is not None:
                return cls()
        return None


def repeated_blocks(root: nn.Module) -> list[str]:
    """FQNs of the children of the longest ``ModuleList``/``ModuleDict``/``Sequential`` whose children share
    one class and hold parameters (transformer layers, in every model we know)."""
    best: list[str] = []
    for fqn, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(module) < 2:
            continue
        children = list(module.named_children())
        same_class = len({type(child) for _, child in children}) == 1
        has_params = all(any(True for _ in child.parameters()) for _, child in children)
        if same_class and has_params and len(children) > len(best):
            best = [join_fqn(fqn, name) for name, _ in children]
    return best


def structural_tp_plan(root: nn.Module, blocks: list[str], tp: int, sequence_parallel: bool = False) -> Plan:
    # Between the regions (attention, MLP) the hidden states are whole on every tp rank, or with sequence
    # parallelism split along the sequence (dim 1): the row-wise layers then reduce-scatter instead of
    # all-reduce, and the regions all-gather their input.
    between = Shard(1) if sequence_parallel else Replicate()
    tp_plan: dict[str, ParallelStyle] = {}
    fixes: dict[str, dict[str, int]] = {}
    sharded_rng: list[str] = []
    checked: set[type] = set()
    for block in blocks:
        regions = []
        for name, module in root.get_submodule(block).named_modules():
            fqn = join_fqn(block, name)
            attention = _attention_styles(module, between)
            styles = attention or _mlp_styles(module, between)
            if styles is None:
                continue
            regions.append(fqn)
            # The region's input becomes a replicated DTensor inside it: one gradient reduction for all of
            # its column-wise layers, at the boundary. Only the hidden states: other inputs (a mask, a rotary
            # table) pass as they are.
            tp_plan[fqn] = HiddenStates(input=(between, Replicate()), use_local_output=False)
            tp_plan.update({join_fqn(fqn, child): style for child, style in styles.items()})
            if attention:
                fixes[fqn] = _per_rank_sizes(module, tp)
                if type(module) not in checked:  # one of each class: the blocks repeat it
                    checked.add(type(module))
                    check_heads_stay_whole(module, fqn, attention, fixes[fqn], tp)
        if sequence_parallel:
            norms, dropouts = sequence_parallel_parts(root, block, regions)
            tp_plan.update({norm: SequenceParallel(use_local_output=True) for norm in norms})
            sharded_rng += dropouts
    if sequence_parallel and blocks:
        # The residual stream is cut along the sequence entering the first block (a local slice) and
        # gathered leaving the last, so whatever runs after the blocks (final norm, head) sees every position.
        first, last = blocks[0], blocks[-1]
        tp_plan[first] = HiddenStates(input=(Replicate(), Shard(1)))
        tp_plan[last] = HiddenStates(input=(Replicate(), Shard(1)) if first == last else None,
                                     output=(Shard(1), Replicate()))
    _warn_replicated(root, tp_plan)
    return Plan(blocks=blocks, tp_plan=tp_plan, attribute_fixes=fixes, sharded_rng_regions=sharded_rng)


def sequence_parallel_parts(root: nn.Module, block: str, regions: list[str]) -> tuple[list[str], list[str]]:
    """The norms of ``block`` outside its tp regions, which run on sequence shards, and its dropout layers
    there, which then draw on each tp rank's own stream. Other weights between the regions are refused: on a
    sequence shard they would get the gradient of this rank's positions only (and might mix positions)."""
    norms, dropouts, unknown = [], [], []
    for name, module in root.get_submodule(block).named_modules():
        fqn = join_fqn(block, name)
        if any(fqn == r or fqn.startswith(r + ".") for r in regions):
            continue
        if _is_norm(module):
            norms.append(fqn)
        elif isinstance(module, nn.Dropout) and module.p > 0:
            dropouts.append(fqn)
        elif any(True for _ in module.parameters(recurse=False)) and not any(fqn.startswith(n + ".") for n in norms):
            unknown.append(f"{fqn} ({type(module).__name__})")
    if unknown:
        found = ", ".join(regions) or "none"
        raise PolicyError(
            f"policy='auto' cannot keep the hidden states of {block} split along the sequence: besides the"
            f" attention and MLP it split over tp ({found}) and LayerNorm/RMSNorm layers, it holds {', '.join(unknown)},"
            " whose weights would see only this rank's positions. Register a policy for the model (see"
            " policies/gpt.py), or sequence_parallel=False."
        )
    return norms, dropouts


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm or RMSNorm (PyTorch's, or a model's own class of that name): each position on its own."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def _per_rank_sizes(attention: nn.Module, tp: int) -> dict[str, int]:
    sizes = {a: getattr(attention, a) for a in HEAD_ATTRIBUTES if type(getattr(attention, a, None)) is int}
    uneven = {a: v for a, v in sizes.items() if v % tp}
    if uneven:
        raise LayoutError(f"{type(attention).__name__}: {uneven} are not divisible by tensor_parallel_size ({tp});"
                          " heads are split whole across tp ranks.")
    return {a: v // tp for a, v in sizes.items()}


def _linear_children(module: nn.Module) -> dict[str, nn.Linear]:
    return {name: child for name, child in module.named_children() if isinstance(child, nn.Linear)}


def _attention_styles(module: nn.Module, output: Placement) -> dict[str, ParallelStyle] | None:
    linears = _linear_children(module)
    for q, k, v, o in ATTENTION_NAMES:
        if all(name in linears for name in (q, k, v)):
            rest = [name for name in linears if name not in (q, k, v)]
            # The output projection by its usual name, or the one other Linear (nanoGPT's c_proj).
            o = o if o in linears else (rest[0] if len(rest) == 1 else None)
            if o is not None:
                return {q: ColwiseParallel(), k: ColwiseParallel(), v: ColwiseParallel(),
                        o: RowwiseParallel(output_layouts=output)}
    return None


def _mlp_styles(module: nn.Module, output: Placement) -> dict[str, ParallelStyle] | None:
    linears = _linear_children(module)
    if len(linears) < 2 or len(linears) != sum(1 for _ in module.children()) - _activations(module):
        return None
    narrowing = [n for n, l in linears.items() if l.in_features > l.out_features]
    widening = [n for n, l in linears.items() if l.in_features < l.out_features]
    if len(narrowing) != 1 or len(widening) + 1 != len(linears):
        return None
    hidden = linears[narrowing[0]].in_features
    if any(linears[n].out_features != hidden for n in widening):
        return None
    return {**{n: ColwiseParallel() for n in widening}, narrowing[0]: RowwiseParallel(output_layouts=output)}


def _activations(module: nn.Module) -> int:
    """Children without parameters (activations, dropout) that may sit between an MLP's Linears."""
    return sum(1 for child in module.children() if not any(True for _ in child.parameters()))


def _warn_replicated(root: nn.Module, tp_plan: dict[str, ParallelStyle]) -> None:
    left = [fqn for fqn, module in root.named_modules()
            if isinstance(module, (nn.Linear, nn.Embedding)) and fqn not in tp_plan]
    if left:
        log.warning("policy='auto' keeps these layers replicated on every tp rank: %s", ", ".join(left))
