"""The parts of ``gpu_check.py``: each trains or sets up on one device and returns an :class:`Outcome`.

A part runs in a process of its own (``gpu_check.py`` forks it), so its device and host peaks are its own and a
crash, a hang or a CUDA error stays in it. Every part runs on CPU with tiny sizes under ``--cpu-smoke``; checks
whose threshold only means something on a GPU (MFU, memory against free device memory, pinned staging) are
listed in ``Outcome.gpu_only`` and reported, not judged, there.
"""

from __future__ import annotations

import copy
import math
import shutil
import statistics
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gpu_smoke import (CPU_SIZES, SETUP_ROUTES, Bench, Sizes, ensure_process_group, gib, mfu, setup_route,
                       status_kib)

MODEL_350M = Sizes(n_layer=20, n_embd=1024, n_head=16, vocab_size=50304, seq_len=1024, batch_size=8)  # 3.55e8
TP_SIZES = Sizes(n_layer=4, n_embd=1024, n_head=16, vocab_size=50304, seq_len=1024, batch_size=4)
CHECKPOINT_SIZES = Sizes(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, seq_len=1024, batch_size=4)  # 1.6e8

# bf16 keeps 8 bits of mantissa: one rounding is up to 2^-8 = 0.4% relative. A loss averaged over thousands of
# tokens, after a few steps in which the two sides round in a different order (inductor's fused kernels, the
# vocabulary-parallel log-softmax), stays within a few of those; a block skipped, a recompute that replays
# different values or a wrong shard moves it by far more.
BF16_LOSS_RTOL = 2e-2
BF16_GRAD_RTOL = 3e-2  # per tensor, ||g - g_ref|| / ||g_ref||: the same roundings, on sums over the batch


@dataclass
class Outcome:
    """What one part found."""

    summary: str
    """One line: the part's numbers, for the PASS / FAIL line."""
    checks: dict[str, Optional[bool]] = field(default_factory=dict)
    """Named checks, True where the behaviour is what it should be; None where this device cannot measure it."""
    numbers: dict[str, Any] = field(default_factory=dict)
    """Everything measured, for the JSON report (bytes, seconds, ratios)."""
    gpu_only: set[str] = field(default_factory=set)
    """Checks judged on a GPU only: under --cpu-smoke their value is reported, not judged."""


@dataclass(kw_only=True)
class Context:
    """What every part shares: the device and the settings of the command line."""

    cpu_smoke: bool
    peak_tflops: Optional[float] = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_smoke else torch.device("cuda", 0)

    def sizes(self, gpu: Sizes) -> Sizes:
        return CPU_SIZES if self.cpu_smoke else gpu

    def bench(self, gpu: Sizes, warmup: int, steps: int) -> Bench:
        """gpu_smoke.py's harness (Trainer runs and a plain loop, bf16-mixed, step times, losses, peaks)."""
        args = Namespace(cpu_smoke=self.cpu_smoke, batch_size=None, peak_tflops=self.peak_tflops,
                         warmup=warmup, steps=steps)
        return Bench(args, self.sizes(gpu))


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compile_and_ac(ctx: Context) -> Outcome:
    """bf16-mixed eager, and ``compile=True`` with full activation checkpointing, through ``ThreeDStrategy``
    against a plain PyTorch loop of the same model: losses step by step, MFU, peaks, graphs compiled."""
    import torch._dynamo.utils as dynamo_utils

    from lightning_3d import ThreeDStrategy

    bench = ctx.bench(MODEL_350M, warmup=1 if ctx.cpu_smoke else 3, steps=2 if ctx.cpu_smoke else 10)
    eager = bench.fit("eager", ThreeDStrategy())
    dynamo_utils.counters.clear()
    compiled = bench.fit("compile + full AC", ThreeDStrategy(compile=True, activation_checkpointing="full"))
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    breaks = sum(dynamo_utils.counters["graph_break"].values())
    raw = bench.loop("raw loop")
    loss_diff = max(rel(c, e) for c, e in zip(compiled.losses, eager.losses))
    utilization = {run.name: mfu(bench.flops_per_step, run.median, bench.peak) for run in (eager, compiled, raw)}
    numbers = {"parameters": bench.config().num_parameters(), "tokens_per_step": bench.tokens_per_step,
               "loss_max_rel_diff": loss_diff, "graphs": graphs, "graph_breaks": breaks,
               "eager_over_raw_step": eager.median / raw.median}
    for run in (eager, compiled, raw):
        key = run.name.replace(" + ", "_").replace(" ", "_")
        numbers.update({f"{key}_step_s": run.median, f"{key}_mfu": utilization[run.name],
                        f"{key}_peak_bytes": run.peak_bytes, f"{key}_losses": run.losses})
    mfu_text = ("MFU n/a (no bf16 peak)" if bench.peak is None else
                "MFU " + ", ".join(f"{name} {value:.3f}" for name, value in utilization.items()))
    eager_mfu, compiled_mfu, raw_mfu = (utilization[r.name] or 0.0 for r in (eager, compiled, raw))
    return Outcome(
        summary=f"{numbers['parameters'] / 1e6:.3g}M GPT; loss compiled+AC vs eager max rel diff {loss_diff:.1e};"
                f" {mfu_text}; step eager / raw {numbers['eager_over_raw_step']:.3f}; {graphs} graphs,"
                f" {breaks} graph breaks",
        checks={"losses_agree": loss_diff <= BF16_LOSS_RTOL,
                "blocks_compiled_without_graph_breaks": graphs >= 1 and breaks == 0,
                "losses_finite": all(map(math.isfinite, eager.losses + compiled.losses)),
                # The strategy adds a step's bookkeeping to the same kernels: within 10% of the plain loop.
                "eager_mfu_within_10pct_of_raw": eager_mfu >= 0.9 * raw_mfu > 0,
                # Full recompute runs each block's forward twice: 3/4 of eager's MFU without compile's gains.
                # Below 0.7 the recompute or the compiled graph costs more than that.
                "compiled_ac_mfu_at_least_0.7_eager": compiled_mfu >= 0.7 * eager_mfu > 0},
        numbers=numbers, gpu_only={"eager_mfu_within_10pct_of_raw", "compiled_ac_mfu_at_least_0.7_eager"})


