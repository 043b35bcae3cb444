"""Run under torchrun: try each bad configuration on every rank and report what each rank raised.

Each rank writes a JSON file (stdout lines of several ranks can interleave): per case, the exception type and
message, and whether a process group existed afterwards (it must not: the error has to come before any
collective, or ranks could hang).

    python -m torch.distributed.run --nproc-per-node 2 bad_config_worker.py OUT_DIR CASE [CASE ...]

(the cases are for 2 ranks; tp_shapes_inside_a_pipeline_stage for 4)
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from helpers.launchers import end_process_group
from helpers.user_models import NanoGPTModule
from lightning_3d import ThreeDStrategy
from lightning_3d.policies import Plan, PlanOptions, Policy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)


class NoModel(L.LightningModule):
    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return None


class RaggedData(SyntheticDataModule):
    """10 samples in batches of 4: the third batch has 2 (fine for 2 micro-batches, but a new shape)."""

    def __init__(self):
        super().__init__(seq_len=16, batch_size=4, num_train_samples=10)

    def train_dataloader(self):
        from torch.utils.data import DataLoader
        return DataLoader(self.train_set, batch_size=4, drop_last=False)


class FloatTokens(SyntheticDataModule):
    """Token ids as floats (a data pipeline that normalized them, say): the embedding refuses them."""

    def __init__(self):
        super().__init__(seq_len=16, batch_size=2)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, default_collate

        def as_floats(samples):
            tokens, targets = default_collate(samples)
            return tokens.float(), targets

        return DataLoader(self.train_set, batch_size=2, collate_fn=as_floats)


class ManualOptimization(GPTLightningModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False


class HeadsAttention(nn.Module):
    """Keeps its head count as ``heads``, which its hand-written policy (:class:`ForgetsTheHeadCount`) does not
    divide by tp."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class HeadsBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attention = nn.LayerNorm(32), HeadsAttention()

    def forward(self, x):
        return x + self.attention(self.norm(x))


class HeadsLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(64, 32), nn.ModuleList(HeadsBlock() for _ in range(2)), nn.Linear(32, 64)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class SoftmaxAttention(HeadsAttention):
    """Attention written out by hand, as many models (and transformers' "eager") do it."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = (q @ k.transpose(-2, -1)) / (C // self.heads) ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


class SoftmaxAttentionModel(GPTLightningModule):
    def configure_model(self):
        self.model = HeadsLM()
        for layer in self.model.layers:
            layer.attention = SoftmaxAttention()


class HeadsModel(GPTLightningModule):
    def configure_model(self):
        self.model = HeadsLM()


class ForgetsTheHeadCount(Policy):
    """A user's tensor-parallel plan for HeadsLM that splits q/k/v/o but leaves ``heads`` whole."""

    def plan(self, root, options=PlanOptions()):
        blocks = [f"model.layers.{i}" for i in range(2)]
        tp_plan = {f"model.layers.*.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        tp_plan["model.layers.*.attention.wo"] = RowwiseParallel()
        return Plan(blocks=blocks, tp_plan=tp_plan if options.tp > 1 else {})


class LowRankQueryAttention(nn.Module):
    """Queries through a low-rank pair of projections (``q_down`` then ``q_up``, as DeepSeek's MLA writes q),
    in code that reads its width from its input (``B, T, C = x.shape``, then ``reshape(B, T, C)``): auto finds the
    region (``q_down`` a low-rank feeder), but no per-rank attribute makes the split compute what one process
    does, and the width cannot be narrowed where a feeder reads the same input."""

    def __init__(self, width: int = 32, heads: int = 4, rank: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q_down, self.q_up = nn.Linear(width, rank), nn.Linear(rank, width)
        self.k, self.v, self.out = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, self.head_dim).transpose(1, 2)
                   for t in (self.q_up(self.q_down(x)), self.k(x), self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class LowRankQueryModel(GPTLightningModule):
    def configure_model(self):
        self.model = HeadsLM()
        for layer in self.model.layers:
            layer.attention = LowRankQueryAttention()


class EagerModel(GPTLightningModule):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = nn.Linear(2, 2)


CASES = {
    "dp_times_tp_pp_is_not_world": lambda: (ThreeDStrategy(data_parallel_size=3), GPTLightningModule(config=TINY)),
    "tp_pp_does_not_divide_world": lambda: (ThreeDStrategy(pipeline_parallel_size=3), GPTLightningModule(config=TINY)),
    "unknown_policy": lambda: (ThreeDStrategy(policy="no_such_policy"), GPTLightningModule(config=TINY)),
    "no_model_at_all": lambda: (ThreeDStrategy(), NoModel()),
    "meta_init_of_an_eager_model": lambda: (ThreeDStrategy(model_init="meta"), EagerModel(config=TINY)),
    "init_from_a_missing_file": lambda: (ThreeDStrategy(init_from="weights.pt"), GPTLightningModule(config=TINY)),
    "offload_without_sharding": lambda: (ThreeDStrategy(offload=True), GPTLightningModule(config=TINY)),
    "non_positive_size": lambda: (ThreeDStrategy(tensor_parallel_size=0), GPTLightningModule(config=TINY)),
    "too_few_microbatches_for_1f1b": lambda: (ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=1),
                                              GPTLightningModule(config=TINY)),
    "too_few_blocks_for_the_stages": lambda: (ThreeDStrategy(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                                                             virtual_pipeline_size=2), GPTLightningModule(config=TINY)),
    "batch_not_divisible_into_microbatches": lambda: (ThreeDStrategy(pipeline_parallel_size=2, num_microbatches=4),
                                                      GPTLightningModule(config=TINY), SyntheticDataModule(seq_len=16, batch_size=6)),
    "meta_init_of_a_model_that_inits_in_its_parent": lambda: (
        ThreeDStrategy(model_init="meta"), NanoGPTModule(config=TINY)),
    "manual_optimization_under_pipeline": lambda: (ThreeDStrategy(pipeline_parallel_size=2),
                                                   ManualOptimization(config=TINY)),
    "batch_shape_changes_between_steps": lambda: (ThreeDStrategy(pipeline_parallel_size=2),
                                                  GPTLightningModule(config=TINY), RaggedData()),
    "virtual_stages_without_interleaved_schedule": lambda: (
        ThreeDStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2), GPTLightningModule(config=TINY)),
    "unknown_schedule": lambda: (ThreeDStrategy(pipeline_schedule="pipedream"), GPTLightningModule(config=TINY)),
    "zero_stage_out_of_range": lambda: (ThreeDStrategy(zero_stage=4), GPTLightningModule(config=TINY)),
    "unknown_activation_checkpointing": lambda: (ThreeDStrategy(activation_checkpointing="some"),
                                                 GPTLightningModule(config=TINY)),
    "data_parallel_size_not_a_number": lambda: (ThreeDStrategy(data_parallel_size="two"), GPTLightningModule(config=TINY)),
    "zero_microbatches": lambda: (ThreeDStrategy(num_microbatches=0), GPTLightningModule(config=TINY)),
    "sequence_parallel_without_tp": lambda: (ThreeDStrategy(sequence_parallel=True), GPTLightningModule(config=TINY)),
    "unknown_pipeline_split": lambda: (ThreeDStrategy(pipeline_split="layers"), GPTLightningModule(config=TINY)),
    "unknown_model_init": lambda: (ThreeDStrategy(model_init="lazy"), GPTLightningModule(config=TINY)),
    "non_positive_hang_timeout": lambda: (ThreeDStrategy(hang_timeout=-1), GPTLightningModule(config=TINY)),
    "nccl_on_cpu": lambda: (ThreeDStrategy(process_group_backend="nccl"), GPTLightningModule(config=TINY)),
    "unsupported_precision": lambda: (ThreeDStrategy(), GPTLightningModule(config=TINY), None,
                                      {"precision": "64-true"}),
    "heads_not_divisible_by_tp": lambda: (ThreeDStrategy(tensor_parallel_size=2),
                                          GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=48, n_head=3))),
    "vocab_not_divisible_by_tp": lambda: (ThreeDStrategy(tensor_parallel_size=2),
                                          GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=32, n_head=4,
                                                                              vocab_size=63))),
    "explicit_split_names_a_missing_block": lambda: (
        ThreeDStrategy(pipeline_parallel_size=2, pipeline_split=[["model.blocks.0"], ["model.blocks.7"]]),
        GPTLightningModule(config=TINY)),
    "tp_shapes_a_head_count_the_policy_did_not_divide": lambda: (
        ThreeDStrategy(tensor_parallel_size=2, policy=ForgetsTheHeadCount()), HeadsModel(config=TINY)),
    "auto_cannot_split_most_of_a_block": lambda: (ThreeDStrategy(tensor_parallel_size=2),
                                                  LowRankQueryModel(config=TINY)),
    # Launched on 4 ranks (test_shape_check): the check runs inside a pipeline stage.
    "tp_shapes_inside_a_pipeline_stage": lambda: (ThreeDStrategy(tensor_parallel_size=2, pipeline_parallel_size=2,
                                                                 policy=ForgetsTheHeadCount()),
                                                  HeadsModel(config=TINY), SyntheticDataModule(seq_len=16, batch_size=4)),
    "float_token_ids": lambda: (ThreeDStrategy(), GPTLightningModule(config=TINY), FloatTokens()),
    "cp_sequence_not_divisible": lambda: (ThreeDStrategy(context_parallel_size=2), GPTLightningModule(config=TINY),
                                          SyntheticDataModule(seq_len=14, batch_size=2)),
    "cp_hand_written_attention": lambda: (ThreeDStrategy(context_parallel_size=2), SoftmaxAttentionModel(config=TINY)),
    # layout="auto" decides after calibrating on every rank; rank 0's refusal reaches every rank alike.
    "auto_with_a_fixed_tp_that_cannot_fit": lambda: (
        ThreeDStrategy(tensor_parallel_size=2, zero_stage="auto", max_memory_per_device=1024),
        GPTLightningModule(config=TINY), SyntheticDataModule(seq_len=16, batch_size=2)),
    "resume_from_a_missing_checkpoint": lambda: (ThreeDStrategy(), GPTLightningModule(config=TINY), None, {},
                                                 {"ckpt_path": "no/such/last.ckpt"}),
    "resume_from_an_incomplete_checkpoint": lambda: (ThreeDStrategy(), GPTLightningModule(config=TINY), None, {},
                                                     {"ckpt_path": _incomplete_checkpoint()}),
}


def _incomplete_checkpoint() -> str:
    """A checkpoint directory whose DCP metadata never got written (what a crash inside DCP would leave)."""
    path = Path(sys.argv[1]) / "incomplete.ckpt"
    path.mkdir(exist_ok=True)
    (path / "lightning_3d.meta.pt").write_bytes(b"")
    return str(path)


def main(out_dir: str, names: list[str]) -> None:
    results = []
    for name in names:
        error = None
        try:
            strategy, module, *rest = CASES[name]()
            data, trainer_kwargs, fit_kwargs = [*rest, *[None, {}, {}][len(rest):]]
            trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=5, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                **trainer_kwargs)
            trainer.fit(module, data or SyntheticDataModule(seq_len=16, batch_size=2), **fit_kwargs)
        except Exception as err:  # noqa: BLE001  (reporting whatever was raised is the point)
            error = {"type": type(err).__name__, "message": str(err)}
        results.append({"case": name, "error": error, "process_group": dist.is_initialized()})
    (Path(out_dir) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
