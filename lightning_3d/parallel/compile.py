"""``torch.compile`` per block: each transformer block this rank holds runs as one compiled graph.

Where it sits in ``parallelize``'s chain, and why there (torchtitan's order): after tensor parallelism and
activation checkpointing, so the graph is traced over the block as it will run (DTensor shards, its
collectives as functional ops inductor can schedule); before data parallelism, so FSDP2's and DDP's hooks stay
outside the graph and work as they do in eager mode. Under the pipeline it runs after the split, so each rank
compiles only its own stages' blocks.

Per block, not the whole model: the blocks of a model are one class with the same shapes, so dynamo traces
the first and every other block reuses its graph (parameters are graph inputs, not constants), and a
compile costs one block's time, however deep the model. Only ``forward`` is compiled (an instance attribute
in front of the class's): the module's hooks -- activation checkpointing's, the shape check's, data
parallel's -- run around the graph, and the parameter names (FQNs) stay the single-device ones, where
wrapping in ``OptimizedModule`` would add ``_orig_mod.``.

A block that dynamo cannot trace as one graph (``fullgraph=True``: a graph break, or an op it refuses) does
not end the run: every block of the rank then runs eagerly, with one warning naming the first graph break.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, is_in_torch_dispatch_mode

from lightning_3d.pipeline.split import held_modules
from lightning_3d.policies.base import Plan

# Lightning's info lines go to this logger (rank_zero_info is it, gated on rank 0); the compile report is
# logged on every rank, as every rank compiles its own blocks.
_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")


def apply_compile(module: nn.Module, plan: Plan, rank: int) -> CompileReport:
    """Compile the forward of each of the plan's blocks that ``module`` holds (in place), and log the report
    of this rank's compiles after the first optimizer step (by then forward and backward are compiled).

    Example (what ``parallelize`` does with ``compile=True``)::

        apply_compile(module, plan, rank)  # after TP and AC, before data parallel
    """
    blocks = list(held_modules(module, plan.blocks).values())
    report = CompileReport(rank=rank, blocks=len(blocks), codes=len({type(b).forward.__code__ for b in blocks}))
    converted = _hidden_states_converted_inside(plan)
    if converted is not None:
        report.run_eagerly(
            f"under tensor parallelism the plan converts hidden states between DTensor and local tensors inside"
            f" the block ({converted}: policy='auto' splitting a model by its structure), which PyTorch 2.13's"
            " compiled backward does not take (seen with Phi-3: \"'Tensor' object has no attribute"
            " '_local_tensor'\" in the first backward)")
    # Random operators as eager ATen calls, drawing from whichever stream is current (parallel/rng.py): the
    # tp-rank stream of a sharded region is switched in inside the graph, which inductor's own random numbers,
    # seeded once per graph, would not see. The random operators then run unfused, as they do in eager mode.
    options = {"fallback_random": True} if plan.sharded_rng_regions else None
    for block in blocks:
        block.forward = CompiledForward(block, report, options)
    report.log_after_first_step()
    return report


def _hidden_states_converted_inside(plan: Plan) -> str | None:
    """The first module inside a block whose tp style is ``HiddenStates`` (the structural plan's), or None."""
    from lightning_3d.policies.hidden_states import HiddenStates

    for name, style in plan.tp_plan.items():
        if isinstance(style, HiddenStates) and any(name.startswith(block + ".") for block in plan.blocks):
            return name
    return None


@dataclass
class CompileReport:
    """One rank's compiles: what one log line says, and whether the rank fell back to eager."""

    rank: int
    blocks: int
    """Blocks this rank compiled."""
    codes: int
    """Distinct ``forward`` functions among them: the graphs a compile without recompiles traces."""
    eager_because: str | None = None
    """Why the rank's blocks run eagerly (the first graph break, or what set-up saw); None while compiled."""
    broke: bool = False
    """The rank fell back on a graph break (fullgraph raised it: dynamo's counters miss that one)."""
    _start: dict[str, float] = field(default_factory=lambda: _compile_counters(), init=False, repr=False)

    def fall_back(self, error: TorchDynamoException) -> None:
        """Every block of the rank runs eagerly from now on: warn once, naming the first graph break."""
        self.eager_because, self.broke = _describe_break(error), True
        warnings.warn(f"lightning_3d: torch.compile could not compile a block on rank {self.rank} as one graph:"
                      f" {self.eager_because}. Every block of this rank runs eagerly instead (compile=True has"
                      " no effect). Remove the graph break from the block's forward, or set compile=False.")

    def run_eagerly(self, why: str) -> None:
        """Every block of the rank runs eagerly, decided before any compile: warn once, saying why."""
        self.eager_because = why
        warnings.warn(f"lightning_3d: torch.compile could not compile the blocks on rank {self.rank}: {why}. They"
                      " run eagerly instead (compile=True has no effect here; it does at tp=1, and under tp with"
                      " the registered policies).")

    def line(self) -> str:
        """The rank's one log line: graphs, graph breaks, recompiles and compile time."""
        now = _compile_counters()
        delta = {key: now[key] - self._start.get(key, 0.0) for key in now}
        graphs = int(delta["graphs"])
        breaks = int(delta["graph_breaks"]) + self.broke  # fullgraph raised the first one
        state = f"eager fallback ({self.eager_because})" if self.eager_because else "compiled"
        return (f"lightning_3d: torch.compile on rank {self.rank}: {self.blocks} blocks {state}, {graphs} graphs,"
                f" {breaks} graph breaks, {max(0, graphs - self.codes)} recompiles,"
                f" compile time {delta['forward_s']:.1f} s forward + {delta['backward_s']:.1f} s backward")

    def log_after_first_step(self) -> None:
        """Log :meth:`line` once, after the next optimizer step of this process (a global hook). A hook that has
        logged is removed when the next report registers, not from inside the step: the step is iterating the
        global hooks then, and removing one ends that iteration with "OrderedDict mutated during iteration"."""
        while _LOGGED:
            _LOGGED.pop().remove()

        def once(*_: Any) -> None:
            if handle not in _LOGGED:
                _LOGGED.append(handle)
                _log.info(self.line())

        handle = register_optimizer_step_post_hook(once)


_LOGGED: list[Any] = []
"""The global hooks of :meth:`CompileReport.log_after_first_step` that have logged, to remove at the next one."""


OBSERVES_ONLY = "lightning_3d_observes_only"
"""A dispatch mode's class attribute: True where the mode only watches the operators (CommTimer's recorder),
so a compiled block may run compiled under it."""


class CompiledForward:
    """A block's forward, compiled as one graph on its first call; its eager self once the rank fell back.

    It compiles the class's ``forward`` and passes the block in, rather than the bound method: a deep copy of
    the block (an EMA of the weights) then gets a forward over its own parameters, not over the original's."""

    def __init__(self, block: nn.Module, report: CompileReport, options: dict[str, Any] | None = None) -> None:
        self.block = block
        self.eager = type(block).forward
        self.compiled = torch.compile(self.eager, fullgraph=True, options=options)
        self.report = report

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Eager under a dispatch mode too: a mode traces or counts ops (the shape check's fake tensors, a FLOP
        # counter), and dynamo, which leaves its own infrastructure's modes (fake tensors) on, would run the
        # compiled kernels on tensors that have no data. Except under modes that only observe and declare
        # ``ignore_compile_internals()`` (CommTimer's recorder): dynamo compiles with them off and runs the
        # compiled code with them on, where they see the operators the compiled code still dispatches.
        # (FakeTensorMode declares it too, but computes: the compiled kernels would read no data.)
        modes = _get_current_dispatch_mode_stack() if is_in_torch_dispatch_mode() else []
        if self.report.eager_because is not None or not all(
                getattr(mode, OBSERVES_ONLY, False) and mode.ignore_compile_internals() for mode in modes):
            return self.eager(self.block, *args, **kwargs)
        try:
            return self.compiled(self.block, *args, **kwargs)
        except TorchDynamoException as error:  # raised while tracing or compiling: nothing of the block ran
            self.report.fall_back(error)
            return self.eager(self.block, *args, **kwargs)


def _compile_counters() -> dict[str, float]:
    """This process's compile counters so far. PyTorch keeps them in ``torch._dynamo.utils`` (what
    ``TORCH_LOGS`` and the compile-time report read); it has no public accessor for them yet."""
    seconds = dynamo_utils.cumulative_time_spent_ns
    return {"graphs": dynamo_utils.counters["stats"]["unique_graphs"],
            "graph_breaks": sum(dynamo_utils.counters["graph_break"].values()),
            "forward_s": seconds.get("entire_frame_compile", 0.0) / 1e9,
            "backward_s": seconds.get("entire_backward_compile", 0.0) / 1e9}


def _describe_break(error: TorchDynamoException) -> str:
    """The graph break as dynamo states it (its first line) and the line of the user's code it stopped at."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    frame = getattr(error, "innermost_user_frame_summary", None)  # a traceback.FrameSummary, set by dynamo
    return f"{first} at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else first