def tp_one_rank(ctx: Context) -> Outcome:
    """The tensor-parallel, sequence-parallel and vocabulary-parallel code on a one-rank "tp" mesh, under
    autocast: without dropout it gives the plain model's loss and gradients; with dropout every draw comes from
    the tp rank's stream (ShardedRNG: the CUDA generator on a GPU), the default stream is left as it was, and
    the same stream state gives the same masks."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_3d.models import GPT
    from lightning_3d.parallel.loss import vocab_parallel_loss
    from lightning_3d.parallel.rng import SHARDED_SEED_OFFSET, ShardedRNG, apply_sharded_rng
    from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel
    from lightning_3d.policies.base import PlanOptions
    from lightning_3d.policies.gpt import GPTPolicy
    from lightning_3d.strategies.processes import backend_for

    device, bench = ctx.device, ctx.bench(TP_SIZES, warmup=1, steps=1)
    ensure_process_group(backend_for(device, "nccl" if device.type == "cuda" else "gloo"))
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    tokens, targets = (t.to(device) for t in bench.data[:bench.sizes.batch_size])

    def built(dropout: float) -> tuple[torch.nn.Module, torch.nn.Module, ShardedRNG, list[str]]:
        torch.manual_seed(0)
        with torch.device(device):
            plain = GPT(replace(bench.config(), dropout=dropout))
        model = copy.deepcopy(plain)
        # The policy plans nothing at tp = 1 (nothing to split). Its tp = 2 plan -- the styles do not depend
        # on the size -- applied on a one-rank mesh runs every DTensor path of tp, SP and the sharded head.
        plan = GPTPolicy().plan(model, PlanOptions(tp=2, sequence_parallel=True, vocab_parallel_loss=True))
        apply_tensor_parallel(model, plan, mesh["tp"])
        rng = ShardedRNG(SHARDED_SEED_OFFSET, device)
        apply_sharded_rng(model, plan.sharded_rng_regions, rng)
        return plain, model, rng, plan.sharded_rng_regions

    def step(model: torch.nn.Module) -> float:
        """As the strategy runs a step: autocast over forward and loss (Lightning's bf16-mixed), the
        loss-parallel ops on over the loss and its backward."""
        with vocab_parallel_loss():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
        return float(loss.detach())

    def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
                for name, p in model.named_parameters()}

    def default_state() -> list[torch.Tensor]:
        return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])

    plain, model, _, _ = built(dropout=0.0)
    plain_loss, tp_loss = step(plain), step(model)
    reference = grads(plain)
    grad_diff = max(float((g - reference[n]).norm() / reference[n].norm().clamp_min(1e-12))
                    for n, g in grads(model).items())

    _, model, rng, regions = built(dropout=0.1)
    default_before, sharded_before = default_state(), copy.deepcopy(rng.state_dict())
    first = [step(model) for _ in range(2)]
    default_unchanged = all(torch.equal(a, b) for a, b in zip(default_before, default_state()))
    sharded_moved = not all(torch.equal(a, b) for a, b in zip(sharded_before["state"], rng.state_dict()["state"]))
    finite = all(bool(torch.isfinite(g).all()) for g in grads(model).values())
    rng.load_state_dict(sharded_before)
    again = [step(model) for _ in range(2)]  # the same stream state: the same masks, the same losses
    stream = "the CUDA generator's" if device.type == "cuda" else "the host generator's"
    return Outcome(
        summary=f"no dropout: loss rel diff {rel(tp_loss, plain_loss):.1e}, grads max rel diff {grad_diff:.1e};"
                f" dropout 0.1 in {len(regions)} sharded regions: {stream} default stream"
                f" {'untouched' if default_unchanged else 'MOVED'}, the tp stream"
                f" {'advanced' if sharded_moved else 'DID NOT ADVANCE'}, replay {'equal' if first == again else 'DIFFERS'}",
        checks={"loss_equals_plain": rel(tp_loss, plain_loss) <= BF16_LOSS_RTOL,
                "grads_equal_plain": grad_diff <= BF16_GRAD_RTOL, "default_stream_untouched": default_unchanged,
                "tp_stream_advanced": sharded_moved, "same_stream_same_masks": first == again,
                "dropout_grads_finite": finite},
        numbers={"plain_loss": plain_loss, "tp_loss": tp_loss, "grad_max_rel_diff": grad_diff,
                 "dropout_losses": first, "dropout_losses_replayed": again, "sharded_regions": regions})


def init_route(index: int) -> Callable[[Context], Outcome]:
    """One of gpu_smoke.py's three init routes on the ~350M GPT, alone in its process: set-up seconds, host
    and device peaks from before ``fit`` to the first batch."""
    name, make_module, model_init = SETUP_ROUTES[index]

    def part(ctx: Context) -> Outcome:
        bench = ctx.bench(MODEL_350M, warmup=1, steps=1)
        model_bytes = bench.config().num_parameters() * 4
        route = setup_route(bench, make_module, model_init)
        host, device = route["host_peak_bytes"], route["device_peak_bytes"]
        # A rank's set-up holds its share plus a small working set (DESIGN.md), never the model twice. bf16-mixed
        # keeps fp32 weights: the share is the whole fp32 model at one rank. The host's 512 MiB: Lightning's
        # and the strategy's own set-up (logging, process group, the loader), with no model in it.
        return Outcome(
            summary=f"{name}, model_init={model_init!r}: {route['seconds']:.1f} s, host peak +{gib(host)} GiB,"
                    f" device peak {gib(device)} GiB (the model {gib(model_bytes)} GiB in fp32)",
            checks={"host_peak_under_1.25x_model": host <= 1.25 * model_bytes + 2**29,
                    "device_peak_under_1.5x_model": None if device is None else device <= 1.5 * model_bytes},
            numbers={**route, "model_bytes": model_bytes, "route": name, "model_init": model_init},
            gpu_only={"device_peak_under_1.5x_model"})

    return part


def checkpoint_resume_async(ctx: Context) -> Outcome:
    """With dropout on: a run saved after step 3 and resumed gives the uninterrupted run's random state (host
    and CUDA generators) at every step and its losses; two asynchronous saves: how long each held the loop,
    the host memory each added (the first allocates the staging copy -- pinned on CUDA -- the second reuses
    it), and the values each wrote against the model's values when it was called."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.checkpoint.convert import consolidate
    from lightning_3d.models import GPTLightningModule

    bench = ctx.bench(CHECKPOINT_SIZES, warmup=1, steps=5)  # 6 batches
    config = replace(bench.config(), dropout=0.1)
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_ckpt_"))
    steps, resume_at, async_at = 6, 3, (2, 4)

    def random_state() -> list[bytes]:
        states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if bench.device.type == "cuda" else [])
        return [bytes(s.numpy()) for s in states]

    class Record(L.Callback):
        """Every step's loss and the random state it starts from; saves after the steps in ``save_at``,
        recording what the model held, the seconds the call held the loop and the host memory it added."""

        def __init__(self, save_at: tuple = ()) -> None:
            self.save_at, self.losses, self.states, self.saves = save_at, [], [], []

        def on_train_batch_start(self, *_args) -> None:
            self.states.append(random_state())

        def on_train_batch_end(self, trainer, pl_module, outputs, *_args) -> None:
            self.losses.append(float(outputs["loss"]))
            if trainer.global_step not in self.save_at:
                return
            path = folder / f"{len(self.saves)}-step{trainer.global_step}.ckpt"
            waited = 0.0
            if self.saves:  # let the previous save finish (its directory appears once committed): the stall
                started = time.perf_counter()  # measured is this save's own, not a wait for the previous one
                while not self.saves[-1]["path"].exists() and time.perf_counter() - started < 120:
                    time.sleep(0.01)
                waited = time.perf_counter() - started
            values = {k: v.detach().to("cpu", copy=True) for k, v in pl_module.model.state_dict().items()}
            rss, started = status_kib("VmRSS"), time.perf_counter()
            trainer.save_checkpoint(path)
            self.saves.append({"path": path, "stall_s": time.perf_counter() - started, "values": values,
                               "host_added_bytes": (status_kib("VmRSS") - rss) * 1024,
                               "previous_write_s": waited})

    def train(strategy, record: Record, ckpt_path: Optional[Path] = None) -> Any:
        L.seed_everything(0, verbose=False)
        module = GPTLightningModule(config=config, learning_rate=3e-4, warmup_steps=2)
        L.Trainer(accelerator=bench.device.type, devices=1, strategy=strategy, precision="bf16-mixed",
                  max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                  callbacks=[record]).fit(module, bench.loader(), ckpt_path=ckpt_path)
        return module

    whole = Record(save_at=(resume_at,))
    train(ThreeDStrategy(), whole)
    resumed = Record()
    train(ThreeDStrategy(), resumed, ckpt_path=whole.saves[0]["path"])
    same_states = resumed.states == whole.states[resume_at:]
    loss_diffs = [rel(r, w) for r, w in zip(resumed.losses, whole.losses[resume_at:])]

    asynchronous = Record(save_at=async_at)
    module = train(ThreeDStrategy(async_checkpoint=True), asynchronous)
    written_equal = []
    for save in asynchronous.saves:
        consolidate(save["path"], folder / "model.pt", strip_prefix="model.")
        written = torch.load(folder / "model.pt")
        written_equal.append(all(torch.equal(written[k], v) for k, v in save["values"].items()))
    final = module.model.state_dict()
    moved = any(not torch.equal(final[k].cpu(), v) for k, v in asynchronous.saves[-1]["values"].items())
    shutil.rmtree(folder, ignore_errors=True)  # ~6 GB of checkpoints at the GPU sizes
    first, second = asynchronous.saves
    state_bytes = 3 * config.num_parameters() * 4  # fp32 weights and AdamW's two moments
    sync_s = whole.saves[0]["stall_s"]
    return Outcome(
        summary=f"resume at step {resume_at} with dropout: random state {'equal' if same_states else 'DIFFERS'}"
                f" at every step, losses max rel diff {max(loss_diffs):.1e}; sync save {sync_s:.2f} s; async"
                f" stalls {first['stall_s']:.2f} s then {second['stall_s']:.2f} s, host added"
                f" {gib(first['host_added_bytes'])} then {gib(second['host_added_bytes'])} GiB (state"
                f" {gib(state_bytes)} GiB); written = values at save time: {written_equal}",
        checks={"resumed_random_state_equal": same_states and len(resumed.states) == steps - resume_at,
                "resumed_first_loss_equal": loss_diffs[0] <= 1e-6,
                "resumed_losses_close": max(loss_diffs) <= 1e-3,
                "async_written_values_are_values_at_save": all(written_equal) and moved,
                # The second save copies into the first's staging buffers: no new host memory, a shorter stall.
                "async_staging_reused": second["host_added_bytes"] <= 0.25 * state_bytes,
                "async_stall_under_half_sync": second["stall_s"] <= 0.5 * sync_s},
        numbers={"sync_save_s": sync_s, "state_bytes": state_bytes, "resumed_loss_rel_diffs": loss_diffs,
                 "async_saves": [{k: v for k, v in s.items() if k not in ("values", "path")} for s in
                                 asynchronous.saves], "weights_moved_after_save": moved},
        gpu_only={"async_staging_reused", "async_stall_under_half_sync"})


