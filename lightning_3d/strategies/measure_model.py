"""The planner's description of a model no config describes, measured on the model itself (``layout="auto"``).

For a model that is neither the reference GPT nor a Hugging Face model -- a user's own, whose blocks the policy
finds -- :func:`measured_model_spec` runs the user's ``training_step`` once, up to the model's output, on fake
tensors (``FakeTensorMode``: shapes, dtypes and the rank's device, no memory), under the run's precision, and
reads off what the planner needs (``planner.model.MeasuredCosts``):

* **parameters** per piece the pipeline places: each block, the modules before the blocks (the first stage's)
  and after them (the last stage's), split over tp where the policy's plan splits them (column- and row-parallel
  weights, column-parallel biases), a parameter tied across the two ends counted once and as the last stage's
  copy under a pipeline;
* **FLOPs** per token, of the blocks and of the rest (``torch.utils.flop_counter.FlopCounterMode``);
* **bytes saved for backward** (saved-tensor hooks), per sequence: each tensor once however often it is saved
  (a view counts its whole storage), parameters and their autocast copies left out (the planner counts those
  itself), each counted in the piece that saves it first. A block's are split in two: what tensor parallelism
  divides -- what is computed from a column-parallel layer's output up to a row-parallel layer's output -- and
  what every tp rank keeps whole;
* **sizes**: the blocks' count, the residual width (the first block's input), the vocabulary (the last
  dimension of the model's output), the largest dropout probability among its modules.

Fake tensors on the run's device take the kernels the run takes (a fused attention saves its output and
log-sum-exp, not the scores) and autocast casts as in the run; nothing is allocated, so no rank ever holds the
model. A model whose forward reads tensor values (``.item()``, a data-dependent shape) cannot run on fake
tensors: it is refused, naming that, with what to set instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from lightning_3d.errors import ParallelConfigError
from lightning_3d.planner.model import MeasuredCosts, ModelSpec, Params
from lightning_3d.policies.base import Plan
from lightning_3d.strategies.split_tracker import SplitTracker

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def measured_model_spec(module: nn.Module, plan: Plan, tp_plans: dict[int, Plan], batch: Any, *,
                        device: torch.device, precision: str) -> ModelSpec:
    """The planner's description of ``module`` (the LightningModule, its model built on meta or anywhere),
    measured. ``plan``: the policy's plan at tp = 1 (its blocks and pipeline pieces); ``tp_plans``: its plan at
    each tp size > 1 a layout may take (the smallest says which modules it splits); ``batch``: the first
    training batch; ``precision``: Lightning's precision flag of the run ("bf16-mixed" runs under autocast).
    Every rank computes the same description; no collective."""
    split_plan = tp_plans[min(tp_plans)] if tp_plans else None
    recorder, tracker = _record(module, plan, split_plan, batch, device, precision)
    saved = {(piece, split): 0 for piece in ("before", "blocks", "after") for split in (False, True)}
    for key, (piece, tensor) in recorder.saved.items():
        saved[piece, tracker.is_split(key)] += tensor.untyped_storage().nbytes()
    sequences, seq_length = _batch_shape(batch)
    tokens, layers = sequences * seq_length, len(plan.blocks)
    pieces = parameter_pieces(module, plan, split_plan)
    costs = MeasuredCosts(
        block=pieces["block"], embedding=pieces["embedding"], head=pieces["head"], tied_head=pieces["tied_head"],
        tp_sizes=(1, *sorted(tp_plans)), block_flops_per_token=recorder.flops["blocks"] / layers / tokens,
        head_flops_per_token=(recorder.flops["before"] + recorder.flops["after"]) / tokens,
        block_whole_bytes_per_sequence=saved["blocks", False] / layers / sequences,
        block_split_bytes_per_sequence=saved["blocks", True] / layers / sequences,
        first_stage_bytes_per_sequence=(saved["before", False] + saved["before", True]) / sequences,
        last_stage_bytes_per_sequence=(saved["after", False] + saved["after", True]) / sequences,
        precision=precision)
    dropout = max((m.p for m in module.modules() if isinstance(m, DROPOUTS)), default=0.0)
    return ModelSpec.from_measured(costs, num_layers=layers, hidden_size=recorder.hidden_size,
                                   vocab_size=recorder.vocab_size, seq_length=seq_length, dropout=dropout,
                                   name=type(module).__name__)


def parameter_pieces(module: nn.Module, plan: Plan, split_plan: Optional[Plan]) -> dict[str, Params]:
    """Parameters per piece: ``block`` (the mean block), ``embedding`` (the modules before the blocks, and any
    that no piece names), ``head`` (the modules after them) and ``tied_head`` (the head's parameters that are
    the embedding's too), each split where ``split_plan`` splits it. A parameter under several names counts
    once, in the first piece that holds it."""
    split = split_parameters(module, split_plan) if split_plan is not None else set()
    placed: dict[int, str] = {}
    totals = {name: Params(0, 0) for name in ("block", "embedding", "head", "tied_head")}

    def add(piece: str, param: Tensor) -> None:
        divided = id(param) in split
        totals[piece] = totals[piece] + Params(param.numel() * divided, param.numel() * (not divided))

    for piece, prefixes in (("block", plan.blocks), ("embedding", plan.before), ("head", plan.after)):
        for prefix in prefixes:
            for param in module.get_submodule(prefix).parameters():
                if id(param) in placed:
                    if piece == "head" and placed[id(param)] == "embedding":
                        add("tied_head", param)
                    continue
                placed[id(param)] = piece
                add(piece, param)
    for param in module.parameters():  # anything the pipeline places nowhere else: counted on the first stage
        if id(param) not in placed:
            placed[id(param)] = "embedding"
            add("embedding", param)
    layers = max(1, len(plan.blocks))
    mean = totals["block"]
    totals["block"] = Params(round(mean.split / layers), round(mean.replicated / layers))
    return totals


def split_parameters(module: nn.Module, plan: Plan) -> set[int]:
    """The ids of the parameters ``plan`` divides over tp: the weights (and biases) of its column-parallel
    modules, the weights of its row-parallel ones (whose biases are added after the reduction, whole)."""
    columns, rows = split_modules(module, plan)
    split = set()
    for fqn in columns | rows:
        for name, param in module.get_submodule(fqn).named_parameters(recurse=False):
            if fqn in columns or name != "bias":
                split.add(id(param))
    return split


def split_modules(module: nn.Module, plan: Plan) -> tuple[set[str], set[str]]:
    """The FQNs of the modules ``plan`` splits column-wise (their output divided over tp) and row-wise (their
    input divided, their output whole)."""
    from lightning_3d.parallel.tensor_parallel import match_modules

    columns, rows = set(), set()
    for pattern, style in plan.tp_plan.items():
        for fqn in match_modules(module, pattern):
            if isinstance(style, RowwiseParallel):
                rows.add(fqn)
            elif isinstance(style, ColwiseParallel):
                columns.add(fqn)
    return columns, rows


# ------------------------------------------------------------------------------------------ the fake run


class _Stop(Exception):
    """Raised at the model's output: the loss and the logging after it are not measured."""


class _TrainingStep(nn.Module):
    """The LightningModule's ``training_step`` as a module's forward, so ``functional_call`` can run it with fake
    parameters in place of the module's own (which stay as they are)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> Any:
        return self.module.training_step(batch, 0)


class _Recorder:
    """What one run of the model records, by piece: ``before`` the first block, in the ``blocks``, ``after`` a
    block (the final norm and head; work between blocks counts there too). FLOPs go to the piece they run in,
    a saved tensor to the piece that saves it first."""

    def __init__(self, weights: set, counter: FlopCounterMode) -> None:
        self.weights, self.counter = weights, counter
        self.hidden_size = self.vocab_size = 0
        self.flops = {"before": 0, "blocks": 0, "after": 0}
        self.saved: dict[StorageWeakRef, tuple[str, Tensor]] = {}
        """Each saved storage with its piece and a tensor that holds it (a storage freed during the run could
        lend a later one its key)."""
        self._piece, self._mark = "before", 0

    def enter(self, piece: str) -> None:
        total = self.counter.get_total_flops()
        self.flops[self._piece] += total - self._mark  # the FLOPs since the last change belong to the piece ending
        self._piece, self._mark = piece, total

    def pack(self, tensor: Tensor) -> Tensor:
        key = StorageWeakRef(tensor.untyped_storage())
        if key not in self.saved and key not in self.weights and not _copy_of_weight(tensor, self.weights):
            self.saved[key] = (self._piece, tensor)
        return tensor

    def hooks(self, module: nn.Module, plan: Plan) -> list[Any]:
        """Hooks that follow the pieces, take the residual width from the first block's input and the vocabulary
        from the output module's output, and stop the run there; their handles."""
        blocks = [module.get_submodule(name) for name in plan.blocks]
        handles = [blocks[0].register_forward_pre_hook(self._first_block, with_kwargs=True)]
        for block in blocks:
            handles.append(block.register_forward_pre_hook(lambda *_: self.enter("blocks")))
            handles.append(block.register_forward_hook(lambda *_: self.enter("after")))
        handles.append(module.get_submodule(_output_name(plan)).register_forward_hook(self._stop))
        return handles

    def _first_block(self, _module, args, kwargs) -> None:
        hidden = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.is_floating_point()),
                      None)
        self.hidden_size = self.hidden_size or (int(hidden.shape[-1]) if hidden is not None else 0)

    def _stop(self, _module, _args, output) -> None:
        out = next((t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.ndim >= 2), None)
        self.vocab_size = int(out.shape[-1]) if out is not None else 0
        raise _Stop


