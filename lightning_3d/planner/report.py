"""The planner's result (``LayoutPlan``: ranked ``Candidate`` layouts) and how people read it: the ranked
table, and the YAML config of one layout for ``lightning-3d fit``."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.planner.cluster import GIB, Cluster
from lightning_3d.planner.layout import Layout
from lightning_3d.planner.memory import MemoryEstimate, Precision
from lightning_3d.planner.model import ModelSpec
from lightning_3d.planner.time import StepTime


@dataclass(frozen=True)
class Candidate:
    """One layout with its estimates."""

    layout: Layout
    memory: MemoryEstimate
    """At the pipeline rank that needs the most."""
    time: StepTime
    tokens_per_second: float
    mfu: float
    """Model FLOPs (no recompute) per second over the cluster's peak."""


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

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def table(self, top: int = 10) -> str:
        return format_table(self, top)

    def to_yaml(self, candidate: Candidate | None = None) -> str:
        """A config for ``lightning-3d fit`` running ``candidate`` (default: the best)."""
        return to_yaml(self, candidate or self.best)


COLUMNS = ("#", "layout", "params", "grads", "optim", "activ", "gather", "total GiB", "step s", "compute", "tp",
           "bubble", "p2p", "dp", "tokens/s", "MFU")


def format_table(plan: LayoutPlan, top: int = 10) -> str:
    """The ``top`` fastest layouts that fit, one line each: per-GPU memory (GiB, at the pipeline rank that
    needs the most) and the step time split by cause (seconds). All values are estimates."""
    rows = [COLUMNS]
    for i, c in enumerate(plan.candidates[:top], 1):
        m, t = c.memory, c.time
        rows.append((str(i), c.layout.describe(), *(f"{v / GIB:.2f}" for v in
                     (m.parameters, m.gradients, m.optimizer_state, m.activations, m.gathered, m.total)),
                     *(f"{v:.3g}" for v in (t.total, t.compute, t.tp_communication, t.pp_bubble,
                                           t.pp_communication, t.dp_communication)),
                     f"{c.tokens_per_second:,.0f}", f"{c.mfu:.1%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    cluster = plan.cluster
    header = (f"{plan.model.name}: {plan.model.num_parameters() / 1e9:.3g}B parameters, seq {plan.model.seq_length},"
              f" global batch {plan.global_batch_size}, {plan.precision.name} on {cluster.nodes} x"
              f" {cluster.gpus_per_node} GPUs ({cluster.memory_gib:g} GiB, {cluster.usable_bytes / GIB:.1f} usable)."
              f" {len(plan.candidates)} of {plan.considered} layouts fit; estimated, not measured.")
    return "\n".join([header, *lines])


def to_yaml(plan: LayoutPlan, candidate: Candidate) -> str:
    """A LightningCLI config (the format of ``example_configs/``) that runs ``candidate``'s layout. The model
    section is the reference GPT when the planned model is one; otherwise it is left for the user to fill."""
    layout, model, cluster = candidate.layout, plan.model, plan.cluster
    pipelined = layout.pp > 1
    m, t = candidate.memory, candidate.time
    strategy = {
        "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp, "data_parallel_size": layout.dp,
        "sequence_parallel": layout.sequence_parallel, "zero_stage": layout.zero_stage,
        "activation_checkpointing": layout.recompute,
    }
    if pipelined:
        strategy.update(pipeline_schedule=layout.schedule, num_microbatches=layout.num_microbatches,
                        virtual_pipeline_size=layout.virtual_stages, pipeline_reduce_grads=layout.pipeline_reduce_grads)
    gpt = _gpt_config(model)
    strategy["policy"] = "gpt" if gpt else "auto"
    lines = [
        f"# Planned by `lightning-3d plan` for {model.name} ({model.num_parameters() / 1e9:.3g}B parameters) on",
        f"# {cluster.nodes} x {cluster.gpus_per_node} GPUs of {cluster.memory_gib:g} GiB: {layout.describe()}.",
        f"# Estimated per GPU (not measured): {m.total / GIB:.1f} GiB (parameters {m.parameters / GIB:.1f},"
        f" gradients {m.gradients / GIB:.1f}, optimizer {m.optimizer_state / GIB:.1f},",
        f"# activations {m.activations / GIB:.1f}, gathered {m.gathered / GIB:.1f}); step {t.total:.3g} s"
        f" (compute {t.compute:.3g}, tp {t.tp_communication:.3g}, bubble {t.pp_bubble:.3g},"
        f" dp {t.dp_communication:.3g}),",
        f"# {candidate.tokens_per_second:,.0f} tokens/s, MFU {candidate.mfu:.1%}. See docs/planner.md.",
        "seed_everything: 1234",
        "trainer:",
        "  accelerator: gpu",
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
