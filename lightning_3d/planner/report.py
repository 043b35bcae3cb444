"""The planner's result (``LayoutPlan``: ranked ``Candidate`` layouts) and how people read it: the ranked
table, a short summary of the top layouts with why the first won (for a log), and the YAML config of one
layout for ``lightning-3d fit``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lightning_3d.planner.calibration import Calibration
from lightning_3d.planner.cluster import GIB, Cluster, gib
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import MemoryEstimate, Precision
from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.time import COMPILE_ASSUMED, StepTime


@dataclass(frozen=True)
class Candidate:
    """One layout with its estimates."""

    layout: Layout
    memory: MemoryEstimate
    """At the pipeline rank that needs the most."""
    time: StepTime
    tokens_per_second: float
    mfu: float | None
    """Model FLOPs (no recompute) per second over the cluster's peak; None without a peak (CPU ranks)."""


@dataclass(frozen=True)
class LayoutPlan:
    """The ranked layouts that fit (fastest first) and the inputs they were planned for."""

    model: ModelSpec
    cluster: Cluster
    precision: Precision
    global_batch_size: int
    candidates: list[Candidate]
    considered: int
    """Layouts estimated (fitting or not)."""
    calibration: Calibration | None = None
    """The measured speeds the step times come from; None: the cluster's datasheet figures."""
    fastest_unfit: Candidate | None = None
    """The fastest layout of all, when it does not fit (faster than ``best``); None when the best is it."""

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def top(self, k: int = 3) -> list[Candidate]:
        """The ``k`` fastest layouts that fit."""
        return self.candidates[:k]

    def why(self) -> str:
        """One line: why the best layout won (:func:`why_best`), and what faster layout did not fit."""
        line = why_best(self.candidates)
        if self.fastest_unfit is not None:
            c = self.fastest_unfit
            line += (f"; the fastest of all, {c.layout.describe()} ({c.time.total:.3g} s), needs"
                     f" {c.memory.total / GIB:.3g} GiB per {self.cluster.rank_name}, over the"
                     f" {self.cluster.usable_bytes / GIB:.3g} usable")
        return line

    def summary(self, k: int = 3) -> str:
        """The top ``k`` layouts, one line each (predicted step time, memory per rank), and why the first won:
        what the strategy logs."""
        source = "calibrated on these devices" if self.calibration is not None else "datasheet speeds, not measured"
        lines = [f"{len(self.candidates)} of {self.considered} layouts fit ({source}):"]
        lines += [f"  {i}. {c.layout.describe()}: step {c.time.total:.4g} s, {c.memory.total / GIB:.3g} GiB per"
                  f" {self.cluster.rank_name}" for i, c in enumerate(self.top(k), 1)]
        lines.append(f"  why: {self.why()}")
        return "\n".join(lines)

    def table(self, top: int = 10) -> str:
        return format_table(self, top)

    def to_yaml(self, candidate: Candidate | None = None, compile: bool = False) -> str:
        """A config for ``lightning-3d fit`` running ``candidate`` (default: the best), its blocks compiled with
        ``compile=True`` (whose speed the step time does not model)."""
        return to_yaml(self, candidate or self.best, compile)


STEP_TERMS = {"compute": "compute", "tp_communication": "tensor-parallel communication",
              "cp_communication": "context-parallel communication", "ep_communication": "expert-parallel all-to-alls",
              "pp_bubble": "pipeline bubble", "pp_communication": "pipeline sends",
              "dp_communication": "exposed data-parallel communication", "optimizer": "optimizer step"}
"""The parts of ``StepTime.total``, as a sentence names them."""


def why_best(candidates: Sequence[Candidate]) -> str:
    """One line on why ``candidates[0]`` ranks first: against the runner-up, the share it is faster by (per
    token, so layouts of different batches compare) and the part of the step time that differs most; when
    the runner-up splits the ranks the same way, also against the best layout that splits them otherwise.

    Example: ``"dp1 tp1 pp8 1f1b m8 b4 is 21.3% faster per token than dp1 tp1 pp8 1f1b m16 b2: 0.0109 s less
    compute per step (0.0172 vs 0.0281 s); and 256x faster per token than dp1 tp2 pp4 ...: 8.27 s less
    tensor-parallel communication per step (0 vs 8.27 s)"``."""
    if not candidates:
        return "no layout fits"
    winner = candidates[0]
    if len(candidates) == 1:
        return f"{winner.layout.describe()} is the only layout that fits"
    line = f"{winner.layout.describe()} is {_against(winner, candidates[1])}"
    other = next((c for c in candidates[1:] if _split(c) != _split(winner)), None)
    if _split(candidates[1]) == _split(winner) and other is not None:
        line += f"; and {_against(winner, other)}"
    return line


