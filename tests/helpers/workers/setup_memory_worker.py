"""Peak host memory of set-up, per rank, for a model built in ``configure_model()`` as users write it
(``test_setup_memory``, ``benchmarks/setup_memory.py``).

    python -m torch.distributed.run --standalone --nproc-per-node 4 setup_memory_worker.py OUT_DIR MODEL [LAYOUT]

MODEL: "llama_<hidden>x<layers>" (transformers' LlamaForCausalLM from its config: its init runs in
``post_init``, so it takes the exact route) or "gpt_<width>x<layers>" (the reference GPT: the meta route).
LAYOUT: names of ``LAYOUTS``, comma-separated (default "pp2_tp2"): one fit each, in one launch.
Each rank writes ``rank{R}.json``, per layout: its parameter bytes after set-up, the largest tensor of the model, the
peak growth of its resident set from just before ``fit`` to the start of training, and set-up seconds."""

import gc
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch

from helpers.launchers import end_process_group
from lightning_3d import ThreeDStrategy
from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
from lightning_3d.parallel.memory import memory_report

LAYOUTS = {
    "pp2_tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2),
    "dp4_zero3": dict(zero_stage=3),
    "hsdp2x2_zero3": dict(zero_stage=3, data_parallel_shard_size=2),  # 2 replicas x 2 shards
}
VOCAB, SEQ = 512, 16


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class LlamaModule(GPTLightningModule):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__(config=GPTConfig(vocab_size=VOCAB, block_size=SEQ))
        self.hidden, self.layers = hidden, layers

    def configure_model(self):
        if self.model is None:
            from transformers import LlamaConfig, LlamaForCausalLM

            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=4 * self.hidden,
                num_hidden_layers=self.layers, num_attention_heads=self.hidden // 64, num_key_value_heads=self.hidden // 64,
                max_position_embeddings=SEQ))

    def logits(self, tokens):
        return self.model(input_ids=tokens).logits


def module_for(spec: str) -> L.LightningModule:
    kind, sizes = spec.split("_")
    width, layers = (int(x) for x in sizes.split("x"))
    if kind == "llama":
        return LlamaModule(width, layers)
    return GPTLightningModule(config=GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_embd=width, n_layer=layers,
                                               n_head=width // 64))


class Measure(L.Callback):
    def __init__(self, baseline_kib: int, start: float) -> None:
        self.baseline_kib, self.start = baseline_kib, start
        self.result: dict = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.result = {"parameter_bytes": memory_report(pl_module)["parameters"],
                       "peak_rss_growth_bytes": (_status_kib("VmHWM") - self.baseline_kib) * 1024,
                       "setup_seconds": round(time.monotonic() - self.start, 1)}


def main(out_dir: str, spec: str, layouts: str = "pp2_tp2") -> None:
    """One fit per layout (comma-separated names of ``LAYOUTS``), each measured from the resident set it
    starts from; ``rank{R}.json`` holds every layout's result by name."""
    if spec.startswith("llama"):  # the user's import, not the set-up's: before the measured window
        import transformers  # noqa: F401
    results = {}
    for layout in layouts.split(","):
        results[layout] = _measured_fit(spec, layout)
        gc.collect()  # the previous fit's model and optimizer go before the next one's baseline
    (Path(out_dir) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))
    end_process_group()


def _measured_fit(spec: str, layout: str) -> dict:
    L.seed_everything(0, verbose=False)
    module = module_for(spec)
    data = SyntheticDataModule(vocab_size=VOCAB, seq_len=SEQ, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=ThreeDStrategy(**LAYOUTS[layout]), max_steps=1, limit_train_batches=1,
                        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # The peak (VmHWM) afresh from the current resident set: what follows is the strategy's doing.
    Path("/proc/self/clear_refs").write_text("5")
    measure = Measure(_status_kib("VmRSS"), time.monotonic())
    trainer.callbacks.append(measure)
    trainer.fit(module, data)
    return measure.result


if __name__ == "__main__":
    main(*sys.argv[1:4])
