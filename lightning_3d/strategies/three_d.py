"""``ThreeDStrategy``: every hook Lightning calls, each delegating to one concern (see the class docstring)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.checkpoint.pretrained import check_init_from
from lightning_3d.output import quiet_ranks
from lightning_3d.parallel.clip import clip_by_global_norm
from lightning_3d.parallel.config import ParallelConfig
from lightning_3d.parallel.data_parallel import zero_stage_that_runs
from lightning_3d.parallel.dims import ParallelDims, RankCoords
from lightning_3d.parallel.memory import memory_report, step_gradient_bytes, summarize_memory
from lightning_3d.parallel.parallelize import ParallelModel, parallelize, plan_model
from lightning_3d.parallel.precision import check_precision, warn_about_no_ops
from lightning_3d.parallel.rng import rank_random_state, restore_rank_random_state
from lightning_3d.parallel.shape_check import check_shapes_at_first_call
from lightning_3d.parallel.tensor_parallel import reduce_partial_grads
from lightning_3d.pipeline.engine import PipelineEngine
from lightning_3d.policies import Policy, resolve_policy
from lightning_3d.strategies import processes
from lightning_3d.strategies.checkpoints import ShardedCheckpoints, resumable, sharding_of
from lightning_3d.strategies.checks import check_backend, check_model
from lightning_3d.strategies.faults import TIMEOUTS, RunPhases
from lightning_3d.strategies.host_allocator import keep_freed_host_memory
from lightning_3d.strategies.model_build import WatchedBuild
from lightning_3d.strategies.steps import run_step

if TYPE_CHECKING:  # layout="auto" only: a fixed layout imports none of the calibration and the planner
    from lightning_3d.strategies.auto_layout import Decision, PredictionCheck
from lightning_3d.strategies.stop_signal import StopSignal
from lightning_3d.strategies.threads import local_world_size, set_threads_per_rank


class ThreeDStrategy(ParallelStrategy):
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

    The hooks below delegate, each to one concern that takes what it works on: processes and collectives
    (``strategies/processes.py``), the parallel model (``parallel/parallelize.py``: one ordered chain), steps
    (``strategies/steps.py``), checkpoints (``strategies/checkpoints.py``), the fault watch over the run's
    phases (``strategies/faults.py``). Data flows one way: arguments -> ``ParallelConfig`` ->
    ``ParallelDims`` and the mesh (``setup_environment``) -> the policy's plan -> ``parallelize`` -> the
    ``ParallelModel`` kept here (``setup``) -> steps.

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
        tensor_parallel_size: Union[int, Literal["auto"]] = 1,
        pipeline_parallel_size: Union[int, Literal["auto"]] = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        data_parallel_shard_size: Union[int, Literal["auto"]] = "auto",
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        policy: Any = "auto",
        pipeline_schedule: str = "1f1b",
        num_microbatches: Union[int, None, Literal["auto"]] = None,
        pipeline_split: Union[str, list[list[str]]] = "blocks",
        virtual_pipeline_size: int = 1,
        sequence_parallel: bool = False,
        zero_stage: Union[int, Literal["auto"]] = 0,
        pipeline_reduce_grads: str = "per_step",
        reduce_dtype: str = "float32",
        activation_checkpointing: Optional[str] = None,
        offload: bool = False,
        init_from: Optional[str] = None,
        model_init: str = "auto",
        vocab_parallel_loss: bool = True,
        allow_replicated: bool = False,
        layout: Optional[Literal["auto"]] = None,
        max_memory_per_device: Optional[int] = None,
        layout_check_steps: int = 20,
        compile: bool = False,
        async_checkpoint: bool = False,
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
            data_parallel_shard_size=data_parallel_shard_size,
            context_parallel_size=context_parallel_size,
            expert_parallel_size=expert_parallel_size,
            policy=policy,
            pipeline_schedule=pipeline_schedule,
            num_microbatches=num_microbatches,
            pipeline_split=pipeline_split,
            virtual_pipeline_size=virtual_pipeline_size,
            sequence_parallel=sequence_parallel,
            zero_stage=zero_stage,
            pipeline_reduce_grads=pipeline_reduce_grads,
            reduce_dtype=reduce_dtype,
            activation_checkpointing=activation_checkpointing,
            offload=offload,
            init_from=init_from,
            model_init=model_init,
            vocab_parallel_loss=vocab_parallel_loss,
            allow_replicated=allow_replicated,
            layout=layout,
            max_memory_per_device=max_memory_per_device,
            layout_check_steps=layout_check_steps,
            compile=compile,
            async_checkpoint=async_checkpoint,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        # The fault watch over the run's phases, started with the process group.
        self._phases = RunPhases(dict(zip(TIMEOUTS, (hang_timeout, setup_timeout, checkpoint_timeout))), exit_timeout)
        self._checkpoints = ShardedCheckpoints(self._phases, async_save=async_checkpoint)
        self._build = WatchedBuild(model_init)  # configure_model() on the meta device, watched
        self._parallel_dims: Optional[ParallelDims] = None
        self._device_mesh = None
        self._dp_group = None
        self._policy: Optional[Policy] = None
        self._parallel: Optional[ParallelModel] = None  # set up once per LightningModule (setup)
        self._gradient_sync = True  # False inside block_backward_sync (accumulation micro-steps)
        self._memory_logged = False
        self._prediction: Optional[PredictionCheck] = None  # layout="auto": measured vs predicted step time
        self._stop_signal: Optional[StopSignal] = None  # during fit: Lightning's SIGTERM check, on the host
        self.layout_decision: Optional[Decision] = None
        """layout="auto": what was chosen, its predicted step time and memory, and the calibration it used."""
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
        return self._parallel.engine if self._parallel is not None else None

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

    # ------------------------------------------------------------------ processes and collectives

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            # About to start num_nodes * devices processes: a layout that cannot be cut from them fails here,
            # at Trainer(...), in seconds, instead of in every process started (minutes for 64 of them).
            # Under torchrun / srun the processes exist already; each checks in setup_environment. (A layout
            # left to "auto" is decided in the processes, among the ones their number allows.)
            if not self.parallel_config.is_auto:
                ParallelDims.from_config(self.parallel_config, self.num_nodes * self.num_processes)
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        quiet_ranks()  # known third-party warnings off, Lightning's per-rank set-up lines from rank 0 (output.py)
        set_threads_per_rank(self.num_processes)  # ranks on one host share its CPUs (strategies/threads.py)
        # Every check that a user can fail runs here, identically on every rank, before the first collective.
        # (Under layout="auto" the layout's own checks run once it is decided, in setup(), still before any
        # collective of the model: the decision's collectives are the strategy's own, on every rank alike.)
        config = self.parallel_config
        if config.init_from:
            check_init_from(config.init_from)
        self._policy = resolve_policy(config.policy)
        if not config.is_auto:
            self._check_layout(config)

        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        check_backend(backend, self.root_device)
        self._process_group_backend = processes.backend_for(self.root_device, backend)
        processes.init_process_group(self.cluster_environment, self._process_group_backend, self._timeout,
                                     self.root_device)
        self._phases.start(self._process_group_backend, self.global_rank, self.world_size, self._describe_rank)
        if not config.is_auto:
            self._build_mesh()

    def _check_layout(self, config: ParallelConfig) -> None:
        """The checks of a decided layout against this world, model and precision (no collective)."""
        dims = self._parallel_dims = ParallelDims.from_config(config, self.world_size)
        check_precision(self.precision_plugin, self.root_device, dims, config)
        warn_about_no_ops(config, dims, self.root_device)
        check_model(self.lightning_module, config)

    def _build_mesh(self) -> None:
        dims = self.parallel_dims
        self._device_mesh = dims.build_mesh(self.root_device.type)
        self._dp_group = self._device_mesh["dp"].get_group()  # slicing a mesh takes ~1 ms; reduce() runs per log
        # LightningModule.device_mesh reads this attribute; Lightning has no public setter for it.
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(f"lightning_3d: {dims}, policy={self._policy.name or self._policy!r}")
        zero = self.parallel_config.zero_stage
        runs, why = zero_stage_that_runs(zero, dims.pp > 1)
        if runs != zero and dims.dp > 1:  # (dp = 1: warn_about_no_ops says zero does nothing)
            rank_zero_info(f"lightning_3d: zero_stage={zero} runs as ZeRO-{runs}: {why}"
                           " (lightning_3d.parallel.data_parallel.apply_zero)")

    def _decide_layout(self, trainer: "pl.Trainer") -> None:
        """layout="auto": calibrate, let the planner choose on rank 0, and go on with the chosen config on every
        rank (``strategies/auto_layout.py``)."""
        from lightning_3d.strategies.auto_layout import PredictionCheck, decide_layout

        with self._phases.phase("set-up: choosing the layout (layout='auto')", "setup_timeout"):
            decision = decide_layout(self.parallel_config, self.lightning_module, self._policy, trainer,
                                     world_size=self.world_size, per_node=self.num_processes, device=self.root_device)
        rank_zero_info(decision.report)
        self.layout_decision = decision
        self.parallel_config = self.parallel_config.decided(**decision.values)
        self._prediction = PredictionCheck(decision.predicted_step_s, self.parallel_config.layout_check_steps,
                                           accumulate=trainer.accumulate_grad_batches)
        self._check_layout(self.parallel_config)
        self._build_mesh()

    def set_world_ranks(self) -> None:
        processes.set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_nodes,
                                  self.num_processes)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        processes.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return processes.broadcast(obj, self.root_device, src)

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        # Lightning syncs logged values (sync_dist=True) here. Every tensor- and pipeline-parallel rank of a
        # replica logs the same value (the pipeline engine replays the last stage's), so the default group is
        # the data-parallel one: over every rank, reduce_fx="sum" would count a value tp * pp times.
        if group is None and self._device_mesh is not None:
            group = self._dp_group
        return processes.reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Over every rank (ModelCheckpoint, EarlyStopping): not the data-parallel default of reduce().
        count = processes.reduce(torch.tensor(int(decision), device=self.root_device), processes.WORLD, ReduceOp.SUM)
        return bool(count == self.world_size) if all else bool(count)

    def _describe_rank(self, rank: int) -> str:
        if self._parallel_dims is None:  # layout="auto", not decided yet
            return f"rank {rank}"
        return f"rank {rank} ({', '.join(f'{k}={v}' for k, v in self.parallel_dims.named_coords(rank).items())})"

    # ------------------------------------------------------------------ model

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # configure_model() builds on the meta device unless the user asked for an exact build; the build is
        # watched so that setup() replays its init only where that gives the weights as written.
        with self._build.context(self.lightning_module, self.precision_plugin, empty_init):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._parallel_dims is None:  # layout="auto": decided now that the model exists (on meta)
            self._decide_layout(trainer)
        if self._parallel is None or self._parallel.module is not module:  # (setup() runs again for validate()
            self._parallel = self._parallelize(module)                    #  and test() after fit())
        self.model = self._parallel.called
        clip_by_global_norm(self.precision_plugin, self.parallel_dims)  # gradient_clip_val: the whole model's norm
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.root_device.type == "cpu" and keep_freed_host_memory():  # steps reuse their memory (host_allocator.py)
            rank_zero_info("lightning_3d: freed host memory stays in each rank for the next step (set"
                           " MALLOC_TRIM_THRESHOLD_ to choose otherwise)")

    def _parallelize(self, module: pl.LightningModule) -> ParallelModel:
        config, dims = self.parallel_config, self.parallel_dims
        what = "set-up: parallelizing the model" + (" and loading init_from" if config.init_from else "")
        with self._phases.phase(what, "setup_timeout"):
            plan, weights = self._build.verdict(module, lambda m: plan_model(self._policy, m, config, dims.tp),
                                                self.precision_plugin, params_loaded=config.init_from is not None,
                                                local_ranks=local_world_size(self.num_processes))
            model = parallelize(module, plan, config, dims, self.device_mesh, rank=self.global_rank,
                                device=self.root_device, precision=self.precision_plugin, weights=weights)
        check_shapes_at_first_call(module, plan, dims, self.coords)  # at each block's first call
        return model

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps

    def _step(self, method: str, args: tuple, kwargs: dict) -> Any:
        phase = method.removesuffix("_step")  # "training", "validation", ...: the hang watchdog's phase
        self._phases.step_boundary(f"{method} started", phase)  # (lightning_3d.faults), limited by hang_timeout
        output = run_step(self._parallel, method, args, kwargs, sync_grads=self._gradient_sync,
                          redirection=self._forward_redirection)
        self._phases.step_boundary(f"{method} done", phase)
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        engine = self._parallel.engine
        if engine is not None:  # the schedule ran backward inside training_step: add its gradients
            engine.add_step_grads()
            return closure_loss
        # The backward of a vocabulary-parallel cross-entropy only exists inside PyTorch's loss_parallel().
        with self._parallel.loss_context():
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.parallel_dims.tp > 1 and self._gradient_sync:
            reduce_partial_grads(self.lightning_module)
        return loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Manual optimization calls backward inside DDP's forward; DDP must be told what to reduce.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this for all but the last micro-step of gradient accumulation.
        self._gradient_sync = False
        try:
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    self.model.set_requires_gradient_sync(True)
            else:
                with super().block_backward_sync():
                    yield
        finally:
            self._gradient_sync = True

    @override
    def on_validation_start(self) -> None:
        if self._prediction is not None:  # layout="auto": validation is not part of the step it predicted
            self._prediction.pause()

    @override
    def on_validation_end(self) -> None:
        if self._prediction is not None:
            self._prediction.resume()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._prediction is not None:
            self._prediction.on_step(self.lightning_module.trainer.global_step)
        # Once, when the first optimizer step has created gradients and optimizer state: what each rank holds.
        if not self._memory_logged and self.lightning_module.trainer.global_step == 1:
            self._memory_logged = True
            report = memory_report(self.lightning_module, self.optimizers)
            engine = self._parallel.engine
            if engine is not None and self.parallel_config.zero_stage and self.parallel_dims.dp > 1:
                # Within a step a ZeRO stage holds more than its shards (lightning_3d.pipeline.grad_sync).
                report["gradients_in_step"] = step_gradient_bytes(engine.stages.values(),
                                                                  engine.reduce_grads_per_microbatch)
            rank_zero_info(f"lightning_3d: {summarize_memory(report, self._describe_rank)}")

    # ------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._checkpoints.model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("ThreeDStrategy.save_checkpoint(storage_options=...) is not supported: checkpoints are"
                            " written with torch.distributed.checkpoint, not a CheckpointIO plugin.")
        path = Path(self.broadcast(str(filepath)))  # rank 0 names the directory every rank writes into
        with self._prediction.paused() if self._prediction is not None else nullcontext():
            self._checkpoints.save(path, checkpoint, sharding_of(self.parallel_dims, self.parallel_config),
                                   rank_random_state(self._parallel.sharded_rng), self.lightning_module)

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        if self.is_global_zero:
            self._checkpoints.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return self._checkpoints.load(path, self.lightning_module, self.optimizers,
                                      sharding_of(self.parallel_dims, self.parallel_config), weights_only, self.barrier)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # a single-file checkpoint (a sharded one was loaded in load_checkpoint)
            self._checkpoints.load_full_model(self.lightning_module, checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_full_optimizers(self.lightning_module, self.optimizers, checkpoint["optimizer_states"],
                                               list(checkpoint.get("state_dict", {})))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Resumed mid-epoch, the training loader skips the batches the checkpoint had done.
        return resumable(dataloader, self.lightning_module.trainer, self._phases)

    @override
    def on_train_start(self) -> None:
        # The random streams of a checkpoint of this layout: restored here, not in load_checkpoint, because in
        # between Lightning creates the epoch's data-loader iterator, which draws from them as it did before
        # the saved steps in the interrupted run.
        state = self._checkpoints.take_rank_state()
        if state is not None:
            restore_rank_random_state(state, self._parallel.sharded_rng)
        # Lightning's SIGTERM check before each batch, without its device sync (strategies/stop_signal.py).
        self._stop_signal = StopSignal.install(self.lightning_module.trainer)

    @override
    def on_train_end(self) -> None:
        self._checkpoints.take_rank_state()  # from a load during training (NaNGuard's rollback): not a resume
        if self._stop_signal is not None:
            self._stop_signal.close()
            self._stop_signal = None

    # ------------------------------------------------------------------ registration, failure and teardown

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="3D parallel (tensor x pipeline x data) from lightning_3d"
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._phases.announce_failure(exception)
        self._checkpoints.on_failure()

    @override
    def teardown(self) -> None:
        self._checkpoints.finish()  # an asynchronous save still being written is committed first
        self._phases.stop()
        self.model = self.lightning_module  # as Lightning's strategies leave it; setup() hands over the wrapper again
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
