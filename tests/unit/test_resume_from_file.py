"""Resuming under ThreeDStrategy from a single-file checkpoint that plain Lightning wrote (one device, DDP):
its optimizer state keys parameters by position, as ``optimizer.state_dict()`` does."""

import lightning as L
import pytest
import torch

from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.strategies.checkpoints import _keyed_by_name

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64)


class OptimizerStateAtStart(L.Callback):
    """Adam's moments per parameter name when training (re)starts, after the checkpoint was restored."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t
        self.moments = {name: (local(optimizer.state[p]["exp_avg"]).clone(), local(optimizer.state[p]["exp_avg_sq"]).clone())
                        for name, p in pl_module.named_parameters() if p in optimizer.state}


def fit(strategy, steps: int, root, ckpt_path=None, callbacks=()) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(GPTLightningModule(config=CONFIG), SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=4),
                ckpt_path=ckpt_path)
    return trainer


def test_a_plain_lightning_checkpoint_resumes_with_its_optimizer_state(tmp_path):
    stopped = fit("auto", 2, tmp_path)
    names = [name for name, _ in stopped.lightning_module.named_parameters()]  # the optimizer's order
    stopped.save_checkpoint(tmp_path / "plain.ckpt")
    saved = torch.load(tmp_path / "plain.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    at_start = OptimizerStateAtStart()
    resumed = fit(ThreeDStrategy(), 3, tmp_path, ckpt_path=tmp_path / "plain.ckpt", callbacks=[at_start])
    assert resumed.global_step == 3
    assert sorted(at_start.moments) == sorted(names)
    for position, name in enumerate(names):  # every moment restored to its own parameter, exactly
        assert torch.equal(at_start.moments[name][0], saved[position]["exp_avg"]), name
        assert torch.equal(at_start.moments[name][1], saved[position]["exp_avg_sq"]), name


def test_positions_that_match_no_optimizer_here_fail_saying_what_to_do():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    names = list(model.state_dict())
    saved = torch.optim.AdamW(model.parameters()).state_dict()  # 4 parameters in one group
    fewer = torch.optim.AdamW(model[1].parameters())  # an optimizer of another model: 2 of them, on every rank
    with pytest.raises(ValueError, match=r"held \[4\] parameters per param group, the ranks here hold \[2\].*init_from"):
        _keyed_by_name(saved, model, fewer, names)
    whole = torch.optim.AdamW(model.parameters())
    assert _keyed_by_name(saved, model, whole, names)["param_groups"][0]["params"] == ["0.weight", "0.bias",
                                                                                      "1.weight", "1.bias"]
