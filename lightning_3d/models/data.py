"""A deterministic, synthetic, learnable language-modelling task, shipped in the package (no downloads).

Each sequence follows a fixed hidden successor rule: the token after ``t`` is ``successor[t]`` (a random
permutation of the vocabulary drawn from ``seed``), except that with probability ``noise`` it is uniformly
random. A model that learns the rule reaches a loss near the noise entropy; one that has not sits at
``ln(vocab_size)``. Sample ``i`` depends only on ``(seed, i)``, so every rank, worker and layout sees the same
data for the same index.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class SuccessorDataset(Dataset):
    """``num_samples`` pairs ``(tokens, targets)`` of shape ``(seq_len,)``; targets are tokens shifted by one."""

    def __init__(
        self, *, vocab_size: int, seq_len: int, num_samples: int, noise: float, seed: int, first_index: int = 0
    ) -> None:
        self.vocab_size, self.seq_len, self.num_samples, self.noise, self.seed = (
            vocab_size, seq_len, num_samples, noise, seed
        )
        self.first_index = first_index  # validation sets use indices after the training ones
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self._successor = self.successor.tolist()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_index + index)
        first = int(torch.randint(self.vocab_size, (1,), generator=g))
        random_tokens = torch.randint(self.vocab_size, (self.seq_len,), generator=g).tolist()
        is_noise = (torch.rand(self.seq_len, generator=g) < self.noise).tolist()
        # A recurrence, so a loop; over Python ints (indexing tensors element by element is far slower).
        seq = [first]
        for t in range(self.seq_len):
            seq.append(random_tokens[t] if is_noise[t] else self._successor[seq[t]])
        seq = torch.tensor(seq, dtype=torch.long)
        return seq[:-1], seq[1:]

    def loss_floor(self) -> float:
        """The lowest expected cross-entropy (nats/token): what is left once the rule is learned."""
        p_rule = 1 - self.noise + self.noise / self.vocab_size
        p_other = self.noise / self.vocab_size
        return -(p_rule * math.log(p_rule) + (self.vocab_size - 1) * p_other * math.log(p_other)) if self.noise else 0.0


class SyntheticDataModule(L.LightningDataModule):
    """Train/val loaders over :class:`SuccessorDataset`. ``batch_size`` is per data-parallel rank, as with any
    Lightning DataModule; the strategy's sampler splits the data over dp ranks only (tp and pp ranks of one
    replica see the same batch).

    Example::

        dm = SyntheticDataModule(vocab_size=64, seq_len=32, batch_size=8)
    """

    def __init__(
        self,
        *,
        vocab_size: int = 64,
        seq_len: int = 32,
        batch_size: int = 8,
        num_train_samples: int = 4096,
        num_val_samples: int = 256,
        noise: float = 0.1,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        common = dict(vocab_size=h.vocab_size, seq_len=h.seq_len, noise=h.noise, seed=h.seed)
        self.train_set = SuccessorDataset(num_samples=h.num_train_samples, **common)
        # Same rule (the successor permutation comes from the seed), other sequences.
        self.val_set = SuccessorDataset(num_samples=h.num_val_samples, first_index=h.num_train_samples, **common)

    def train_dataloader(self) -> DataLoader:
        # No shuffling: the samples are already random, and a fixed order makes runs comparable across
        # layouts (Lightning's distributed sampler then deals sample i to dp rank i % dp).
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, drop_last=True)

