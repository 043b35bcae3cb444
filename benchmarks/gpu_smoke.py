"""One-GPU smoke benchmark: a ~1B GPT in bf16-mixed, in under 5 minutes on one GPU (issue 19 item 3).

    python benchmarks/gpu_smoke.py [--rounds 2] [--steps 8] [--peak-tflops 989] [--parts throughput,ac,comm,offload,setup]
    python benchmarks/gpu_smoke.py --cpu-smoke   # every part on CPU with a tiny model (checks the code paths)

One process, one device, the reference GPT (``lightning_3d.models``), one fixed set of random token batches:

* **throughput** -- the same model and optimizer (the module's own ``configure_optimizers``) trained three
  ways, alternated ``--rounds`` times (order flipped every round): ``ThreeDStrategy`` (dp = pp = tp = 1), a
  plain PyTorch loop (autocast bf16 around forward and loss, as Lightning's "bf16-mixed" does) and
  Lightning's default strategy. Median step time after a warm-up, tokens/s, MFU, and the ratios of the medians.
* **ac** -- ``torch.cuda.max_memory_allocated`` under ``ThreeDStrategy(activation_checkpointing=...)``
  None / "selective" / "full", peak statistics reset before each run.
* **comm** -- ``CommTimer(every_n_steps=1)`` on every batch: on CUDA its clock is CUDA events. With one rank
  every group has one member, so it counts no bytes; the check is that it runs and that its event-timed
  step time agrees with the host's synchronized one.
* **offload** -- FSDP2 ZeRO-3 with CPU offload, built by the strategy's own functions (``apply_zero`` with
  ``offload_policy`` and ``mixed_precision_policy``) on a one-rank "dp" mesh in a plain loop: at dp = 1
  ``ThreeDStrategy`` applies no data parallelism at all (``_data_parallel`` returns the module), so
  ``offload=True`` has nothing to act on there; this measures what the offload itself costs on this GPU.
* **setup** -- ``ThreeDStrategy``'s set-up on each init route (``lightning_3d.parallel.weight_init``): the
  reference GPT built in ``configure_model()`` (meta route: its resets replayed on the device's tensors) and
  the same GPT re-initialized from the root as nanoGPT does (exact route: the build recorded on meta and
  replayed op by op on the host, ``parallel.init_tape``), and that GPT under ``model_init="fast"`` (the recorded
  build replayed on the device, each draw seeded apart). Set-up seconds, peak host memory growth (Linux's
  VmHWM) and peak device memory, from before ``fit`` to the first batch.

MFU = model FLOPs per step / step time / the GPU's dense bf16 peak. Model FLOPs per token are PaLM's
6 * N + 12 * n_layer * n_embd * seq_len, with N the weights of the matrix multiplies (embedding look-ups
multiply nothing); the attention term counts the full T x T score matrix (no causal halving), and
activation-checkpointing recompute is not counted (it is model FLOPs, not hardware FLOPs).
Step times are taken after a device synchronize at the end of every step, the same in every run.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from lightning_3d.device_peaks import dense_bf16_tflops

PARTS = ("throughput", "ac", "comm", "offload", "setup")


@dataclass(kw_only=True)
class Sizes:
    """What one run trains: the model's sizes and the batch."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    batch_size: int


GPU_SIZES = Sizes(n_layer=16, n_embd=2048, n_head=16, vocab_size=50304, seq_len=2048, batch_size=8)  # 1.02e9
CPU_SIZES = Sizes(n_layer=4, n_embd=64, n_head=4, vocab_size=256, seq_len=32, batch_size=4)


def matmul_weights(sizes: Sizes, mlp_ratio: int = 4) -> int:
    """Weights that take part in a matrix multiply per token: q, k, v, o and the MLP in each block, and the
    output head; embeddings are look-ups, biases and norms are element-wise (negligible, not counted)."""
    return sizes.n_layer * (4 + 2 * mlp_ratio) * sizes.n_embd ** 2 + sizes.n_embd * sizes.vocab_size


def train_flops_per_token(sizes: Sizes) -> int:
    """Forward and backward FLOPs per token: 2 per weight forward, 4 backward (6 N), plus attention's
    Q K^T and A V (2 * 2 * T * n_embd per layer forward, 3x that with backward)."""
    return 6 * matmul_weights(sizes) + 12 * sizes.n_layer * sizes.n_embd * sizes.seq_len


