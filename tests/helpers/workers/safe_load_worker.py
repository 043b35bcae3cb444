"""Reading files that would run code (lightning_3d.checkpoint.safe_load), as a user meets them: one process.

    python safe_load_worker.py OUT_DIR

Writes a checkpoint directory with ``ModelCheckpoint`` (hyper-parameters holding a GPTConfig, numpy's random
state), resumes from it and converts it (our own files must still load); then plants pickles whose unpickling
creates a file -- an ``init_from`` .pt file, the checkpoint's ``lightning_3d.meta.pt``, DCP's ``.metadata`` --
and records, for each, the error and whether the file was created. Results: OUT_DIR/results.json.
"""

import json
import pickle
import shutil
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import ThreeDStrategy
from lightning_3d.checkpoint.convert import main as convert
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

CONFIG = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)


class CreatesAFile:
    """Unpickling this opens ``path`` for writing: the stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def fit(out: Path, steps: int, save: bool = False, ckpt_path: str | None = None, **kwargs) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ThreeDStrategy(**kwargs), max_steps=steps, logger=False,
                        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=out,
                        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", save_last=True)] if save else [])
    trainer.fit(GPTLightningModule(config=CONFIG, warmup_steps=1), SyntheticDataModule(seq_len=8, batch_size=2),
                ckpt_path=ckpt_path)
    return trainer


def attempt(run) -> str | None:
    try:
        run()
    except Exception as err:  # noqa: BLE001 -- the error is the result
        return f"{type(err).__name__}: {err}"
    return None


def main(out: Path) -> None:
    fit(out, 1, save=True)
    ours = out / "ckpt" / "last.ckpt"
    results = {"resumed_to": fit(out, 2, ckpt_path=str(ours)).global_step,
               "converted": attempt(lambda: convert([str(ours), str(out / "ours.pt"), "--strip-prefix", "model."]))}
    results["init_from_ours"] = attempt(lambda: fit(out, 1, init_from=str(out / "ours.pt")))

    cases = {}
    evil_pt = out / "evil.pt"
    torch.save({**torch.load(out / "ours.pt"), "extra": CreatesAFile(out / "created_by_init_from")}, evil_pt)
    cases["init_from"] = lambda: fit(out, 1, init_from=str(evil_pt))
    evil_meta = out / "evil_meta.ckpt"
    shutil.copytree(ours, evil_meta)
    torch.save({"global_step": 1, "extra": CreatesAFile(out / "created_by_meta")}, evil_meta / "lightning_3d.meta.pt")
    cases["meta"] = lambda: fit(out, 2, ckpt_path=str(evil_meta))
    evil_dcp = out / "evil_dcp.ckpt"
    shutil.copytree(ours, evil_dcp)
    (evil_dcp / ".metadata").write_bytes(pickle.dumps(CreatesAFile(out / "created_by_dcp_metadata")))
    cases["dcp_metadata"] = lambda: fit(out, 2, ckpt_path=str(evil_dcp))
    cases["dcp_metadata_convert"] = lambda: convert([str(evil_dcp), str(out / "evil.safetensors")])
    cases["dcp_metadata_init_from"] = lambda: fit(out, 1, init_from=str(evil_dcp))
    for name, run in cases.items():
        results[name] = attempt(run)
    results["created"] = sorted(p.name for p in out.glob("created_by_*"))
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
