"""The sizes a layout divides -- sequence length by tp under sequence parallelism, the batch by the micro-batch
count, micro-batches by the schedule's stages, the last smaller batch, widths by tp -- each as a case run in
one process and on 2 ranks (tests/parity/test_sizes_catalogue.py).

A case is plain data: the model, its sizes, the data's and the strategy's. ``run_case`` fits it and records
the per-step training losses and the validation loss, or the error and how long after ``fit`` began it came.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from helpers.harness import SEED
from lightning_3d.models import GPT, GPTConfig, SyntheticDataModule


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.num_heads, -1).transpose(1, 2) for w in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class HeadsAttention(Attention):
    """Reshapes by a head count under a name of its own (auto finds it from the reshape), and lets ``view``
    work out the head size."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(width, heads)
        del self.num_heads
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (w(x).view(B, T, self.heads, -1).transpose(1, 2) for w in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, attention: type = Attention) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = attention(width, heads), MLP(width, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """A model no policy knows (``policy="auto"`` plans it): separate q/k/v, fc1/fc2, learned positions."""

    def __init__(self, vocab: int, width: int, heads: int, hidden: int, layers: int, positions: int,
                 attention: str = "num_heads") -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(positions, width)
        attention_cls = {"num_heads": Attention, "heads": HeadsAttention}[attention]
        self.blocks = nn.ModuleList(Block(width, heads, hidden, attention_cls) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass(kw_only=True)
class SizeCase:
    strategy: dict
    """ThreeDStrategy's keyword arguments."""
    world: int = 2
    """How many ranks the case runs on."""
    model: str = "tiny"
    """"tiny" (:class:`TinyLM`, policy "auto") or "gpt" (the reference GPT, policy "gpt")."""
    sizes: dict = field(default_factory=dict)
    """The model's sizes over the defaults (vocab 64, width 32, heads 4, hidden 64, layers 2), and
    ``attention="heads"`` for :class:`HeadsAttention`."""
    seq_len: int = 16
    batch_size: int = 4
    train_samples: int = 8
    """With ``batch_size``, how many batches an epoch has; ``drop_last=False`` keeps a last smaller one."""
    val_batch_size: int = 4
    val_samples: int = 4
    steps: int = 2


class SizeModule(L.LightningModule):
    def __init__(self, case: SizeCase) -> None:
        super().__init__()
        self.case = case
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        sizes = {**dict(vocab=64, width=32, heads=4, hidden=64, layers=2), **self.case.sizes}
        if self.case.model == "gpt":
            self.model = GPT(GPTConfig(vocab_size=sizes["vocab"], n_embd=sizes["width"], n_head=sizes["heads"],
                                       n_layer=sizes["layers"], block_size=32))
        else:
            self.model = TinyLM(**sizes, positions=32)

    def _loss(self, batch):
        tokens, targets = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), batch_size=batch[0].shape[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SizeData(SyntheticDataModule):
    """Loaders that keep the last, smaller batch (``drop_last=False``), training and validation. ``reference``:
    one process's, dealing the training samples in the order Lightning's (shuffling) distributed sampler does."""

    def __init__(self, case: SizeCase, reference: bool = False) -> None:
        super().__init__(vocab_size=case.sizes.get("vocab", 64), seq_len=case.seq_len, batch_size=case.batch_size, num_train_samples=case.train_samples,
                         num_val_samples=case.val_samples, seed=SEED)
        self.val_batch_size, self.reference = case.val_batch_size, reference

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, seed=SEED) if self.reference else None
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.val_batch_size, shuffle=False, drop_last=False)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.train: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(trainer.callback_metrics["train_loss"]))


