"""Host memory of each rank while it loads pretrained weights (``init_from``) at a layout.

    python benchmarks/pretrained_memory.py [--nprocs 4] [--pp 1] [--tp 4] [--n-layer 6] [--n-embd 768] [--hf-llama]

Writes a reference GPT's weights to a safetensors file (rank 0, before the launch), then on every rank builds
the parallel model (``parallelize`` without its init_from step) and times ``load_pretrained`` while a thread samples the process's resident memory
(/proc/self/statm, every 2 ms). Prints, per rank: the bytes of weights it holds, the largest single tensor
it reads, and how much its resident memory grew during the load (file pages mapped in included). The claim
to check: growth ~ this rank's share of the file (+ one tensor), never the whole model.

Measured on 2 CPU cores, a 350 MiB GPT (6 x 768, vocabulary 32000), 4 ranks, each holding 88 MiB (allocated
before the load, by the meta-device init): resident memory grew by 17-25 MiB during the load at tp=4
(largest local tensor 23 MiB) and by 40-46 MiB at pp=2 x tp=2 (largest 47 MiB) -- at most about one
tensor, because each region is copied straight from the file's pages into the parameter, through a handle
opened for that read, whose map (and the pages it touched) goes when it closes
(``checkpoint/safetensors_io.py``). Before that, copying through a clone and keeping the pages: 157-178 MiB.

``--hf-llama``: a Hugging Face Llama of 386 MiB (6 x 768, 12 heads, 4 kv heads) from a ``save_pretrained``
directory, ``HFCausalLMModule(pretrained=...)`` built on the meta device: 4 ranks each hold 96 MiB; building
their part grew resident memory by 217-262 MiB (the share, one full tensor at a time while the init replays
-- the 94 MiB embedding is the largest -- and the imports), the load by 22-26 MiB at tp=4 and 45-49 MiB at
pp=2 x tp=2. The reference GPT's build phase, measured the same way: 210-228 MiB at tp=4. Neither holds the
whole model at any time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from timing import ensure_torchrun


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    def __init__(self) -> None:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hf-llama", action="store_true",
                        help="a Hugging Face Llama (save_pretrained directory, HFCausalLMModule(pretrained=...))")
    parser.add_argument("--file", default=None, help="where the weights are written once (default: a temp path)")
    args = parser.parse_args()

    from lightning_3d.models import GPT, GPTConfig, HFCausalLMModule

    default = "lightning_3d_pretrained_memory_llama" if args.hf_llama else "lightning_3d_pretrained_memory.safetensors"
    path = Path(args.file or Path(tempfile.gettempdir()) / default)  # a save_pretrained directory, or one file
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=12, vocab_size=args.vocab_size,
                       block_size=128)
    llama = dict(vocab_size=args.vocab_size, hidden_size=args.n_embd, intermediate_size=4 * args.n_embd,
                 num_hidden_layers=args.n_layer, num_attention_heads=12, num_key_value_heads=4)
    if "RANK" not in os.environ and not path.exists():
        if args.hf_llama:
            HFCausalLMModule("llama", llama).model.save_pretrained(path)
        else:
            from lightning_3d.checkpoint.safetensors_io import SafetensorsWriter

            state = GPT(config).state_dict()
            with SafetensorsWriter(path, {k: (tuple(v.shape), v.dtype) for k, v in state.items()}) as writer:
                for k, v in state.items():
                    writer.write(k, v)
            del state
    ensure_torchrun(args.nprocs)

    import dataclasses

    import lightning as L
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from lightning_3d.checkpoint.pretrained import load_pretrained
    from lightning_3d.common import local
    from lightning_3d.parallel.parallelize import InitialWeights, parallelize, plan_model
    from lightning_3d.policies import resolve_policy

    class Module(L.LightningModule):
        def configure_model(self):
            self.model = GPT(config)

    strategy = ThreeDStrategy(pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp, init_from=str(path))
    L.Trainer(accelerator="cpu", devices=args.nprocs, strategy=strategy, logger=False,  # connects the strategy
                        enable_progress_bar=False, enable_model_summary=False, max_steps=0)
    module = HFCausalLMModule(pretrained=str(path)) if args.hf_llama else Module()
    strategy._lightning_module = module  # set up the parallel model without training (benchmark only)
    strategy.setup_environment()
    # The chain without its init_from step, so that building this rank's part and loading its slices are
    # measured apart (the build then initializes the parameters too: more time, the same memory).
    without_load, dims = dataclasses.replace(strategy.parallel_config, init_from=None), strategy.parallel_dims
    start_rss = rss_bytes()
    with PeakRSS() as build_peak:  # the model on the meta device, then this rank's part materialized
        with strategy.tensor_init_context():
            module.configure_model()
        plan = plan_model(resolve_policy(without_load.policy), module, without_load, dims.tp)
        parallelize(module, plan, without_load, dims, strategy.device_mesh, rank=strategy.global_rank,
                    device=strategy.root_device, precision=strategy.precision_plugin, weights=InitialWeights(None))
    state = module.state_dict()
    held = sum(local(p).nbytes for p in state.values())
    largest = max(local(p).nbytes for p in state.values())
    before, start = rss_bytes(), time.perf_counter()
    with PeakRSS() as peak:
        load_pretrained(module, str(path), plan.checkpoint_names, plan.tied_parameters)
    seconds = time.perf_counter() - start
    file_size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.safetensors")))
    line = (f"rank {dist.get_rank()}: file {file_size / 2**20:.0f} MiB, holds {held / 2**20:.1f} MiB (largest tensor"
            f" {largest / 2**20:.1f} MiB); resident memory grew {(build_peak.peak - start_rss) / 2**20:.1f} MiB"
            f" building its part and {(peak.peak - before) / 2**20:.1f} MiB during the load ({seconds:.2f} s)")
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