def peak_flops(device_name: str, override_tflops: Optional[float]) -> Optional[float]:
    """The device's dense bf16 peak in FLOP/s: the override, else the table's, else None (unknown)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    tflops = dense_bf16_tflops(device_name)
    return None if tflops is None else tflops * 1e12


def mfu(flops_per_step: float, step_seconds: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization, or None without a known peak."""
    return None if peak is None else flops_per_step / step_seconds / peak


@dataclass
class Run:
    """One timed run: seconds per step after the warm-up, device memory (None on CPU), and every step's loss."""

    name: str
    step_times: list[float]
    peak_bytes: Optional[int] = None
    baseline_bytes: Optional[int] = None
    losses: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)


class Bench:
    """The settings of this invocation and the helpers every part shares."""

    def __init__(self, args: argparse.Namespace, sizes: Optional[Sizes] = None) -> None:
        self.args = args
        self.device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
        self.sizes = sizes or (CPU_SIZES if args.cpu_smoke else GPU_SIZES)
        if args.batch_size:
            self.sizes = replace(self.sizes, batch_size=args.batch_size)
        self.device_name = "CPU" if args.cpu_smoke else torch.cuda.get_device_name(self.device)
        self.peak = peak_flops(self.device_name, args.peak_tflops)
        self.tokens_per_step = self.sizes.batch_size * self.sizes.seq_len
        self.flops_per_step = train_flops_per_token(self.sizes) * self.tokens_per_step
        n = self.sizes.batch_size * (args.warmup + args.steps)
        tokens = torch.randint(self.sizes.vocab_size, (n, self.sizes.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        self.data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def config(self):
        from lightning_3d.models import GPTConfig

        s = self.sizes
        return GPTConfig(n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head, vocab_size=s.vocab_size,
                         block_size=s.seq_len)

    def module(self):
        from lightning_3d.models import GPTLightningModule

        # lr 3e-4 (not the tiny model's 3e-3) keeps a 1B model's loss finite over the few steps.
        return GPTLightningModule(config=self.config(), learning_rate=3e-4, warmup_steps=2)

    def loader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.sizes.batch_size, shuffle=False, drop_last=True)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_memory(self) -> Optional[int]:
        """Free what earlier runs left, zero the peak; the bytes still allocated (a leak would show here)."""
        gc.collect()
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_memory(self) -> Optional[int]:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def step_deltas(self, ends: list[float], warmup: int) -> list[float]:
        return [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]

    def fit(self, name: str, strategy, callbacks: tuple = ()) -> Run:
        """``Trainer.fit`` for warm-up + timed steps; the time of each step from one batch end to the next."""
        import lightning as L

        bench = self

        class StepEnds(L.Callback):
            def __init__(self) -> None:
                self.ends: list[float] = []
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
                bench.synchronize()
                self.ends.append(time.perf_counter())
                self.losses.append(float(outputs["loss"]))  # synchronized already: no extra wait

        L.seed_everything(0, verbose=False)
        baseline = self.reset_memory()
        clock = StepEnds()
        L.Trainer(accelerator=self.device.type, devices=1, strategy=strategy, precision="bf16-mixed",
                  max_steps=self.args.warmup + self.args.steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  num_sanity_val_steps=0, callbacks=[clock, *callbacks]).fit(self.module(), self.loader())
        return Run(name, self.step_deltas(clock.ends, self.args.warmup), self.peak_memory(), baseline, clock.losses)

    def loop(self, name: str, shard: Callable[[torch.nn.Module], None] = lambda model: None,
             warmup: Optional[int] = None, steps: Optional[int] = None) -> Run:
        """The module's model and optimizer in a plain loop, autocast bf16 around forward and loss;
        ``shard`` may wrap the model (in place) before the optimizer is made. ``warmup`` and ``steps``
        default to the command line's."""
        import torch.nn.functional as F

        torch.manual_seed(0)
        baseline = self.reset_memory()
        module = self.module()
        with torch.device(self.device):
            module.configure_model()
        shard(module.model)
        optimizers = module.configure_optimizers()
        optimizer, scheduler = optimizers["optimizer"], optimizers["lr_scheduler"]["scheduler"]
        warmup = warmup or self.args.warmup
        ends, losses = [], []
        for tokens, targets in itertools.islice(self.loader(), warmup + (steps or self.args.steps)):
            tokens, targets = tokens.to(self.device), targets.to(self.device)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(module.model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            self.synchronize()
            ends.append(time.perf_counter())
            losses.append(float(loss.detach()))
        return Run(name, self.step_deltas(ends, warmup), self.peak_memory(), baseline, losses)


def throughput(bench: Bench) -> list[Run]:
    from lightning_3d import ThreeDStrategy

    runs = {"ThreeDStrategy": lambda: bench.fit("ThreeDStrategy", ThreeDStrategy()),
            "plain PyTorch loop": lambda: bench.loop("plain PyTorch loop"),
            "Lightning default": lambda: bench.fit("Lightning default", "auto")}
    rounds: dict[str, list[Run]] = {name: [] for name in runs}
    for round_index in range(bench.args.rounds):
        for name in runs if round_index % 2 == 0 else reversed(list(runs)):
            rounds[name].append(runs[name]())
    for name, results in rounds.items():
        print(f"  {name:>20}: median step per round {' '.join(f'{r.median * 1e3:8.2f}' for r in results)} ms",
              flush=True)
    medians = {name: statistics.median(r.median for r in results) for name, results in rounds.items()}
    for other in ("plain PyTorch loop", "Lightning default"):
        print(f"  ratio ThreeDStrategy / {other} step time: {medians['ThreeDStrategy'] / medians[other]:.3f}")
    # One row per way: all rounds' steps together, the memory of the last round.
    return [Run(name, [t for r in results for t in r.step_times], results[-1].peak_bytes, results[-1].baseline_bytes)
            for name, results in rounds.items()]


def activation_checkpointing(bench: Bench) -> list[Run]:
    from lightning_3d import ThreeDStrategy

    runs = [bench.fit(f"AC {mode or 'none'}", ThreeDStrategy(activation_checkpointing=mode))
            for mode in (None, "selective", "full")]
    if runs[0].peak_bytes is None:
        print("  (CPU: no device memory statistics; torch.cuda.max_memory_allocated is CUDA only)")
        return runs
    none = runs[0].peak_bytes
    for run in runs:
        print(f"  {run.name:>14}: peak {gib(run.peak_bytes)} GiB ({run.peak_bytes / none:.2f} of none),"
              f" allocated before the run {gib(run.baseline_bytes)} GiB, step {run.median * 1e3:.2f} ms")
    return runs


def comm_timer(bench: Bench) -> list[Run]:
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.callbacks import CommTimer

    timer = CommTimer(every_n_steps=1)
    event_times: list[float] = []

    class ReadTimer(L.Callback):  # after CommTimer in the list: reads what it just computed
        def on_train_batch_end(self, *_args) -> None:
            event_times.append(timer.per_rank[0]["step_time_s"])

    run = bench.fit("CommTimer every step", ThreeDStrategy(), callbacks=(timer, ReadTimer()))
    clock = "CUDA events" if bench.device.type == "cuda" else "host clock (CPU: the CUDA path needs a GPU)"
    print(f"  CommTimer clock: {clock}; last batch, rank 0: "
          + ", ".join(f"{k}={v:.4g}" for k, v in sorted(timer.per_rank[0].items())))
    print(f"  operations it attributed to tp/pp/dp in the last batch: {len(timer.last_ops)}"
          " (one rank: every group has one member, nothing moves)")
    event = statistics.median(event_times[bench.args.warmup:])
    print(f"  its step time {event * 1e3:.2f} ms vs host-synchronized {run.median * 1e3:.2f} ms"
          f" (ratio {event / run.median:.3f}; the host's also counts the data loader and Lightning between steps)")
    return [run]


def offload(bench: Bench) -> list[Run]:
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.config import ParallelConfig
    from lightning_3d.parallel.data_parallel import apply_zero
    from lightning_3d.parallel.precision import mixed_precision_policy, offload_policy
    from lightning_3d.strategies.processes import backend_for

    config = ParallelConfig(zero_stage=3, offload=True)
    default_backend = "nccl" if bench.device.type == "cuda" else "gloo"
    ensure_process_group(backend_for(bench.device, default_backend))
    mesh = init_device_mesh(bench.device.type, (1,), mesh_dim_names=("dp",))
    policy = offload_policy(config, bench.device)

    def shard(model: torch.nn.Module) -> None:
        apply_zero(model, list(model.blocks.values()), mesh, zero_stage=3,
                   mp_policy=mixed_precision_policy(MixedPrecision("bf16-mixed", bench.device.type)),
                   offload_policy=policy)

    # The optimizer steps on the CPU (seconds for 1B parameters): a shorter run than the others.
    run = bench.loop("ZeRO-3 + CPU offload", shard, warmup=1, steps=min(3, bench.args.steps))
    print(f"  offload policy: {type(policy).__name__}"
          + ("" if bench.device.type == "cuda" else " (CPU: offload_policy offloads on CUDA only; ran ZeRO-3 alone)"))
    if run.peak_bytes is not None:
        print(f"  peak {gib(run.peak_bytes)} GiB, allocated before the run {gib(run.baseline_bytes)} GiB,"
              f" step {run.median * 1e3:.2f} ms")
    return [run]


def as_written(bench: Bench):
    """The GPT module re-initialized from the root after the build (nanoGPT's way): not replayable module by
    module, so the strategy takes the exact route (or, under ``model_init="fast"``, the recorded build)."""
    from lightning_3d.models import GPTLightningModule

    class AsWritten(GPTLightningModule):
        def configure_model(self) -> None:
            super().configure_model()
            self.model.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.02)
                             if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) else None)

    return AsWritten(config=bench.config(), learning_rate=3e-4)


