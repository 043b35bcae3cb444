"""A policy reads a model and says, as plain data, how to parallelize it; appliers do the work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_3d.errors import PolicyError  # noqa: F401  (the policies import it from here)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What the layout asks of a policy (plain values: a policy never sees a process group)."""

    tp: int = 1
    """Tensor-parallel size: heads, hidden and vocabulary sizes are split by it."""
    sequence_parallel: bool = False
    """Keep activations between blocks sharded along the sequence (Megatron-style SP)."""
    vocab_parallel_loss: bool = True
    """Leave the logits sharded over the vocabulary (the loss is computed on the shards) instead of gathering."""
    allow_replicated: bool = False
    """Let "auto" leave more than 10% of the block parameters whole on every tp rank (else it refuses)."""


@dataclass(kw_only=True)
class Plan:
    """How to parallelize one model. Every name is a fully qualified module name (FQN) relative to the
    LightningModule, i.e. the names ``named_modules()`` of the single-device model gives; in ``tp_plan`` a
    ``*`` stands for any one name (``"model.blocks.*.attn.q_proj"``).

    Example::

        Plan(blocks=["model.blocks.0", "model.blocks.1"],
             tp_plan={"model.blocks.*.mlp.up_proj": ColwiseParallel(), "model.blocks.*.mlp.down_proj": RowwiseParallel()})
    """

    blocks: list[str] = field(default_factory=list)
    """The repeated blocks (transformer layers) in execution order: the units pipeline stages are cut from
    and activation checkpointing wraps."""
    pipeline_root: str | None = None
    """The module whose forward the pipeline splits (the model ``training_step`` calls, e.g. "model"). Unless
    ``forward_as_written`` or ``stage_forward`` is given, its forward must skip submodules that are None and
    blocks that are missing (see ``models.GPT``)."""
    before: list[str] = field(default_factory=list)
    """Modules that run before the first block (embeddings): only the first pipeline stage keeps them."""
    after: list[str] = field(default_factory=list)
    """Modules that run after the last block (final norm, output head): only the last stage keeps them."""
    tp_plan: dict[str, ParallelStyle] = field(default_factory=dict)
    """FQN pattern -> PyTorch ``ParallelStyle`` (column-/row-wise, sequence parallel, prepare input/output),
    applied on the "tp" sub-mesh by ``parallelize_module``. Empty when tp == 1."""
    attribute_fixes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """FQN -> {attribute: value on each tp rank}, for modules that keep sizes the split changes (heads per
    rank, hidden size per rank)."""
    sharded_rng_regions: list[str] = field(default_factory=list)
    """FQN patterns of modules that draw random numbers (dropout) on tp-sharded data: they draw from a
    stream private to each tp rank (see ``lightning_3d.parallel.rng``); everything else from the default
    stream, equal on every tp rank."""
    checkpoint_names: dict[str, str] = field(default_factory=dict)
    """For ``init_from`` checkpoints whose names differ from the model's: state-dict key prefix -> the
    checkpoint's prefix (``{"model.blocks.": "transformer.h."}``); the longest matching prefix applies."""
    tied_parameters: list[tuple[str, str]] = field(default_factory=list)
    """Pairs of parameter FQNs that are one tensor in the single-device model (an input embedding tied to
    the output head). Kept one tensor after tensor parallelism; when pipeline parallelism puts the two on
    different stages, each holds a copy and their gradients are summed across the two stages every step
    (as Megatron-LM does), so the copies stay equal."""
    stage_forward: Callable[..., Any] | None = None
    """How one pipeline stage runs, written by hand for a model whose forward cannot skip the modules a stage
    does not hold (``forward_as_written`` runs such a forward unchanged instead). Called as
    ``stage_forward(stage, *inputs, **kwargs)``: ``stage`` is the copy of the pipeline root that holds this
    stage's modules (the others are None, or a ``DroppedBlock`` inside a ModuleList); the inputs are the
    arguments of the user's model call on the first stage and the previous stage's outputs elsewhere.
    Returns a tensor or a tuple of tensors. None: the root's own forward."""
    forward_as_written: bool = False
    """Each pipeline stage runs the pipeline root's own, unchanged forward (``lightning_3d.pipeline.as_written``):
    other stages' blocks pass their input through, their embeddings and head are shells without parameters.
    What "auto" plans for a model it has no policy for, and what the Hugging Face policies use;
    ``stage_forward`` is then not used."""
    init_module: Callable[[nn.Module], None] | None = None
    """Initializes one module's own parameters and buffers in place, for the modules of a model built on the
    meta device that have no ``reset_parameters()`` (Hugging Face models: their ``_init_weights``); see
    ``lightning_3d.parallel.weight_init``."""
    experts: list[str] = field(default_factory=list)
    """FQNs of the mixture-of-experts layers' experts modules (transformers' stacked experts,
    ``lightning_3d.policies.experts.is_dispatched_experts``), which expert parallelism splits by expert over "ep"
    (``lightning_3d.parallel.expert_parallel``). What "auto" finds by structure; empty: no experts to split."""
    stage_output: Callable[[Any], Any] | None = None
    """What the user's step receives as the model's output on the last stage, built from that stage's
    tensor (e.g. an object with ``.logits``). None: the tensor itself."""


class Policy:
    """Base class: subclass, implement :meth:`plan`, and register it with :func:`register_policy`.

    ``model_classes`` names (``module.QualName``) the model classes the policy was written for; the "auto"
    policy picks a registered policy by them. A policy never talks to a process group.

    Example::

        @register_policy("my_net")
        class MyNetPolicy(Policy):
            model_classes = ("my_pkg.models.MyNet",)

            def plan(self, root, options=PlanOptions()):
                prefix = find_submodule(root, self.model_classes)
                layers = root.get_submodule(prefix).layers
                tp_plan = {f"{prefix}.layers.*.fc1": ColwiseParallel(), f"{prefix}.layers.*.fc2": RowwiseParallel()}
                return Plan(blocks=[f"{prefix}.layers.{i}" for i in range(len(layers))],
                            tp_plan=tp_plan if options.tp > 1 else {})
    """

    name: str = ""
    model_classes: tuple[str, ...] = ()

    def plan(self, root: nn.Module, options: PlanOptions = PlanOptions()) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} must implement plan(root, options) -> Plan")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def class_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def find_submodule(root: nn.Module, classes: tuple[str, ...]) -> str | None:
    """The FQN of the first submodule of ``root`` (itself included, as "") whose class path is in ``classes``."""
    for fqn, module in root.named_modules():
        if class_path(module) in classes:
            return fqn
    return None