def run_case(case: SizeCase, strategy, devices: int) -> dict:
    """Fit ``case``; its losses, or the error and the seconds it took to come. ``strategy``: a callable that
    makes the strategy (so an error in its arguments is recorded too), or Lightning's name for one."""
    L.seed_everything(SEED, verbose=False)
    losses = Losses()
    start = time.monotonic()
    try:
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy() if callable(strategy) else strategy,
                            max_steps=case.steps, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])
        trainer.fit(SizeModule(case), SizeData(case, reference=devices == 1))
    except Exception as err:  # noqa: BLE001 -- the catalogue records what was raised
        return {"error": f"{type(err).__name__}: {err}", "seconds": round(time.monotonic() - start, 1)}
    return {"error": None, "train": losses.train, "val": float(trainer.callback_metrics.get("val_loss", float("nan")))}


SP = dict(tensor_parallel_size=2, sequence_parallel=True)
PP = dict(pipeline_parallel_size=2, num_microbatches=2)

CASES = {
    # Sequence parallelism splits the sequence over tp ranks.
    "sp_sequence_of_31_on_a_model_auto_plans": SizeCase(strategy=SP, seq_len=31),
    "sp_sequence_of_31_on_the_reference_gpt": SizeCase(strategy=SP, model="gpt", seq_len=31),
    "sp_sequence_of_32_on_a_model_auto_plans": SizeCase(strategy=SP, seq_len=32),
    "sp_last_smaller_batch": SizeCase(strategy=SP, batch_size=4, train_samples=10, steps=3),
    "sp_pp_sequence_of_31": SizeCase(strategy=dict(SP, **PP), seq_len=31, sizes=dict(layers=4), world=4),
    "sp_pp_sequence_of_32": SizeCase(strategy=dict(SP, **PP), seq_len=32, sizes=dict(layers=4), world=4),
    # The batch is split into micro-batches, the micro-batches over the schedule's stages.
    "pp_batch_not_divisible_by_num_microbatches": SizeCase(strategy=dict(PP, num_microbatches=3), batch_size=4),
    "pp_fewer_microbatches_than_stages_1f1b": SizeCase(strategy=dict(PP, num_microbatches=1)),
    "pp_fewer_microbatches_than_stages_interleaved": SizeCase(
        strategy=dict(PP, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2, num_microbatches=1),
        sizes=dict(layers=4)),
    "pp_microbatches_not_a_multiple_of_stages_interleaved": SizeCase(
        strategy=dict(PP, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2, num_microbatches=3),
        sizes=dict(layers=4), batch_size=6, train_samples=12),
    "pp_fewer_microbatches_than_stages_zero_bubble": SizeCase(
        strategy=dict(PP, pipeline_schedule="zero_bubble", virtual_pipeline_size=2, num_microbatches=1),
        sizes=dict(layers=4)),
    "pp_last_smaller_batch": SizeCase(strategy=PP, batch_size=4, train_samples=10, steps=3),
    "pp_validation_batch_of_1": SizeCase(strategy=PP, val_batch_size=1, val_samples=3),
    "pp_validation_batch_of_1_interleaved": SizeCase(
        strategy=dict(PP, pipeline_schedule="interleaved_1f1b", virtual_pipeline_size=2), sizes=dict(layers=4),
        val_batch_size=1, val_samples=3),
    "pp_last_smaller_validation_batch": SizeCase(strategy=PP, val_batch_size=4, val_samples=7),
    # Widths split by tp, on a model auto plans.
    "tp_vocabulary_not_divisible": SizeCase(strategy=dict(tensor_parallel_size=2), sizes=dict(vocab=63)),
    "tp_hidden_width_not_divisible": SizeCase(strategy=dict(tensor_parallel_size=2), sizes=dict(hidden=63)),
    "tp_heads_not_divisible": SizeCase(strategy=dict(tensor_parallel_size=2), sizes=dict(width=36, heads=3)),
    "tp_head_count_under_a_name_of_the_models_own": SizeCase(strategy=dict(tensor_parallel_size=2),
                                                             sizes=dict(attention="heads")),
    "tp_plain": SizeCase(strategy=dict(tensor_parallel_size=2)),
}
"""Name -> case, each run on ``world`` ranks."""
