"""Mid-epoch resume reads only the samples not yet trained on (lightning_3d.checkpoint.resumable).

One process: ``ThreeDStrategy()`` at ``devices=1`` still hands the training loader a ``DistributedSampler``
(dp=1), as at any layout. A dataset counts its ``__getitem__`` calls; a run of 64 batches per epoch is
checkpointed at step 50 (epoch 0, batch 50) and step 100 (epoch 1, batch 36) and resumed from each."""

import logging
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_3d import ThreeDStrategy

BATCH, BATCHES = 2, 64  # per epoch


class CountingDataset(Dataset):
    """Sample i is the tensor [i]; ``reads`` counts the samples read, ``delay`` (seconds) makes each read slow."""

    def __init__(self, delay: float = 0.0) -> None:
        self.reads, self.delay = 0, delay

    def __len__(self) -> int:
        return BATCH * BATCHES

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([float(index)])


class CountingStream(IterableDataset):
    def __init__(self) -> None:
        self.reads = 0

    def __iter__(self):
        for index in range(BATCH * BATCHES):
            self.reads += 1
            yield torch.tensor([float(index)])


class Recorder(L.LightningModule):
    """Trains a 1x1 linear layer; records which samples each batch held and the loader Lightning iterated."""

    def __init__(self, dataset, loader_class=DataLoader, shuffle=True, num_workers=0) -> None:
        super().__init__()
        self.dataset, self.loader_class, self.shuffle, self.num_workers = dataset, loader_class, shuffle, num_workers
        self.layer = torch.nn.Linear(1, 1)
        self.batches: list[list[int]] = []

    def train_dataloader(self):
        return self.loader_class(self.dataset, batch_size=BATCH, shuffle=self.shuffle,
                                 num_workers=self.num_workers)

    def training_step(self, batch, batch_idx):
        self.batches.append([int(x) for x in batch.flatten()])
        return self.layer(batch).sum()

    def on_train_start(self):
        self.loader = self.trainer.train_dataloader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def fit(module, root, max_steps, ckpt_path=None, checkpoint_every=None) -> float:
    callbacks = [ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=checkpoint_every,
                                 save_top_k=-1)] if checkpoint_every else []
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ThreeDStrategy(), max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks,
                        enable_checkpointing=bool(checkpoint_every))
    start = time.perf_counter()
    trainer.fit(module, ckpt_path=ckpt_path)
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def through(tmp_path_factory):
    """Two epochs without a stop, checkpointed at steps 50 and 100."""
    root = tmp_path_factory.mktemp("through")
    module = Recorder(CountingDataset())
    fit(module, root, 2 * BATCHES, checkpoint_every=50)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step=")) == ["step=100.ckpt", "step=50.ckpt"]
    return root, module.batches


# With a worker, the loader's iterator asks for the resumed epoch's first indices before Lightning sets the
# sampler's epoch: the strategy sets it first (else epoch 1 resumes with epoch 0's order).
@pytest.mark.parametrize("step, num_workers", [(50, 0), (100, 0), (100, 1)])
def test_a_resumed_epoch_reads_only_the_samples_not_yet_trained_on_in_the_same_order(through, step, num_workers):
    root, batches = through
    assert batches[:BATCHES] != batches[BATCHES:]  # each epoch has its own shuffle
    end = (step // BATCHES + 1) * BATCHES  # the end of the epoch the checkpoint is in
    module = Recorder(CountingDataset(), num_workers=num_workers)
    fit(module, root / f"resumed_{step}_{num_workers}", end, ckpt_path=root / f"step={step}.ckpt")
    assert isinstance(module.loader.sampler, DistributedSampler)
    assert module.batches == batches[step:end]  # the uninterrupted run's batches, in its order
    if not num_workers:  # a worker counts in its own copy of the dataset
        assert module.dataset.reads == (end - step) * BATCH  # 14 (28) batches read, not 64


def test_a_stateful_loader_is_left_to_lightning(through):
    """torchdata's StatefulDataLoader saves and restores its own position; the strategy passes it through.
    Not shuffled: Lightning wraps its RandomSampler (a custom sampler to Lightning) in a DistributedSampler
    whose order comes from the global generator when the epoch starts, before the strategy restores it."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    root, _ = through
    module = Recorder(CountingDataset(), stateful.StatefulDataLoader, shuffle=False)
    fit(module, root / "stateful", 2 * BATCHES, checkpoint_every=50)
    batches = module.batches
    module = Recorder(CountingDataset(), stateful.StatefulDataLoader, shuffle=False)
    fit(module, root / "stateful_resumed", BATCHES, ckpt_path=root / "stateful" / "step=50.ckpt")
    assert isinstance(module.loader, stateful.StatefulDataLoader)  # not wrapped
    assert module.batches == batches[50:BATCHES]
    assert module.dataset.reads == (BATCHES - 50) * BATCH


def test_an_iterable_dataset_falls_back_to_reading_and_dropping_batches(tmp_path, caplog):
    module = Recorder(CountingStream())
    module.train_dataloader = lambda: DataLoader(module.dataset, batch_size=BATCH)
    fit(module, tmp_path, BATCHES, checkpoint_every=50)
    batches = module.batches
    resumed = Recorder(CountingStream())
    resumed.train_dataloader = lambda: DataLoader(resumed.dataset, batch_size=BATCH)
    lightning_log = logging.getLogger("lightning.pytorch")  # rank_zero_info's; it does not propagate to the root
    lightning_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger="lightning.pytorch"):
            fit(resumed, tmp_path / "resumed", BATCHES, ckpt_path=tmp_path / "step=50.ckpt")
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert resumed.batches == batches[50:]
    assert resumed.dataset.reads == BATCHES * BATCH  # all read, the first 50 batches dropped
    assert sum("reads and drops" in r.getMessage() for r in caplog.records) == 1, caplog.text
