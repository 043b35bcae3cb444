"""Every private name of torch and Lightning that lightning_3d uses: why, and what public API would replace it.

Private names change without notice between releases, so ``pyproject.toml`` bounds torch and lightning to
the minor versions these were checked on (torch 2.13, lightning 2.6). ``tests/unit/test_private_apis.py`` reads
the package's source and fails on a private name that is missing here, and on one listed here that the
source no longer uses; an upgrade starts by going through this list.

Keys: a name reached through an import is its dotted path, and covers every name under it
(``"torch.utils._pytree"`` covers ``tree_flatten``). A private *attribute of an object* is written as
``owner class + attribute``, with ``attribute=True``: the source does not say the object's class, so the
test matches these by the attribute's name. Attributes of other libraries' objects (torchmetrics,
transformers, numpy) are listed too, for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Private:
    why: str
    """What lightning_3d needs it for."""
    instead: str
    """The public API that would replace it, or why there is none yet (torch 2.13, lightning 2.6)."""
    attribute: bool = False
    """An attribute read, set or overridden on an object, rather than a name imported from a module."""


_NO_HOOK = "no public hook"

PRIVATE_NAMES: dict[str, Private] = {
    # ------------------------------------------------------------------ torch: imported
    "torch.utils._pytree": Private(
        "flatten and rebuild nested batches, step outputs and model call arguments (pipeline engine, callbacks)",
        "torch 2.13 ships no public pytree module; the optree package would be one more dependency"),
    "torch.distributed._functional_collectives": Private(
        "expert parallelism sends tokens to their experts' ranks and back with an all-to-all whose backward is the"
        " reverse all-to-all (all_to_all_single); a router's load-balancing loss gathers its logits with an"
        " all-gather whose backward sums the gradients back (all_gather_single)",
        "torch.distributed.nn.functional's autograd-aware collectives are deprecated in torch 2.13 and name these"
        " as their replacement"),
    "torch.utils._python_dispatch.is_in_torch_dispatch_mode": Private(
        "compile=True runs a block eagerly under a dispatch mode (fake tensors of the shape check, a FLOP"
        " counter): compiled kernels would run on tensors without data",
        "none in torch 2.13"),
    "torch.utils._python_dispatch._get_current_dispatch_mode_stack": Private(
        "compile=True: whether every dispatch mode on the stack declares ignore_compile_internals() (CommTimer's"
        " recorder), under which a block runs compiled", "none in torch 2.13"),
    "torch._dynamo.utils": Private(
        "compile=True's one log line per rank: graphs, graph breaks and compile time (counters,"
        " cumulative_time_spent_ns)", "none in torch 2.13: TORCH_LOGS prints them, no API returns them"),
    "torch._dynamo.exc.TorchDynamoException": Private(
        "compile=True falls back to eager on what dynamo raises while tracing or compiling a block, and only on"
        " that", "none in torch 2.13: torch.compile's errors have no public base class"),
    "torch.utils._python_dispatch.TorchDispatchMode": Private(
        "see each collective after DTensor has lowered it (CommRecorder, the pipeline's step checks); follow which"
        " tensors tensor parallelism would split, op by op, when layout='auto' measures a model (SplitTracker)",
        "torch.overrides.TorchFunctionMode is public but sees DTensor calls before their collectives exist"),
    "torch._subclasses.fake_tensor": Private(
        "run a block on fake tensors to check its shapes before the first step, without computing it; measure a"
        " model's FLOPs and saved tensors on the run's device and precision for layout='auto' (measure_model)",
        "no public fake-tensor mode; the meta device would need a meta copy of each block"),
    "torch._C.DisableTorchFunctionSubclass": Private(
        "run a call on vocabulary-sharded logits as on any DTensor from their own __torch_function__ (sharded_logits)",
        "what torch.Tensor.__torch_function__ itself uses; calling that instead converts every result to the subclass"),
    "torch._foreach_norm": Private(
        "the global gradient norm: one multi-tensor norm per (device, dtype) group of local pieces, not a kernel"
        " per parameter (clip.grad_square_terms); NaNGuard's check of a stage's gradients, an L1 norm per"
        " gradient from one call per (device, dtype) (grad_checks._sums_of)",
        "torch.nn.utils.get_total_norm does this, but returns the norm in the gradients' dtype and takes no"
        " per-group divisor (the copies of a replicated piece)"),
    "torch._foreach_mul_": Private(
        "clipping: scale every local gradient of a (device, dtype) group in one multi-tensor kernel (clip.py)",
        "torch.nn.utils.clip_grads_with_norm_ does this, but reads param.grad (DTensors here, not their local"
        " pieces)"),
    "torch._ops.HigherOrderOperator": Private(
        "let higher-order operators (checkpoint, cond) pass through the dispatch mode untouched",
        "no public name for the class"),
    "torch.distributed._composable.replicate_with_fsdp": Private(
        "data parallel without sharding that composes with TP and pipeline stages (FSDP2's machinery)",
        "DistributedDataParallel wraps the module (names gain 'module.') and is not built for DTensors"),
    "torch.distributed._composable.checkpoint_activation.checkpoint": Private(
        "activation checkpointing that keeps parameter names (a wrapper module would rename them)",
        "torch.utils.checkpoint.checkpoint needs a wrapper around each block, which changes FQNs"),
    "torch.distributed.distributed_c10d._get_default_store": Private(
        "the fault watch talks through the default process group's key-value store",
        "no public accessor; keeping our own TCPStore would mean building the process group by hand"),
    "torch.distributed.distributed_c10d._resolve_process_group": Private(
        "CommRecorder turns the group name of a functional collective into its ranks",
        "no public lookup from group name to group"),
    "torch.distributed.pipelining._backward.stage_backward": Private(
        "GradSyncStage runs a stage's backward itself to reduce gradients per micro-batch",
        "no public backward step of a pipeline stage"),
    "torch.distributed.pipelining._backward.stage_backward_input": Private(
        "layout='auto' times a block's backward split as zero bubble splits it"
        " (calibrate.zero_bubble_split_seconds_per_token)",
        "no public split backward; the schedule calls these two itself"),
    "torch.distributed.pipelining._backward.stage_backward_weight": Private(
        "the weights' half of that split backward, timed with it",
        "no public split backward; the schedule calls these two itself"),
    "torch.distributed.tensor.placement_types._StridedShard": Private(
        "fused projections (GPT-2's and nanoGPT's q|k|v, Phi-3's gate|up): each tp rank takes its slice of every part",
        "Shard(dim) cannot express a strided slice; no public placement for it"),
    "torch.utils._device._device_constructors": Private(
        "send the factory functions to the meta device while recording a build, as torch.device('meta') does,"
        " but unseen by Hugging Face's test for a meta context (which skips its init)",
        "torch.device('meta') as a context manager, which Hugging Face detects"),
    # ------------------------------------------------------------------ torch: attributes
    "torch.distributed.device_mesh.DeviceMesh._flatten": Private(
        "HSDP: the (dp_replicate, dp_shard) pair flattened back into the \"dp\" dimension every other user reads"
        " (as torchtitan does)",
        "none in torch 2.13: DeviceMesh has no public way to name a merged dimension", attribute=True),
    "torch.distributed.device_mesh.DeviceMesh._pg_registry": Private(
        "the calibration's own tp meshes hand their destroyed process groups over: the mesh holds them by name,"
        " and DTensor's caches hold the mesh, so a destroyed gloo group kept its threads for the run",
        "none in torch 2.13: DeviceMesh has no public way to be destroyed with its groups", attribute=True),
    "torch.distributed.tensor.parallel.ParallelStyle._apply": Private(
        "the method a custom tensor-parallel style implements (the torch docs' way to write one)",
        "ParallelStyle's only (abstract) method; no public name", attribute=True),
    "torch.distributed.tensor.parallel.ColwiseParallel._prepare_input_fn": Private(
        "the projection and kv-head styles reuse ColwiseParallel's / RowwiseParallel's input redistribution",
        "copying their code instead", attribute=True),
    "torch.distributed.tensor.parallel.SequenceParallel._prepare_input_fn": Private(
        "OnSplitFeatures cuts every input of the first one's shape (a gated norm's gate) with SequenceParallel's"
        " own input conversion, overriding the hook that passes on the first input only",
        _NO_HOOK + ": SequenceParallel converts the first input alone"),
    "torch.distributed.tensor.parallel.ColwiseParallel._partition_linear_fn": Private(
        "replicated kv heads override how a linear layer's weight is split", "copying its code instead",
        attribute=True),
    "torch.distributed.pipelining.PipelineStage._forward_metadata_inference": Private(
        "run the stage's shape inference without drawing random numbers (resumed dropout runs match)",
        _NO_HOOK + " around the inference", attribute=True),
    "torch.distributed.pipelining.PipelineStage._to_tensor": Private(
        "zeros, not uninitialized memory, for the tensors a later stage infers on (index-valid inputs)",
        _NO_HOOK, attribute=True),
    "torch.distributed.pipelining.PipelineStage._post_metadata_inference_cleanup": Private(
        "keep gradients accumulated so far through an evaluation step's inference", _NO_HOOK, attribute=True),
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._state_ctx": Private(
        "end an accumulation micro-step's backward that ran outside FSDP2's autograd hooks (grad_sync.py)",
        "FSDP2 has no public call to finish a backward it did not see", attribute=True),
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups": Private(
        "as _state_ctx: each group's post-backward; NaNGuard's look at the gradient sums FSDP2 holds apart"
        " (pipeline.grad_sync.gradients_held_apart)", "as _state_ctx", attribute=True),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._module_info": Private(
        "which module and parameter name a gradient sum FSDP2 holds apart (unsharded_accumulated_grad, under a"
        " reduce dtype other than the parameters') belongs to, for NaNGuard to name it before the reduction",
        "none in torch 2.13: FSDP2 exposes neither its accumulated gradients nor their parameters", attribute=True),
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._root_post_backward_final_callback": Private(
        "as _state_ctx: the root's end-of-backward work", "as _state_ctx", attribute=True),
    "torch.nn.Module._parameters": Private(
        "swap a block's tensors for fake ones and back, in place (shape check); read a module's own tensors in"
        " NaNGuard's per-forward hook, where named_parameters(recurse=False) costs more than the check",
        "register_parameter cannot replace in place without hooks firing", attribute=True),
    "torch.nn.Module._buffers": Private("as _parameters, for buffers", "as _parameters", attribute=True),
    "torch._ops.OpOverload._schema": Private(
        "which arguments an aten op writes, and whether it draws random numbers (a generator argument), to"
        " replay a recorded build op by op", "no public view of an op's schema", attribute=True),
    "torch.UntypedStorage._cdata": Private(
        "identify a tensor's storage, meta tensors included, while recording the model's construction",
        "data_ptr() is 0 for every meta or empty storage", attribute=True),
    "torch.ScriptObject._type": Private(
        "recognize a ProcessGroup argument of a c10d op by its class name (CommRecorder)", "no public accessor",
        attribute=True),
    **{f"torch.ops.aten.{op}": Private(
        "an ATen operator the block trace (policies.block_trace) follows feature indices through; ATen names"
        " these ops with a leading underscore, and a dispatch mode sees them, not their public wrappers",
        "none: a TorchDispatchMode sees ATen operators by these names", attribute=True)
       for op in ("_unsafe_view", "_softmax", "_log_softmax", "_to_copy", "_fused_rms_norm")},
    "torch.ops.aten._local_scalar_dense": Private(
        "the operator behind .item() and bool(tensor): MetaValues (policies.meta_values) answers it from a host"
        " twin when a forward on the meta device reads a value", "none: a TorchDispatchMode sees ATen operators",
        attribute=True),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": Private(
        "count the FLOPs of the CPU's fused attention when layout='auto' measures a model (measure_model):"
        " FlopCounterMode has formulas for the CUDA kernels only", "none: FlopCounterMode's custom formulas are"
        " keyed by the ATen operator, which ATen names with a leading underscore"),
    # ------------------------------------------------------------------ Lightning: imported
    "lightning.fabric.strategies._StrategyRegistry": Private(
        "the type of register_strategies' argument, as Lightning's own strategies annotate it",
        "only the instance (lightning.pytorch.strategies.StrategyRegistry) is public"),
    "lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device": Private(
        "the backend Lightning's strategies pick by default (nccl on CUDA, else gloo)",
        "a one-line rule we could keep ourselves; kept to pick exactly what Lightning picks"),
    "lightning.fabric.utilities.distributed._init_dist_connection": Private(
        "create the process group from the cluster environment (torchrun, Slurm, Lightning's launcher)",
        "torch.distributed.init_process_group plus the environment's address and port, by hand"),
    "lightning.fabric.utilities.optimizer._optimizers_to_device": Private(
        "move optimizer state to the device after a restore, as Lightning's strategies do",
        "no public function"),
    "lightning.pytorch.strategies.ddp._DDPForwardRedirection": Private(
        "run training_step through the wrapped model so FSDP2 / replicate hooks fire", "no public class"),
    "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher": Private(
        "start devices=N processes when no torchrun or Slurm did, as Lightning's DDP does", "no public class"),
    # ------------------------------------------------------------------ Lightning: attributes
    "lightning.pytorch.strategies.Strategy._configure_launcher": Private(
        "the hook where a strategy sets its launcher (self._launcher)", "Lightning's strategies override it too",
        attribute=True),
    "lightning.pytorch.strategies.Strategy._launcher": Private(
        "set by _configure_launcher; read by the Trainer", "as _configure_launcher", attribute=True),
    "lightning.pytorch.strategies.Strategy._forward_redirection": Private(
        "where Lightning's strategies keep their forward redirection (_DDPForwardRedirection here)", _NO_HOOK,
        attribute=True),
    "lightning.pytorch.loops.fit_loop._FitLoop._data_source": Private(
        "read the first training batch at set-up, for layout='auto' (the batch size and sequence length)",
        "no public call returns the training loader before the fit loop sets it up", attribute=True),
    "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop._broadcast_sigterm_tensor": Private(
        "replaced for the fit by the strategy's SIGTERM check, which broadcasts a host flag over gloo one batch"
        " ahead instead of a device tensor and .item() before every batch (strategies/stop_signal.py)",
        "none in lightning 2.6 (an open pull request, #21640, adds a Trainer argument to check less often)",
        attribute=True),
    "lightning.pytorch.Trainer._signal_connector": Private(
        "the SIGTERM flag (received_sigterm) that the strategy's SIGTERM handler sets, and Lightning's handler"
        " that it stands in for during the fit (strategies/stop_signal.py)", _NO_HOOK, attribute=True),
    "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector._sigterm_notifier_fn": Private(
        "Lightning's SIGTERM handler, swapped out of its composed handlers during the fit: it broadcasts on the"
        " default group from inside the handler, a collective the other ranks do not match",
        "none in lightning 2.6", attribute=True),
    "lightning.pytorch.LightningModule._device_mesh": Private(
        "what LightningModule.device_mesh returns; the strategy sets it",
        "no public setter (Lightning's ModelParallelStrategy sets it the same way)", attribute=True),
    "lightning.pytorch.cli.LightningCLI._run_subcommand": Private(
        "the CLI's fit --dry_run stops before the Trainer runs", _NO_HOOK + " between parsing and running",
        attribute=True),
    "lightning.pytorch.callbacks.RichProgressBar._get_train_description": Private(
        "the progress bar counts steps, not batches of the epoch", _NO_HOOK, attribute=True),
    # ------------------------------------------------------------------ other libraries: attributes
    "torchmetrics.Metric._update_count": Private(
        "carry a torchmetrics object's state across the pipeline's micro-batches (pipeline/step_metrics.py)",
        "torchmetrics has no public way to merge states of one step's micro-batches", attribute=True),
    "torchmetrics.Metric._forward_cache": Private("as _update_count", "as _update_count", attribute=True),
    "torchmetrics.Metric._computed": Private("as _update_count", "as _update_count", attribute=True),
    "torchmetrics.Metric._to_sync": Private("as _update_count", "as _update_count", attribute=True),
    "torchmetrics.Metric._copy_state_dict": Private("as _update_count", "as _update_count", attribute=True),
    "torchmetrics.Metric._reduce_states": Private("as _update_count", "as _update_count", attribute=True),
    "transformers.PreTrainedModel._init_weights": Private(
        "initialize Hugging Face modules that have no reset_parameters(), on the meta route",
        "transformers' post_init() initializes the whole model, not one module", attribute=True),
    "numpy._core.multiarray._reconstruct": Private(
        "allowed by the safe unpickler: numpy arrays in checkpoints are rebuilt through it",
        "pickle names it; there is nothing else to allow", attribute=True),
}