def _split(candidate: Candidate) -> tuple[int, int, int, int]:
    return candidate.layout.dp, candidate.layout.cp, candidate.layout.tp, candidate.layout.pp


def _against(winner: Candidate, other: Candidate) -> str:
    """"x% faster per token than <other>: <the term that differs most>"."""
    # Each term scaled to the winner's tokens per step, so a layout of another batch compares fairly.
    scale = (winner.tokens_per_second * winner.time.total) / (other.tokens_per_second * other.time.total)
    gaps = {name: getattr(other.time, name) * scale - getattr(winner.time, name) for name in STEP_TERMS}
    name = max(gaps, key=lambda n: gaps[n])
    share = winner.tokens_per_second / other.tokens_per_second - 1  # time per token, other over winner
    if share <= 0:
        return (f"as fast per token as {other.layout.describe()} and needs less memory"
                f" ({winner.memory.total / GIB:.3g} vs {other.memory.total / GIB:.3g} GiB)")
    faster = f"{share:.1%} faster" if share < 1 else f"{1 + share:.3g}x faster"
    return (f"{faster} per token than {other.layout.describe()}: {gaps[name]:.3g} s less"
            f" {STEP_TERMS[name]} per step ({getattr(winner.time, name):.3g} vs"
            f" {getattr(other.time, name) * scale:.3g} s)")


COLUMNS = ("#", "layout", "params", "grads", "optim", "activ", "gather", "total GiB", "step s", "compute", "tp",
           "cp", "ep", "bubble", "p2p", "dp", "tokens/s", "MFU")