def layout_auto(ctx: Context) -> Outcome:
    """``layout="auto"`` with no fixed budget on the ~350M GPT: the budget it read against the device's free
    memory before the calibration, the calibration's peak and what it left allocated, and its block time
    against a bf16 timing of the same block here."""
    import lightning as L

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models.gpt import Block
    from lightning_3d.parallel.memory import host_memory_available
    from lightning_3d.strategies import auto_layout

    bench = ctx.bench(MODEL_350M, warmup=1, steps=4)
    device, cuda = ctx.device, ctx.device.type == "cuda"
    seen: dict[str, Any] = {}
    decide = auto_layout.decide

    def watched_decide(*args, **kwargs):
        """The decision as the strategy makes it, with the device's memory read around it."""
        seen["free_before"] = torch.cuda.mem_get_info(device)[0] if cuda else host_memory_available()
        seen["reserved_before"] = torch.cuda.memory_reserved(device) if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        decision = decide(*args, **kwargs)
        seen["peak"] = torch.cuda.max_memory_allocated(device) if cuda else None
        seen["reserved_after"] = torch.cuda.memory_reserved(device) if cuda else None
        return decision

    # The decision runs inside the strategy's set-up, with no hook in between: the module's function is
    # wrapped in this process only.
    auto_layout.decide = watched_decide
    # The prediction is set against the measured step here (both in the report); the strategy's own check, a
    # warning past 25%, is left out of this short run: on CPU's steps of milliseconds it warns as a rule.
    strategy = ThreeDStrategy(layout="auto", layout_check_steps=10_000)
    run = bench.fit("layout auto", strategy)
    decision = strategy.layout_decision
    timed = decision.calibration.block_seconds_per_token
    micro = max((m for m in timed if m <= bench.sizes.batch_size), default=min(timed))
    block_s = bf16_block_seconds_per_token(Block(bench.config()).to(device), micro, bench.sizes.seq_len, device)
    budget_share = decision.memory_per_rank / seen["free_before"]
    left = None if not cuda else seen["reserved_after"] - seen["reserved_before"]
    numbers = {"budget_bytes": decision.memory_per_rank, "free_before_bytes": seen["free_before"],
               "budget_over_free": budget_share, "calibration_peak_bytes": seen["peak"],
               "calibration_left_reserved_bytes": left, "micro_batch": micro,
               "calibrated_block_s_per_token": timed[micro], "bf16_block_s_per_token": block_s,
               "calibrated_over_bf16": timed[micro] / block_s, "layout": decision.layout.describe(),
               "predicted_step_s": decision.predicted_step_s, "measured_step_s": run.median}
    return Outcome(
        summary=f"chose {numbers['layout']}; budget {gib(decision.memory_per_rank)} GiB of"
                f" {gib(seen['free_before'])} free ({budget_share:.3f}); calibration peak {gib(seen['peak'])} GiB,"
                f" left reserved {gib(left)} GiB; block at micro-batch {micro}: calibrated / bf16"
                f" {numbers['calibrated_over_bf16']:.2f}; step predicted {decision.predicted_step_s * 1e3:.0f} ms,"
                f" measured {run.median * 1e3:.0f} ms",
        checks={"chose_a_layout_and_trained": decision.predicted_step_s > 0 and len(run.step_times) > 0,
                "calibration_timed_the_block": all(t > 0 for t in timed.values()),
                "budget_is_free_memory_before_calibration": 0.95 <= budget_share <= 1.01,
                "calibration_released": None if left is None else left <= 2**26,
                "calibration_peak_within_budget": None if not cuda else seen["peak"] <= decision.memory_per_rank,
                "calibrated_block_within_2x_of_bf16": 0.5 <= numbers["calibrated_over_bf16"] <= 2.0,
                "step_within_25pct_of_prediction": rel(run.median, decision.predicted_step_s) <= auto_layout.MISMATCH},
        numbers=numbers,
        gpu_only={"budget_is_free_memory_before_calibration", "calibration_released",
                  "calibration_peak_within_budget", "calibrated_block_within_2x_of_bf16",
                  "step_within_25pct_of_prediction"})


def bf16_block_seconds_per_token(block: torch.nn.Module, micro_batch: int, seq_len: int,
                                 device: torch.device, repeats: int = 10) -> float:
    """Forward and backward of ``block`` under bf16 autocast, seconds per token (median of ``repeats``)."""
    x = torch.randn(micro_batch, seq_len, block.ln_1.normalized_shape[0], device=device, requires_grad=True)
    times = []
    for i in range(repeats + 2):  # two untimed: kernels chosen, memory cached
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = block(x)
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times) / (micro_batch * seq_len)


PARTS: dict[str, tuple[Callable[[Context], Outcome], int]] = {  # name: (the part, its timeout on one H100, s)
    "compile": (compile_and_ac, 120),  # inductor compiles a block's forward and backward: most of it
    "tp": (tp_one_rank, 30),
    "init_meta": (init_route(0), 25),
    "init_exact": (init_route(1), 25),
    "init_fast": (init_route(2), 25),
    "checkpoint": (checkpoint_resume_async, 60),
    "layout": (layout_auto, 60),
}