def _record(module: nn.Module, plan: Plan, split_plan: Optional[Plan], batch: Any, device: torch.device,
            precision: str) -> tuple[_Recorder, SplitTracker]:
    """The training step up to the model's output on fake tensors, recorded (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    step = _TrainingStep(module)
    fake_mode = FakeTensorMode()
    with fake_mode:
        values = _fake_state(step, device)
        fake_batch = tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=device)
                              if isinstance(v, Tensor) else v, batch)
    counter = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    recorder = _Recorder({StorageWeakRef(v.untyped_storage()) for v in values.values()}, counter)
    tracker = SplitTracker()
    handles = recorder.hooks(module, plan)
    if split_plan is not None:
        handles += tracker.watch(module, *split_modules(module, split_plan))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    stopped = False
    try:
        with fake_mode, counter, tracker, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), \
                autocast:
            functional_call(step, values, (fake_batch,), strict=False)
    except _Stop:
        stopped = True
    except Exception as error:  # the user's forward, on fake tensors: any error is the measurement's to report
        raise ParallelConfigError(
            f"layout='auto' measures {type(module).__name__}'s model on fake tensors (it is neither the reference"
            f" GPT nor a Hugging Face model, whose sizes the planner reads from their config), and its"
            f" training_step failed there: {type(error).__name__}: {error}. A forward that reads tensor values"
            " (.item(), data-dependent shapes) cannot be measured: set the layout (tensor_parallel_size,"
            " pipeline_parallel_size, ...) explicitly.") from error
    finally:
        for handle in handles:
            handle.remove()
    if not stopped or not recorder.hidden_size or not recorder.vocab_size:
        raise ParallelConfigError(
            f"layout='auto' measures {type(module).__name__}'s model by running training_step up to the model's"
            " output, but training_step did not call the model's blocks and then its output module"
            f" ({_output_name(plan)!r}) with a tensor (batch, sequence, ...). Set the layout explicitly.")
    recorder.enter("after")
    return recorder, tracker


def _fake_state(step: nn.Module, device: torch.device) -> dict[str, Tensor]:
    """A fake tensor for every parameter and buffer of ``step`` under each of its names (a tied parameter is
    one fake tensor under both), on ``device``, with the parameter's dtype and ``requires_grad``."""
    fakes: dict[int, Tensor] = {}
    values = {}
    for name, tensor in [*step.named_parameters(remove_duplicate=False), *step.named_buffers(remove_duplicate=False)]:
        if id(tensor) not in fakes:
            fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            fakes[id(tensor)] = fake.requires_grad_(tensor.requires_grad)
        values[name] = fakes[id(tensor)]
    return values