def format_table(plan: LayoutPlan, top: int = 10) -> str:
    """The ``top`` fastest layouts that fit, one line each: per-GPU memory (GiB, at the pipeline rank that
    needs the most) and the step time split by cause (seconds). All values are estimates."""
    rows = [COLUMNS]
    for i, c in enumerate(plan.candidates[:top], 1):
        m, t = c.memory, c.time
        rows.append((str(i), c.layout.describe(), *(f"{v / GIB:.2f}" for v in
                     (m.parameters, m.gradients, m.optimizer_state, m.activations, m.gathered, m.total)),
                     *(f"{v:.3g}" for v in (t.total, t.compute, t.tp_communication, t.cp_communication,
                                           t.ep_communication, t.pp_bubble,
                                           t.pp_communication, t.dp_communication)),
                     f"{c.tokens_per_second:,.0f}", "-" if c.mfu is None else f"{c.mfu:.1%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    cluster = plan.cluster
    source = "times from measured speeds" if plan.calibration is not None else "estimated, not measured"
    header = (f"{plan.model.name}: {plan.model.num_parameters() / 1e9:.3g}B parameters, seq {plan.model.seq_length},"
              f" global batch {plan.global_batch_size}, {plan.precision.name} on {cluster.nodes} x"
              f" {cluster.gpus_per_node} {cluster.rank_name}s ({cluster.memory_gib:g} GiB,"
              f" {gib(cluster.usable_bytes)} usable). {len(plan.candidates)} of {plan.considered} layouts fit;"
              f" {source}.")
    return "\n".join([header, *lines])


def to_yaml(plan: LayoutPlan, candidate: Candidate, compile: bool = False) -> str:
    """A LightningCLI config (the format of ``example_configs/``) that runs ``candidate``'s layout, with
    ``compile: true`` if asked. The model section is the reference GPT when the planned model is one;
    otherwise it is left for the user to fill."""
    layout, model, cluster = candidate.layout, plan.model, plan.cluster
    pipelined = layout.pp > 1
    m, t = candidate.memory, candidate.time
    strategy = {
        "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp, "data_parallel_size": layout.dp,
        "sequence_parallel": layout.sequence_parallel, "zero_stage": layout.zero_stage,
        "activation_checkpointing": layout.recompute,
    }
    if layout.replicas > 1:  # HSDP
        strategy["data_parallel_shard_size"] = layout.shard
    if layout.cp > 1:
        strategy["context_parallel_size"] = layout.cp
    if layout.ep > 1:
        strategy["expert_parallel_size"] = layout.ep
    if compile:
        strategy["compile"] = True
    if pipelined:
        strategy.update(pipeline_schedule=layout.schedule, num_microbatches=layout.num_microbatches,
                        virtual_pipeline_size=layout.virtual_stages, pipeline_reduce_grads=layout.pipeline_reduce_grads)
    gpt = _gpt_config(model)
    strategy["policy"] = "gpt" if gpt else "auto"
    lines = [
        f"# Planned by `lightning-3d plan` for {model.name} ({model.num_parameters() / 1e9:.3g}B parameters) on",
        f"# {cluster.nodes} x {cluster.gpus_per_node} {cluster.rank_name}s of {cluster.memory_gib:.3g} GiB:"
        f" {layout.describe()}.",
        f"# Estimated per {cluster.rank_name} (not measured): {m.total / GIB:.1f} GiB"
        f" (parameters {m.parameters / GIB:.1f},"
        f" gradients {m.gradients / GIB:.1f}, optimizer {m.optimizer_state / GIB:.1f},",
        f"# activations {m.activations / GIB:.1f}, gathered {m.gathered / GIB:.1f}); step {t.total:.3g} s"
        f" (compute {t.compute:.3g}, tp {t.tp_communication:.3g},"
        + (f" cp {t.cp_communication:.3g}," if layout.cp > 1 else "")
        + (f" ep {t.ep_communication:.3g}," if layout.ep > 1 else "") + f" bubble {t.pp_bubble:.3g},"
        f" dp {t.dp_communication:.3g}),",
        f"# {candidate.tokens_per_second:,.0f} tokens/s"
        + ("" if candidate.mfu is None else f", MFU {candidate.mfu:.1%}") + ". See docs/planner.md.",
        *([f"# {COMPILE_ASSUMED}."] if compile else []),
        "seed_everything: 1234",
        "trainer:",
        f"  accelerator: {cluster.device}",
        f"  devices: {cluster.gpus_per_node}",
        f"  num_nodes: {cluster.nodes}",
        f"  precision: {plan.precision.lightning}",
    ]
    if not pipelined and layout.num_microbatches > 1:
        lines.append(f"  accumulate_grad_batches: {layout.num_microbatches}  # micro-batches of each replica")
    lines += ["  strategy:", "    class_path: lightning_3d.ThreeDStrategy", "    init_args:"]
    lines += [f"      {key}: {_yaml_value(value)}" for key, value in strategy.items()]
    lines += ["  max_steps: 1000", "  log_every_n_steps: 10"]
    batch_size = layout.micro_batch_size * (layout.num_microbatches if pipelined else 1)
    if gpt:
        lines += ["model:", "  class_path: lightning_3d.models.GPTLightningModule", "  init_args:", "    config:"]
        lines += [f"      {key}: {_yaml_value(value)}" for key, value in gpt.items()]
        lines += ["data:", "  class_path: lightning_3d.models.SyntheticDataModule  # replace with your data",
                  "  init_args:", f"    vocab_size: {model.vocab_size}", f"    seq_len: {model.seq_length}"]
    else:
        lines += ["# model: your LightningModule (class_path + init_args); the planned sizes are not the reference GPT's",
                  "# data: your LightningDataModule, with:"]
    lines.append(f"{'' if gpt else '# '}    batch_size: {batch_size}  # per data-parallel replica")
    return "\n".join(lines) + "\n"


def _gpt_config(model) -> dict | None:
    """``GPTConfig`` values for a model the reference GPT can express, else None."""
    if (model.gated_mlp or model.norm != "layernorm" or not model.learned_positions or model.tied_embeddings
            or model.kv_heads != model.num_heads or model.ffn % model.hidden_size or model.key_bias):
        return None
    return {"vocab_size": model.vocab_size, "block_size": model.positions, "n_layer": model.num_layers,
            "n_head": model.num_heads, "n_embd": model.hidden_size, "mlp_ratio": model.ffn // model.hidden_size,
            "bias": model.bias, "dropout": model.dropout}


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
