"""CPU rehearsal of the real job's set-up: a ~1B model at (dp, pp, tp) = (1, 2, 2) on 4 ranks, 3 training steps.

    python benchmarks/setup_rehearsal.py --model gpt_1b      # the 1.2B GPT of example_configs/gpt_1b_8gpu.yaml
    python benchmarks/setup_rehearsal.py --model llama_1b    # TinyLlama-1.1B's config, transformers' Llama

The GPT takes the meta route (every rank replays the reset_parameters() of its shards); the Llama, built from
its config in ``configure_model()``, initializes in ``post_init()`` and takes the exact route (global rank 0
replays the recorded build op by op and streams each tensor into every rank's shards: ``parallel.init_tape``).
``--model-init fast`` takes the fast route instead: each rank replays the build for its own stages only.

Per rank it prints: its share of the parameters, the largest single tensor, the peak growth of its resident
memory during set-up (from just before ``fit`` to the first batch) against the goal of 1.25 x the share + the
largest tensor, and set-up seconds. Then the steps, next to the planner's per-rank figure
(``lightning_3d.planner.memory.estimate_memory``): the peak over all steps; what stays resident between
steps; and every host tensor alive just before the optimizer step (against its parameters + gradients). Plain SGD keeps
the 4 ranks within this machine's memory (Adam's 8 bytes per parameter would not fit 4 x 1.2B on 24 GiB), so
the planner's figures leave out its optimizer state. Short sequences (128 tokens) keep a step within a minute
on 2 cores; set-up does not depend on them.

The ranks run with glibc's malloc returning large freed blocks at once (``MALLOC_MMAP_THRESHOLD_=65536``,
``MALLOC_TRIM_THRESHOLD_=0``); ``--glibc-defaults`` measures without them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from timing import ensure_torchrun

SEQ, MICROBATCHES, STEPS, LAYOUT = 128, 2, 3, dict(dp=1, pp=2, tp=2)
GPT_1B = dict(vocab_size=50304, block_size=2048, n_layer=20, n_head=16, n_embd=2048, dropout=0.0)
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    """Restart the peak resident set (VmHWM) from the current one; returns that, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _live_tensor_bytes() -> int:
    """Bytes of every host tensor storage alive now (each storage once; a DTensor through its local one)."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    storages = {}
    for obj in gc.get_objects():
        kind = type(obj)  # (not isinstance: it would touch deprecated module proxies, which warn)
        if issubclass(kind, torch.Tensor) and not issubclass(kind, DTensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _module(name: str):
    import torch

    from lightning_3d.models import GPTConfig, GPTLightningModule

    class WithSGD(GPTLightningModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class TinyLlama(WithSGD):
        def configure_model(self):
            if self.model is None:
                from transformers import LlamaConfig, LlamaForCausalLM

                self.model = LlamaForCausalLM(LlamaConfig(**TINYLLAMA))

        def logits(self, tokens):
            return self.model(input_ids=tokens).logits

    if name == "gpt_1b":
        return WithSGD(config=GPTConfig(**GPT_1B))
    return TinyLlama(config=GPTConfig(vocab_size=TINYLLAMA["vocab_size"], block_size=SEQ))


def _planner_figure(name: str, pp_rank: int) -> dict:
    from lightning_3d.models import GPTConfig
    from lightning_3d.planner.layout import Layout
    from lightning_3d.planner.memory import PRECISIONS, estimate_memory
    from lightning_3d.planner.model import ModelSpec

    if name == "gpt_1b":
        spec = ModelSpec.from_gpt_config(GPTConfig(**GPT_1B), seq_length=SEQ)
    else:
        spec = ModelSpec.from_hf_config(dict(TINYLLAMA, model_type="llama"), seq_length=SEQ)
    layout = Layout(**LAYOUT, micro_batch_size=1, num_microbatches=MICROBATCHES, schedule="1f1b")
    estimate = estimate_memory(spec, layout, PRECISIONS["32-true"], pp_rank)
    return {"planner_bytes": estimate.total - estimate.optimizer_state,
            "planner_states_bytes": estimate.parameters + estimate.gradients}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt_1b", "llama_1b"), default="gpt_1b")
    parser.add_argument("--glibc-defaults", action="store_true", help="keep malloc's own thresholds")
    parser.add_argument("--model-init", choices=("auto", "fast"), default="auto",
                        help="ThreeDStrategy(model_init=...): 'fast' replays the build on each rank for its own"
                             " stages only, every draw seeded apart")
    args = parser.parse_args()
    if not args.glibc_defaults:  # before the ranks start: malloc reads them once
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "0")
    ensure_torchrun(4)

    import lightning as L
    import torch
    import torch.distributed as dist

    if args.model == "llama_1b":
        import transformers  # noqa: F401  (the user's import: before the measured window)
    from lightning_3d import ThreeDStrategy
    from lightning_3d.common import local
    from lightning_3d.models import SyntheticDataModule
    from lightning_3d.parallel.memory import memory_report

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.result: dict = {}

        def on_fit_start(self, trainer, pl_module) -> None:
            tensors = [*pl_module.parameters(), *pl_module.buffers()]
            self.result.update(share_bytes=memory_report(pl_module)["parameters"],
                               setup_peak_bytes=_status_kib("VmHWM") * 1024 - self.baseline,
                               setup_seconds=time.monotonic() - self.start,
                               largest_local_bytes=max(local(t).nbytes for t in tensors))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.step_start = _reset_peak()
            if batch_idx == 1:
                self.result["rest_after_step_1_bytes"] = self.step_start - self.baseline

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.result["live_bytes"] = _live_tensor_bytes()  # parameters, gradients, what else is alive

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            peak = _status_kib("VmHWM") * 1024
            self.result["step_peak_bytes"] = max(self.result.get("step_peak_bytes", 0), peak - self.baseline)

    torch.manual_seed(0)
    module = _module(args.model)
    with torch.device("meta"):  # the largest single tensor of the model, from a free build
        probe = _module(args.model)
        probe.configure_model()
    largest = max(t.numel() * t.element_size() for t in [*probe.parameters(), *probe.buffers()])
    whole = sum(t.numel() * t.element_size() for t in {id(t): t for t in probe.parameters()}.values())
    del probe
    strategy = ThreeDStrategy(tensor_parallel_size=LAYOUT["tp"], pipeline_parallel_size=LAYOUT["pp"],
                              num_microbatches=MICROBATCHES, model_init=args.model_init)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    measure = Measure()
    trainer.callbacks.append(measure)
    data = SyntheticDataModule(vocab_size=module.config.vocab_size, seq_len=SEQ, batch_size=MICROBATCHES,
                               num_train_samples=64)
    measure.baseline, measure.start = _reset_peak(), time.monotonic()
    trainer.fit(module, data)
    coords = strategy.parallel_dims.coords(dist.get_rank())
    row = {**measure.result, **_planner_figure(args.model, coords.pp), "rank": dist.get_rank(),
           "coords": f"(dp {coords.dp}, pp {coords.pp}, tp {coords.tp})", "largest_bytes": largest, "model_bytes": whole}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        _report(args.model, args.model_init, rows)
    dist.destroy_process_group()


def _report(model: str, model_init: str, rows: list[dict]) -> None:
    mib = 2**20
    print(f"{model} (model_init={model_init!r}): {rows[0]['model_bytes'] / mib:.0f} MiB of fp32 parameters, largest tensor"
          f" {rows[0]['largest_bytes'] / mib:.0f} MiB, (dp, pp, tp) = (1, 2, 2), {SEQ} tokens x {MICROBATCHES}"
          " micro-batches, plain SGD")
    print("rank  coords              share  set-up peak   goal  set-up s | step peak  planner  ratio | between"
          " steps | live at optimizer  planner")
    for r in rows:
        goal = 1.25 * r["share_bytes"] + r["largest_bytes"]
        print(f"{r['rank']:>4}  {r['coords']:<18} {r['share_bytes'] / mib:>6.0f} {r['setup_peak_bytes'] / mib:>12.0f}"
              f" {goal / mib:>6.0f} {r['setup_seconds']:>9.1f} | {r['step_peak_bytes'] / mib:>9.0f}"
              f" {r['planner_bytes'] / mib:>8.0f} {r['step_peak_bytes'] / r['planner_bytes']:>6.2f} |"
              f" {r['rest_after_step_1_bytes'] / mib:>13.0f} | {r['live_bytes'] / mib:>17.0f}"
              f" {r['planner_states_bytes'] / mib:>8.0f}")
    print("(MiB. Peaks: resident-memory growth from just before fit. Goal: 1.25 x share + largest tensor. Between"
          " steps: resident after step 1 (the parameters, and the gradients Lightning zeroes at the next step)."
          " Live at optimizer: every host tensor alive before the optimizer step, against the planner's"
          " parameters + gradients. The planner's figures leave out Adam's state: plain SGD here.)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
