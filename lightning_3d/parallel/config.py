"""What the user asked for: the parallel layout and features, validated before any process talks to another."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional, Union

from lightning_3d.common import MULTI_STAGE_SCHEDULES, PIPELINE_SCHEDULES, is_positive_int
from lightning_3d.errors import ParallelConfigError

ZERO_STAGES = (0, 1, 2, 3)
ACTIVATION_CHECKPOINTING = (None, "full", "selective")
MODEL_INIT = ("auto", "exact", "meta", "fast")
AUTO_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_schedule", "num_microbatches", "zero_stage",
               "activation_checkpointing")
"""The settings ``layout="auto"`` decides at launch (``lightning_3d.strategies.auto_layout``); each may also be
"auto" alone, the others fixed."""
_DEFAULTS_OF_AUTO = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "pipeline_schedule": "1f1b",
                     "num_microbatches": None, "zero_stage": 0, "activation_checkpointing": None}
PIPELINE_REDUCE_GRADS = ("per_step", "per_microbatch")
REDUCE_DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True)
class ParallelConfig:
    """The settings of one 3D run, as given to :class:`~lightning_3d.ThreeDStrategy`.

    Plain values only (strings for policies), so LightningCLI and YAML can carry it. Value checks happen here;
    checks against the world size happen in :meth:`ParallelDims.from_config`, once the launcher has started
    the processes.

    Example::

        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)  # dp = world // 4
    """

    tensor_parallel_size: Union[int, Literal["auto"]] = 1
    """Ranks that split each layer's matrices (the "tp" mesh dimension, innermost: keep it within a node)."""
    pipeline_parallel_size: Union[int, Literal["auto"]] = 1
    """Ranks that hold consecutive groups of layers (the "pp" mesh dimension, outermost)."""
    data_parallel_size: Union[int, Literal["auto"]] = "auto"
    """Model replicas or shards that see different data; "auto" takes world // (tp * pp * cp)."""
    context_parallel_size: int = 1
    """Ranks that split each sequence (the "cp" mesh dimension, between "dp" and "tp"): each keeps two chunks of
    every sequence from the first block to the last, and attention reads the keys and values of all of them
    (``lightning_3d.parallel.context_parallel``)."""
    expert_parallel_size: int = 1
    """Ranks that split every mixture-of-experts layer's experts among themselves (the "ep" mesh dimension): each
    holds 1/ep of the experts, and tokens travel to their experts' ranks and back by all-to-all. Borrowed from the
    data-parallel ranks, as torchtitan does: it must divide dp, and adds no ranks
    (``lightning_3d.parallel.expert_parallel``)."""
    policy: Any = "auto"
    """How to parallelize the model: a registered name, a ``Policy`` instance or a dotted class path."""
    pipeline_schedule: str = "1f1b"
    """Micro-batch schedule under pipeline parallelism: one of ``PIPELINE_SCHEDULES``."""
    num_microbatches: Union[int, None, Literal["auto"]] = None
    """Micro-batches per step under pipeline parallelism; None takes pp (the fewest that fill the pipeline)."""
    pipeline_split: Union[str, list[list[str]]] = "blocks"
    """How blocks are cut into stages: "blocks" (even by count), "params" (even by parameter count, the first
    stage's embeddings and the last stage's head included), or an explicit list of block FQNs per stage."""
    virtual_pipeline_size: int = 1
    """Model chunks per pipeline rank; above 1 only with the interleaved and zero-bubble schedules."""
    data_parallel_shard_size: Union[int, Literal["auto"]] = "auto"
    """HSDP: under ZeRO, the ranks of "dp" that shard the model among themselves ("dp_shard", consecutive ranks:
    keep it within a node); dp / data_parallel_shard_size groups of them replicate it ("dp_replicate"), and
    the gradients are reduce-scattered within a shard group, then all-reduced across replicas. "auto" shards
    over all of dp (plain FSDP). Needs zero_stage > 0."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence over "tp" (saves activation memory; needs tp > 1)."""
    zero_stage: Union[int, Literal["auto"]] = 0
    """0 replicates over "dp"; 1, 2, 3 shard optimizer state, then gradients, then parameters (FSDP2; stage 1
    runs as stage 2, see ``lightning_3d.parallel.data_parallel.apply_zero``)."""
    pipeline_reduce_grads: str = "per_step"
    """Under pipeline parallelism with ZeRO (zero_stage > 0): when a stage reduce-scatters its gradients over
    "dp". "per_step": once, after the step's last micro-batch -- the stage holds its whole gradients (not dp
    shards) from the first backward to the end of the step. "per_microbatch": each block's gradient as that
    block's backward ends, in every micro-batch -- about one block's whole gradient at a time, for
    num_microbatches times the reduce-scatter bytes (``lightning_3d.pipeline.grad_sync``)."""
    reduce_dtype: str = "float32"
    """The dtype gradients are reduced over dp in: "float32" (torchtitan's and Megatron-LM's default; under
    "bf16-true" each bf16 gradient is upcast for the reduction and the result cast back) or "bfloat16" (half the
    bytes, with bf16's rounding in every sum). Under "32-true" and "bf16-mixed" gradients are fp32 already."""
    offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory (FSDP2's CPU offload; CUDA
    only, a no-op with a warning on CPU). Needs zero_stage > 0; works at dp=1 too (FSDP2 over one rank)."""
    activation_checkpointing: str | None = None
    """Recompute activations in backward: None, "full" (every block) or "selective"."""
    init_from: str | None = None
    """Pretrained weights to start from: a safetensors file, a Hugging Face safetensors directory, a torch
    state-dict file or a lightning_3d checkpoint directory; each rank reads only its slices
    (``lightning_3d.checkpoint.pretrained``)."""
    model_init: str = "auto"
    """How full weights come to be: "exact" builds the model on the host as written; "meta" builds it on the
    meta device and replays each module's ``reset_parameters()`` per shard; "auto" takes "exact" for a model
    built in ``__init__`` and "meta" for one built in ``configure_model()`` (or "exact" where replaying the
    resets would give other weights); "fast", for the largest models, replays the build's own ops on each
    rank's device for its own pipeline stages only, each random draw seeded apart: the same weights at every
    layout and in one process under "fast", drawn from the same distributions as the build as written, but
    not its numbers (``lightning_3d.parallel.weight_init``)."""

    vocab_parallel_loss: bool = True
    """Under tp > 1, keep the logits sharded over the vocabulary and compute ``F.cross_entropy`` on the shards
    (the full logits never exist on one rank); False gathers full logits, as plain tensors, on every rank."""
    layout: Optional[Literal["auto"]] = None
    """"auto": decide every one of ``AUTO_FIELDS`` left at its default at launch, for this model, these devices
    and this batch: the strategy times one block and the links, and the planner picks the fastest layout that
    fits (``lightning_3d.strategies.auto_layout``). Any one of those fields may also be "auto" alone."""
    max_memory_per_device: Optional[int] = None
    """Bytes one rank may fill, for ``layout="auto"``: by default the device's free memory on CUDA, the host's
    available memory divided among its ranks on CPU."""
    layout_check_steps: int = 20
    """Under ``layout="auto"``: after this many optimizer steps, the measured step time (validation and checkpoint
    saves left out; per optimizer step of ``accumulate_grad_batches`` batches) is logged against the planner's
    prediction, with a warning when they differ by more than 25%."""
    allow_replicated: bool = False
    """Under tp > 1, let ``policy="auto"`` train a model of which it leaves more than 10% of the block
    parameters whole on every tp rank (by default it refuses, naming what it did not understand)."""
    compile: bool = False
    """``torch.compile`` each block after tensor parallelism and activation checkpointing and before data
    parallelism (torchtitan's order), per pipeline stage; a block that cannot compile runs eagerly, with one
    warning naming the first graph break."""
    async_checkpoint: bool = False
    """Save checkpoints with DCP's ``async_save``: training goes on while the shards are written; at most one save
    is in flight (the next waits for it, and the wait is logged)."""

    def __post_init__(self) -> None:
        _require_choice("layout", self.layout, (None, "auto"))
        if self.layout == "auto":  # every decidable field still at its default is decided at launch
            for name, default in _DEFAULTS_OF_AUTO.items():
                if getattr(self, name) == default and type(getattr(self, name)) is type(default):
                    setattr(self, name, "auto")
        if self.is_auto:
            _check_auto(self)
            return  # the rest is checked on the decided config (ParallelConfig.decided)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_size",
                     "context_parallel_size", "expert_parallel_size"):
            _require_positive_int(name, getattr(self, name))
        if self.data_parallel_size != "auto":
            _require_positive_int("data_parallel_size", self.data_parallel_size)
        if self.num_microbatches is not None:
            _require_positive_int("num_microbatches", self.num_microbatches)
        _require_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if isinstance(self.pipeline_split, str):
            _require_choice("pipeline_split", self.pipeline_split, ("blocks", "params"))
        _require_choice("zero_stage", self.zero_stage, ZERO_STAGES)
        _require_choice("activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING)
        _require_choice("model_init", self.model_init, MODEL_INIT)
        _require_choice("pipeline_reduce_grads", self.pipeline_reduce_grads, PIPELINE_REDUCE_GRADS)
        _require_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        if self.pipeline_reduce_grads == "per_microbatch":
            _check_reduce_per_microbatch(self)
        if self.virtual_pipeline_size > 1 and self.pipeline_schedule not in MULTI_STAGE_SCHEDULES:
            raise ParallelConfigError(
                f"virtual_pipeline_size={self.virtual_pipeline_size} needs an interleaved schedule, but"
                f" pipeline_schedule={self.pipeline_schedule!r}. Set pipeline_schedule='interleaved_1f1b' (or"
                " 'zero_bubble'), or virtual_pipeline_size=1."
            )
        pp, m = self.pipeline_parallel_size, self.num_microbatches
        if pp > 1 and m is not None:
            if self.pipeline_schedule == "1f1b" and m < pp:
                raise ParallelConfigError(
                    f"pipeline_schedule='1f1b' needs at least one micro-batch per stage, but num_microbatches={m}"
                    f" < pipeline_parallel_size={pp}. Set num_microbatches >= {pp} (several times pp keeps the"
                    " bubble small), or pipeline_schedule='gpipe'."
                )
            rounds = max(1, m // pp)
            if self.pipeline_schedule in MULTI_STAGE_SCHEDULES and m % rounds:
                raise ParallelConfigError(
                    f"pipeline_schedule={self.pipeline_schedule!r} runs micro-batches in rounds of"
                    f" pipeline_parallel_size={pp}; num_microbatches={m} is not a multiple of its {rounds} rounds."
                    f" Use a multiple of {pp}, e.g. num_microbatches={max(pp, m - m % pp)}."
                )
        if not isinstance(self.offload, bool):
            raise ParallelConfigError(f"offload must be True or False, got {self.offload!r}.")
        if self.offload and self.zero_stage == 0:
            raise ParallelConfigError(
                "offload=True moves the shards of FSDP2 (ZeRO) to host memory, but zero_stage=0 keeps replicas."
                " Set zero_stage=1, 2 or 3 (3 frees the most device memory), or offload=False."
            )
        if self.data_parallel_shard_size != "auto":
            _require_positive_int("data_parallel_shard_size", self.data_parallel_shard_size)
            if self.zero_stage == 0:
                raise ParallelConfigError(
                    f"data_parallel_shard_size={self.data_parallel_shard_size} shards the model (ZeRO) within groups"
                    " of that many dp ranks and replicates it across them (HSDP), but zero_stage=0 replicates it"
                    " everywhere. Set zero_stage=1, 2 or 3, or leave data_parallel_shard_size='auto'.")
        for name in ("compile", "async_checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise ParallelConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ParallelConfigError(
                "sequence_parallel=True shards activations over the tensor-parallel ranks, but"
                " tensor_parallel_size=1. Set tensor_parallel_size > 1 or sequence_parallel=False."
            )

    @property
    def auto_fields(self) -> tuple[str, ...]:
        """The fields left to the launch-time decision ("auto")."""
        return tuple(name for name in AUTO_FIELDS if getattr(self, name) == "auto")

    @property
    def is_auto(self) -> bool:
        return bool(self.auto_fields)

    def decided(self, **values: Any) -> "ParallelConfig":
        """This config with the auto fields set to ``values`` (the launch-time decision), checked as any config.

        Example::

            config.decided(tensor_parallel_size=2, pipeline_parallel_size=1, ...)
        """
        missing = [name for name in self.auto_fields if name not in values]
        if missing:
            raise ParallelConfigError(f"The layout decision left {missing} undecided.")
        fields = {**asdict(self), **values, "layout": None, "policy": self.policy}
        return ParallelConfig(**fields)

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipelined step: ``num_microbatches``, by default one per pipeline stage."""
        return self.num_microbatches or self.pipeline_parallel_size

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for hyper-parameter logging and checkpoints); a policy instance becomes its class path."""
        values = asdict(self)
        if not isinstance(self.policy, str):
            cls = self.policy if isinstance(self.policy, type) else type(self.policy)
            values["policy"] = f"{cls.__module__}.{cls.__qualname__}"
        return values


def _check_auto(config: ParallelConfig) -> None:
    """What can be checked before the decision: the fixed fields' own values, and that the rest of the config
    leaves the planner something to decide among."""
    fixed = {name: getattr(config, name) for name in AUTO_FIELDS if getattr(config, name) != "auto"}
    probe = {**_DEFAULTS_OF_AUTO, **fixed}
    ParallelConfig(**{**asdict(config), **probe, "layout": None, "policy": config.policy,
                      "data_parallel_shard_size": "auto",
                      "virtual_pipeline_size": 1 if "pipeline_schedule" in config.auto_fields else config.virtual_pipeline_size,
                      "offload": False, "pipeline_reduce_grads": "per_step", "sequence_parallel": False})
    if config.virtual_pipeline_size != 1 and "pipeline_schedule" in config.auto_fields:
        raise ParallelConfigError(
            f"virtual_pipeline_size={config.virtual_pipeline_size} with pipeline_schedule='auto': the planner picks the"
            " schedule and its chunks per rank together. Leave virtual_pipeline_size=1, or fix pipeline_schedule.")
    if config.data_parallel_shard_size != "auto" and "zero_stage" in config.auto_fields:
        raise ParallelConfigError(
            f"data_parallel_shard_size={config.data_parallel_shard_size} (HSDP) with zero_stage='auto': HSDP needs"
            " ZeRO, which the launch-time decision may leave off. Fix zero_stage (1, 2 or 3), or leave"
            " data_parallel_shard_size='auto'.")
    if config.max_memory_per_device is not None:
        _require_positive_int("max_memory_per_device", config.max_memory_per_device)
    _require_positive_int("layout_check_steps", config.layout_check_steps)


def _check_reduce_per_microbatch(config: ParallelConfig) -> None:
    if config.zero_stage == 0 or config.pipeline_parallel_size == 1:
        raise ParallelConfigError(
            f"pipeline_reduce_grads='per_microbatch' lowers the gradient memory of ZeRO under a pipeline, but"
            f" zero_stage={config.zero_stage} and pipeline_parallel_size={config.pipeline_parallel_size}: without"
            " ZeRO every rank holds whole gradients anyway, and without a pipeline FSDP2 reduces per block already."
            " Set zero_stage > 0 and pipeline_parallel_size > 1, or pipeline_reduce_grads='per_step'."
        )
    if config.pipeline_schedule == "zero_bubble":
        raise ParallelConfigError(
            "pipeline_reduce_grads='per_microbatch' needs a schedule that runs each micro-batch's backward whole;"
            " pipeline_schedule='zero_bubble' splits it into input and weight gradients. Use '1f1b', 'gpipe' or"
            " 'interleaved_1f1b', or pipeline_reduce_grads='per_step'."
        )


def _require_positive_int(name: str, value: Any) -> None:
    if not is_positive_int(value):
        raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}.")


def _require_choice(name: str, value: Any, choices: tuple) -> None:
    # `True in (0, 1)` and `1.0 in (0, 1)` hold in Python; a choice must also have the choices' type.
    if value not in choices or not any(type(value) is type(choice) for choice in choices):
        raise ParallelConfigError(f"{name}={value!r} is not supported; choose one of {choices}.")