def _copy_of_weight(tensor: Tensor, weights: set) -> bool:
    """Whether ``tensor`` is a parameter seen through copies and views (autocast's cast, a transpose, a
    reshape): its autograd history is a chain of such ops back to a parameter."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in _COPIES_AND_VIEWS:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
    return variable is not None and StorageWeakRef(variable.untyped_storage()) in weights


_COPIES_AND_VIEWS = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0",
                               "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0",
                               "AliasBackward0", "CloneBackward0"})
"""The autograd nodes of ops that copy or view a tensor whole (the names autograd gives their backward)."""


def _output_name(plan: Plan) -> str:
    """The module whose output is the model's: the pipeline root, else the last module after the blocks, else
    the last block."""
    return plan.pipeline_root or (plan.after[-1] if plan.after else plan.blocks[-1])


def _batch_shape(batch: Any) -> tuple[int, int]:
    """(sequences, tokens per sequence) of the batch's first tensor of two or more dimensions."""
    tensor = next((t for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.ndim >= 2), None)
    if tensor is None:
        raise ParallelConfigError("layout='auto' reads the batch size and sequence length from the first training"
                                  " batch, but it holds no tensor of (batch, sequence, ...).")
    return int(tensor.shape[0]), int(tensor.shape[1])


def _sdpa_flops(query_shape, key_shape, value_shape, *_args, out_shape=None, **_kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops}
"""FLOP formulas for kernels ``FlopCounterMode`` has none for: the CPU's fused attention (its CUDA kernels
have theirs), counted as any attention's two products."""