SETUP_ROUTES = (  # name, builds its LightningModule, model_init
    ("meta route", Bench.module, "auto"),
    ("exact route (replayed)", as_written, "auto"),
    ("fast route (on the device)", as_written, "fast"),
)


def status_kib(field_name: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    from pathlib import Path

    line = next(li for li in Path("/proc/self/status").read_text().splitlines() if li.startswith(field_name + ":"))
    return int(line.split()[1])


def setup_route(bench: Bench, make_module: Callable[[Bench], object], model_init: str) -> dict:
    """``ThreeDStrategy``'s set-up of one init route, from before ``fit`` to the first batch: seconds, peak
    host memory growth (VmHWM over VmRSS before) and peak device memory, and the device bytes still allocated
    before it began (what an earlier run left: 0 when nothing leaked).

    The module is built here and dropped before returning, with the Trainer that holds it: a route's peaks
    are its own, not also the models of the routes measured before it (the device peak counts every tensor
    alive)."""
    import lightning as L
    from pathlib import Path

    from lightning_3d import ThreeDStrategy

    class SetUp(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.seconds = time.perf_counter() - self.start
            self.host = (status_kib("VmHWM") - self.host_before) * 1024
            self.device = bench.peak_memory()
            trainer.should_stop = True  # set-up measured: no step

    L.seed_everything(0, verbose=False)
    before = bench.reset_memory()
    module = make_module(bench)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    probe = SetUp()
    probe.host_before, probe.start = status_kib("VmRSS"), time.perf_counter()
    trainer = L.Trainer(accelerator=bench.device.type, devices=1, strategy=ThreeDStrategy(model_init=model_init),
                        precision="bf16-mixed", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(module, bench.loader())
    del trainer, module
    bench.reset_memory()
    return {"seconds": probe.seconds, "host_peak_bytes": probe.host, "device_peak_bytes": probe.device,
            "device_before_bytes": before}


def setup_routes(bench: Bench) -> list[Run]:
    for name, make_module, model_init in SETUP_ROUTES:
        route = setup_route(bench, make_module, model_init)
        print(f"set-up, {name}: {route['seconds']:.1f} s, host peak +{gib(route['host_peak_bytes'])} GiB, device"
              f" peak {gib(route['device_peak_bytes'])} GiB (allocated before it:"
              f" {gib(route['device_before_bytes'])} GiB; the model: {gib(bench.config().num_parameters() * 4)}"
              " GiB in fp32)")
    return []


def ensure_process_group(backend: str) -> None:
    """A one-rank default process group, unless an earlier part's Trainer left one (it is reused)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def gib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2 ** 30:.2f}"


def summary(bench: Bench, runs: list[Run], failed: list[str]) -> None:
    print(f"\n{'run':<22} {'step ms':>9} {'tokens/s':>11} {'MFU':>6} {'peak GiB':>9}  steps")
    for run in runs:
        utilization = mfu(bench.flops_per_step, run.median, bench.peak)
        print(f"{run.name:<22} {run.median * 1e3:9.2f} {bench.tokens_per_step / run.median:11.0f}"
              f" {'n/a' if utilization is None else f'{utilization:.3f}':>6} {gib(run.peak_bytes):>9}"
              f"  {len(run.step_times)}")
    if bench.peak is None:
        print("MFU n/a: no bf16 peak known for this device; pass --peak-tflops")
    if failed:
        print(f"FAILED parts: {', '.join(failed)} (tracebacks above)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run every part on CPU with a tiny model")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the three ways (throughput)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (GPU 8, --cpu-smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first, >= 1 (GPU 3, --cpu-smoke 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (GPU default 8)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else 3 if args.cpu_smoke else 8
    args.warmup = args.warmup if args.warmup is not None else 1 if args.cpu_smoke else 3
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown or args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error(f"--parts must be from {PARTS} (got unknown {sorted(unknown)}); --warmup, --steps and"
                     f" --rounds must be >= 1 (got {args.warmup}, {args.steps}, {args.rounds})")
    return args


def require_gpu(script: str, cpu_smoke: bool) -> None:
    """Exit with the reason unless a CUDA GPU is visible or ``--cpu-smoke`` was given."""
    if not cpu_smoke and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU, but torch {torch.__version__} (CUDA build: {torch.version.cuda})"
                 " sees none. Run it on a GPU machine, or with --cpu-smoke to check its code paths on CPU.")


def main() -> None:
    args = parse_args()
    require_gpu("gpu_smoke.py", args.cpu_smoke)
    import logging

    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # per-run set-up lines, x10 runs
    for message in ("does not have many workers", "The `srun` command is available",
                    "You defined a `validation_step` but have no `val_dataloader`"):
        warnings.filterwarnings("ignore", f".*{message}.*")  # true of every run here, said once per run
    started = time.perf_counter()
    bench = Bench(args)
    s = bench.sizes
    memory = "" if args.cpu_smoke else f" ({gib(torch.cuda.get_device_properties(bench.device).total_memory)} GiB)"
    print(f"gpu_smoke: {bench.device_name}{memory}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
          f" lightning {L.__version__}{'  [--cpu-smoke: tiny model on CPU]' if args.cpu_smoke else ''}")
    print(f"GPT n_layer={s.n_layer} n_embd={s.n_embd} n_head={s.n_head} vocab={s.vocab_size} seq={s.seq_len},"
          f" {bench.config().num_parameters() / 1e6:.1f} M parameters ({matmul_weights(s) / 1e6:.1f} M in matmuls);"
          f" batch {s.batch_size} = {bench.tokens_per_step} tokens/step, bf16-mixed, AdamW")
    peak = "unknown" if bench.peak is None else f"{bench.peak / 1e12:g} TFLOP/s"
    print(f"model FLOPs/step {bench.flops_per_step:.3e} ({train_flops_per_token(s) / 1e9:.3f} GFLOP/token),"
          f" bf16 peak {peak}; {args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} rounds")
    parts = {"throughput": throughput, "ac": activation_checkpointing, "comm": comm_timer, "offload": offload,
             "setup": setup_routes}
    runs, failed = [], []
    for name in args.parts.split(","):
        print(f"\n[{name}] {time.perf_counter() - started:.0f} s", flush=True)
        try:  # unattended: one failing part must not cost the others' numbers
            runs += parts[name](bench)
        except Exception:
            import traceback

            traceback.print_exc()
            failed.append(name)
    summary(bench, runs, failed)
    total = time.perf_counter() - started
    print(f"total wall time {total:.0f} s" + (" (over the 5-minute budget)" if total > 300 else ""), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
