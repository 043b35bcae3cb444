"""``ThreeDStrategy``: Lightning's glue around the parallel layout, the policy and the appliers."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint.pretrained import check_init_from, load_pretrained
from lightning_3d.output import quiet_ranks
from lightning_3d.parallel.clip import clip_grad_norm_, clip_grad_value_
from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.data_parallel import apply_data_parallel, zero_stage_that_runs
from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.parallel.init_record import ConstructionRecord, ModuleAttributes
from lightning_3d.parallel.memory import memory_report, step_gradient_bytes, summarize_memory
from lightning_3d.parallel.parallelize import prepare_model
from lightning_3d.parallel.precision import (
    check_precision, mixed_precision_policy, offload_backend, offload_policy, warn_about_no_ops)
from lightning_3d.parallel.rng import ShardedRNG, preserved_random_state
from lightning_3d.parallel.shape_check import check_shapes_at_first_call
from lightning_3d.parallel.tied import TiedGradients, embedding_group
from lightning_3d.parallel.weight_init import InitError, is_on_meta
from lightning_3d.pipeline.engine import PipelineEngine
from lightning_3d.pipeline.split import assign_blocks, check_splittable, held_modules, split_options, stage_ids_of
from lightning_3d.policies import Policy, resolve_policy
from lightning_3d.policies.auto_pipeline import with_pipeline
from lightning_3d.policies.base import Plan, PlanOptions
from lightning_3d.strategies.checkpoints import ShardedCheckpoints
from lightning_3d.strategies.checks import check_backend, check_model
from lightning_3d.strategies.faults import TIMEOUTS, FaultHandling
from lightning_3d.strategies.processes import ProcessesAndCollectives
from lightning_3d.strategies.steps import StepHooks
from lightning_3d.strategies.threads import set_threads_per_rank

log = logging.getLogger(__name__)


class ThreeDStrategy(ProcessesAndCollectives, ShardedCheckpoints, FaultHandling, StepHooks, ParallelStrategy):
    """Train one LightningModule with tensor (tp), pipeline (pp) and data (dp) parallelism at once.

    The LightningModule is written as for one device; the strategy builds the ("pp", "dp", "tp") device mesh,
    asks the policy how to cut the model, applies the parallel layers and initializes the weights so that
    every layout starts from the same full model (see ``lightning_3d.parallel.weight_init``).

    Example::

        import lightning as L
        from lightning_3d import ThreeDStrategy

        strategy = ThreeDStrategy(data_parallel_size=2)
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2).fit(module, datamodule)
        # or, after `import lightning_3d`: L.Trainer(strategy="3d", devices=2)

    Arguments are those of :class:`~lightning_3d.parallel.config.ParallelConfig` (each documented there),
    plus Lightning's plumbing (accelerator, devices, cluster environment, checkpoint IO, precision plugin),
    ``process_group_backend`` ("gloo" on CPU, "nccl" on CUDA by default) and the collective ``timeout``,
    and the fault watch (``lightning_3d.faults``), which times each phase of a run under its own limit, in
    seconds (None: no limit), and when one is passed ends the job with every rank's report of the phase and
    what it waits in: ``hang_timeout`` for a step and the time between two steps (training, validation,
    ...); ``setup_timeout`` for the set-up before the first step (configure_model, sharding and
    initialization, ``init_from``, restoring a checkpoint and skipping to its batch); ``checkpoint_timeout``
    for loading or saving a checkpoint. When a rank raises, every other rank is stopped within
    ``exit_timeout`` seconds.
    """

    strategy_name = "3d"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        policy: Any = "auto",
        pipeline_schedule: str = "1f1b",
        num_microbatches: Optional[int] = None,
        pipeline_split: Union[str, list[list[str]]] = "blocks",
        virtual_pipeline_size: int = 1,
        sequence_parallel: bool = False,
        zero_stage: int = 0,
        pipeline_reduce_grads: str = "per_step",
        activation_checkpointing: Optional[str] = None,
        offload: bool = False,
        init_from: Optional[str] = None,
        model_init: str = "auto",
        vocab_parallel_loss: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        hang_timeout: Optional[float] = 900.0,
        setup_timeout: Optional[float] = None,
        checkpoint_timeout: Optional[float] = None,
        exit_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Value checks run here, in the launching process, before any rank exists.
        self.parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            policy=policy,
            pipeline_schedule=pipeline_schedule,
            num_microbatches=num_microbatches,
            pipeline_split=pipeline_split,
            virtual_pipeline_size=virtual_pipeline_size,
            sequence_parallel=sequence_parallel,
            zero_stage=zero_stage,
            pipeline_reduce_grads=pipeline_reduce_grads,
            activation_checkpointing=activation_checkpointing,
            offload=offload,
            init_from=init_from,
            model_init=model_init,
            vocab_parallel_loss=vocab_parallel_loss,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._fault_timeouts = dict(zip(TIMEOUTS, (hang_timeout, setup_timeout, checkpoint_timeout)))
        for name, seconds in {**self._fault_timeouts, "exit_timeout": exit_timeout}.items():
            if seconds is not None and seconds <= 0:
                off = "" if name == "exit_timeout" else " (None turns the hang watchdog off for its phase)"
                raise ValueError(f"{name} ({seconds}) is in seconds and must be positive{off}.")
        self._exit_timeout = exit_timeout
        self.num_nodes = 1
        self._parallel_dims: Optional[ParallelDims] = None
        self._device_mesh = None
        self._policy: Optional[Policy] = None
        self._init_rng_state: Optional[Tensor] = None
        self._construction: Optional[ConstructionRecord] = None  # the meta build, watched (parallel.init_record)
        self._before_build: Optional[ModuleAttributes] = None  # the LightningModule before configure_model()
        self._prepared_module: Optional[nn.Module] = None
        self._blocks: list[nn.Module] = []
        self._engine: Optional[PipelineEngine] = None  # pipeline parallel only
        self._tied_gradients: Optional[TiedGradients] = None  # tied weights across pipeline stages only
        self._sharded_rng: Optional[ShardedRNG] = None  # tensor parallel only; checkpoints save its state
        self._rank_state_to_load: Optional[dict] = None  # random generators from a checkpoint of this layout
        self._memory_logged = False
        self._model_plan: Optional[Plan] = None  # the policy's plan for the module (names for init_from)
        self._gradient_sync = True  # False inside block_backward_sync (accumulation micro-steps)
        # Lightning routes training_step through DDP's forward with this (as its DDPStrategy does).
        self._forward_redirection = _DDPForwardRedirection()

    # ------------------------------------------------------------------ layout

    @property
    def parallel_dims(self) -> ParallelDims:
        """Resolved sizes (dp, pp, tp) of this run; available once the processes are set up."""
        if self._parallel_dims is None:
            raise RuntimeError("The parallel layout is known once the strategy has set up its environment.")
        return self._parallel_dims

    @property
    def device_mesh(self):
        """The ("pp", "dp", "tp") ``DeviceMesh``; ``device_mesh["tp"]`` is this rank's tensor-parallel sub-mesh."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the strategy has set up its environment.")
        return self._device_mesh

    @property
    def coords(self) -> RankCoords:
        """This rank's (dp, pp, tp) coordinates."""
        return self.parallel_dims.coords(self.global_rank)

    @property
    def pipeline_engine(self) -> Optional[PipelineEngine]:
        """The micro-batch engine once set up under pipeline parallelism (callbacks read what it records)."""
        return self._engine

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Lightning's connector reads this for third-party strategies: it then injects a distributed sampler,
        # configured by distributed_sampler_kwargs.
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Only data-parallel ranks see different data; the tp and pp ranks of one replica share its batch.
        return {"num_replicas": self.parallel_dims.dp, "rank": self.coords.dp}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Weights only exist after setup() has materialized them (the model may be on the meta device before).
        return True

    # ------------------------------------------------------------------ processes

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        quiet_ranks()  # known third-party warnings off, Lightning's per-rank set-up lines from rank 0 (output.py)
        set_threads_per_rank(self.num_processes)  # ranks on one host share its CPUs (strategies/threads.py)
        # Every check that a user can fail runs here, identically on every rank, before the first collective.
        self._parallel_dims = ParallelDims.from_config(self.parallel_config, self.world_size)
        if self.parallel_config.init_from:
            check_init_from(self.parallel_config.init_from)
        check_precision(self.precision_plugin, self.root_device, self._parallel_dims, self.parallel_config)
        warn_about_no_ops(self.parallel_config, self._parallel_dims, self.root_device)
        self._policy = resolve_policy(self.parallel_config.policy)
        check_model(self.lightning_module, self.parallel_config)

        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        check_backend(backend, self.root_device)
        self._process_group_backend = offload_backend(self.parallel_config, self.root_device, backend)
        self._init_process_group()  # strategies/processes.py
        self._start_fault_watch(self._exit_timeout)
        self._device_mesh = self._parallel_dims.build_mesh(self.root_device.type)
        # LightningModule.device_mesh reads this attribute; Lightning has no public setter for it.
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(f"lightning_3d: {self._parallel_dims}, policy={self._policy.name or self._policy!r}")
        zero = self.parallel_config.zero_stage
        runs, why = zero_stage_that_runs(zero, self._parallel_dims.pp > 1)
        if runs != zero and self._parallel_dims.dp > 1:  # (dp = 1: warn_about_no_ops says zero does nothing)
            rank_zero_info(f"lightning_3d: zero_stage={zero} runs as ZeRO-{runs}: {why}"
                           " (lightning_3d.parallel.data_parallel.apply_zero)")

    # ------------------------------------------------------------------ model

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # A model built in configure_model() goes on the meta device unless the user asked for an exact build;
        # the host random state is kept so that setup() can replay the init from it.
        # The build is watched (ConstructionRecord) so that setup() uses the meta route only where replaying
        # the init is proven to give these weights, and can otherwise build again, as written, from here.
        on_meta = self.parallel_config.model_init != "exact" and empty_init is not False
        self._init_rng_state = torch.get_rng_state()
        self._construction = ConstructionRecord() if on_meta else None
        module = self.lightning_module
        self._before_build = ModuleAttributes(module) if on_meta and module is not None else None
        with (torch.device("meta") if on_meta else nullcontext(), self.precision_plugin.tensor_init_context(),
              self._construction or nullcontext()):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        first_setup = self._prepared_module is not module  # setup() runs again for validate()/test() after fit()
        if first_setup:
            with self._phase("set-up: preparing the model", "setup_timeout"):
                self._prepare(module)
            check_shapes_at_first_call(module, self._model_plan, self.parallel_dims, self.coords)  # at each block's 1st call
        self.model = self._data_parallel(module) if self._engine is None else module
        if self._engine is not None:  # when its stages reduce gradients over dp (lightning_3d.pipeline.grad_sync)
            self._engine.reduce_grads_per_microbatch = self.parallel_config.pipeline_reduce_grads == "per_microbatch"
        if first_setup and self.parallel_config.init_from:  # each rank reads its slices (a resumed fit then
            plan = self._model_plan                           # restores over them)
            with self._phase("set-up: loading init_from", "setup_timeout"):
                load_pretrained(module, self.parallel_config.init_from, plan.checkpoint_names,
                                plan.tied_parameters)
        # Lightning clips in the precision plugin; under tp/pp a rank holds shards and one stage, so
        # torch.nn.utils' local norm is wrong (or fails on mixed DTensors). The plugin has no hook for the
        # norm, so its two clip methods are replaced on this instance with global-norm ones.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
        self.precision_plugin.clip_grad_by_value = self._clip_grad_by_value
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _prepare(self, module: pl.LightningModule) -> None:
        dims, config = self.parallel_dims, self.parallel_config
        plan = self._model_plan = self._plan(module)
        reset_order = None
        record, self._construction = self._construction, None
        if record is not None and is_on_meta(module):
            why = record.verdict(module, plan.init_module, params_loaded=config.init_from is not None)
            if why is None:
                reset_order = record.reset_order(module)
            else:
                self._build_as_written(module, why)
                plan = self._model_plan = self._plan(module)
        stage_blocks, stage_ids = None, []
        if dims.pp > 1:
            if not module.automatic_optimization:
                raise ParallelConfigError(
                    "pipeline_parallel_size > 1 runs backward inside the pipeline schedule, which manual"
                    " optimization (self.manual_backward) cannot drive. Use automatic optimization, or pp=1."
                )
            check_splittable(module, plan)
            stage_blocks = assign_blocks(plan.blocks, dims.pp * config.virtual_pipeline_size,
                                         **split_options(module, plan, config.pipeline_split))
            stage_ids = stage_ids_of(self.coords.pp, dims.pp, config.virtual_pipeline_size)
        init, stages, self._sharded_rng, tied_copies = prepare_model(module, plan, self.device_mesh, self.root_device,
                                                        self._init_rng_state, stage_blocks, stage_ids,
                                                        config.activation_checkpointing,
                                                        params_loaded=config.init_from is not None,
                                                        reset_order=reset_order)
        rank_zero_info(f"lightning_3d: model_init={init!r} (see lightning_3d.parallel.weight_init)")
        self.precision_plugin.convert_module(module)
        self._blocks = list(held_modules(module, plan.blocks).values())  # this rank's blocks: DP units
        if stages:
            rank_zero_info(f"lightning_3d: pipeline of {len(stage_blocks)} stages, blocks per stage"
                           f" {[len(b) for b in stage_blocks]}, schedule {config.pipeline_schedule!r},"
                           f" {self._num_microbatches} micro-batches")
            self._engine = PipelineEngine(
                module=module, root_name=plan.pipeline_root, num_stages=len(stage_blocks),
                stages={i: self._data_parallel(stage) for i, stage in zip(stage_ids, stages)},
                schedule=config.pipeline_schedule, num_microbatches=self._num_microbatches,
                pp_group=self.device_mesh["pp"].get_group(), device=self.root_device,
                last_stage_rank=dims.rank(self.coords._replace(pp=dims.pp - 1)),
                loss_context=self._loss_context,
                random_state=partial(preserved_random_state, self._sharded_rng, self.root_device),
                stage_output=plan.stage_output, dp_group=self.device_mesh["dp"].get_group(),
            )
        if dims.pp > 1 and plan.tied_parameters:  # the embedding and the head on the first and last stages
            self._tied_gradients = TiedGradients(module, tied_copies, embedding_group(dims, self.coords))
        self._prepared_module = module

    def _build_as_written(self, module: pl.LightningModule, why: str) -> None:
        """The meta build cannot be initialized by replay (``why``): refuse under model_init="meta"; under
        "auto", run configure_model() again on the host, from the attributes and random state it started
        with, so the model gets the weights it was written to have (the exact route)."""
        fix = ("Give the modules a reset_parameters() that initializes their own tensors, or use"
               " model_init='auto' (builds on the host as written when replay cannot) or 'exact'.")
        if self.parallel_config.model_init == "meta" or self._before_build is None:
            raise InitError(f"model_init={self.parallel_config.model_init!r} builds the model on the meta device"
                            f" and replays each module's reset_parameters(), which would give other weights than"
                            f" the model as written: {why}. {fix}")
        rank_zero_info(f"lightning_3d: model_init='auto' builds the model on the host as written (exact), since"
                       f" replaying its init on the meta device would give other weights: {why}")
        self._before_build.restore(module)
        torch.set_rng_state(self._init_rng_state)
        with self.precision_plugin.module_init_context():
            module.configure_model()
        if is_on_meta(module):
            raise InitError(f"{type(module).__name__}.configure_model() built nothing new when called again from"
                            " the state it started in, so the model stays on the meta device. Use"
                            " model_init='exact', or give the modules reset_parameters() (see"
                            " lightning_3d.parallel.weight_init).")

    @property
    def _num_microbatches(self) -> int:
        return self.parallel_config.num_microbatches or self.parallel_dims.pp

    def _plan(self, module: nn.Module) -> Plan:
        return plan_model(self._policy, module, self.parallel_config, self.parallel_dims.tp)

    def _data_parallel(self, module: nn.Module) -> nn.Module:
        """DP over the module Lightning calls, or over one pipeline stage."""
        config = self.parallel_config
        # dp = 1 has nothing to replicate or shard over -- but offload still asks FSDP2 to keep parameters,
        # gradients and optimizer state in host memory, which it does over one rank too (ZeRO-Offload on one GPU).
        offload_alone = config.offload and config.zero_stage > 0
        if (self.parallel_dims.dp == 1 and not offload_alone) or isinstance(module, FSDPModule):
            return module  # (an FSDPModule was sharded in place before)
        blocks = [m for m in module.modules() if m is not module and any(m is b for b in self._blocks)]
        return apply_data_parallel(module, blocks, self.device_mesh["dp"], self.root_device,
                                   pipeline_stage=self.parallel_dims.pp > 1, zero_stage=config.zero_stage,
                                   mp_policy=mixed_precision_policy(self.precision_plugin),
                                   offload_policy=offload_policy(config, self.root_device))

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val, self.parallel_dims)

    def _clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(self.precision_plugin.main_params(optimizer), clip_val)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Once, when the first optimizer step has created gradients and optimizer state: what each rank holds.
        if not self._memory_logged and self.lightning_module.trainer.global_step == 1:
            self._memory_logged = True
            report = memory_report(self.lightning_module, self.optimizers)
            if self._engine is not None and self.parallel_config.zero_stage and self.parallel_dims.dp > 1:
                # Within a step a ZeRO stage holds more than its shards (lightning_3d.pipeline.grad_sync).
                report["gradients_in_step"] = step_gradient_bytes(
                    self._engine.stages.values(), self.parallel_config.pipeline_reduce_grads == "per_microbatch")
            rank_zero_info(f"lightning_3d: {summarize_memory(report, self._describe_rank)}")

    # ------------------------------------------------------------------ registration and teardown

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="3D parallel (tensor x pipeline x data) from lightning_3d"
        )

    @override
    def teardown(self) -> None:
        self._stop_fault_watch()
        self.model = self.lightning_module  # unwrap DDP: the next fit()/validate() sets up afresh
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def plan_model(policy: Policy, module: nn.Module, config: ParallelConfig, tp: int) -> Plan:
    """The policy's plan for ``module`` under ``config`` at tensor-parallel size ``tp``, completed for a
    pipeline where it names only its blocks (``policies.auto_pipeline``). Also what the dry run shows."""
    options = PlanOptions(tp=tp, sequence_parallel=config.sequence_parallel,
                          vocab_parallel_loss=config.vocab_parallel_loss)
    return with_pipeline(module, policy.plan(module, options))
