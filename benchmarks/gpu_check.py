"""One prepared check for the day a GPU is lent: one command, at most 6 minutes on one H100, one line per part.

    python benchmarks/gpu_check.py [--report PATH] [--parts compile,tp,...] [--peak-tflops 989]
    python benchmarks/gpu_check.py --cpu-smoke   # every part on CPU with a tiny GPT: the code paths only

Each part runs in a process of its own, forked from this one once the imports are done, under its own timeout,
and prints one line: ``PASS`` or ``FAIL``, its name, its seconds and its numbers. A JSON report with every
number goes to ``--report`` (default: ``gpu_check_report.json`` next to this file). The parts
(``gpu_check_parts.py``):

* **compile** -- a ~350M GPT (``lightning_3d.models.GPT``) in bf16-mixed through ``ThreeDStrategy``, eager and
  ``compile=True`` with full activation checkpointing, against a plain PyTorch loop of the same model: losses
  step by step, MFU of each, graphs and graph breaks.
* **tp** -- the tensor-parallel, sequence-parallel and vocabulary-parallel code on a one-rank "tp" mesh under
  autocast: the plain model's loss and gradients without dropout; with dropout, every draw from the tp rank's
  stream (the CUDA generator), the default stream untouched, the same stream state giving the same masks.
* **init_meta**, **init_exact**, **init_fast** -- the three init routes, one process each: set-up seconds,
  host and device peaks.
* **checkpoint** -- with dropout: save after step 3 and resume gives the uninterrupted run's random state
  (CUDA's included) and losses; two asynchronous saves: the loop's stall, the staging copy (pinned on CUDA)
  reused by the second, the values written = the values at the save.
* **layout** -- ``layout="auto"`` with no fixed budget: the budget read against free memory before the
  calibration, the calibration's peak and what it left reserved, its block time against a bf16 timing.

Under ``--cpu-smoke`` the checks whose thresholds hold on a GPU only (MFU, device memory, pinned staging) are
reported, not judged. The exit status is 0 when every part passed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

# A fork-safe CUDA check: CUDA must not be initialized in this process, whose children are forked.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

from gpu_check_parts import PARTS, Context, Outcome  # noqa: E402
from gpu_smoke import require_gpu  # noqa: E402

DEFAULT_REPORT = Path(__file__).with_name("gpu_check_report.json")
CPU_SMOKE_TIMEOUT_S = 120  # per part: tiny models, but two loaded cores and inductor's compile on CPU
NOT_PROVEN = (
    "multi-rank NCCL: every collective here runs in a one-rank group (tp, SP and the vocabulary-parallel loss"
    " are local), so NCCL's correctness, overlap and hangs across GPUs are untested",
    "pipeline parallelism (two stages at least), data parallel and ZeRO/HSDP at dp > 1: a rank's share, the"
    " gradient reduction and FSDP2's all-gathers across GPUs",
    "multi-node: Slurm, inter-node bandwidth, the planner's link fits, a checkpoint committed after every"
    " rank's write",
    "layout=\"auto\" choosing tp, pp or dp: with one rank it can only choose recompute and micro-batches",
)


def run_part(name: str, ctx: Context, conn) -> None:
    """In the part's own process: run it and send back its outcome, or the traceback it raised."""
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for message in ("does not have many workers", "The `srun` command is available",
                    "You defined a `validation_step` but have no `val_dataloader`"):
        warnings.filterwarnings("ignore", f".*{message}.*")
    try:
        if not ctx.cpu_smoke:  # the CUDA context first, so that no part's host peak counts its creation
            torch.cuda.set_device(0)
            torch.empty(1, device="cuda")
        outcome = asdict(PARTS[name][0](ctx))
        outcome["numbers"]["device_name"] = "CPU" if ctx.cpu_smoke else torch.cuda.get_device_name(0)
        conn.send(("ok", outcome))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def one_part(name: str, ctx: Context, timeout_s: float, start: str) -> dict[str, Any]:
    """Run part ``name`` in a child process, killed after ``timeout_s``; its result as the report keeps it."""
    mp = multiprocessing.get_context(start)
    receive, send = mp.Pipe(duplex=False)
    sys.stdout.flush()
    process = mp.Process(target=run_part, args=(name, ctx, send), name=f"gpu_check-{name}")
    started = time.perf_counter()
    process.start()
    send.close()
    result: dict[str, Any] = {"timeout_s": timeout_s}
    if receive.poll(timeout_s):
        try:
            kind, payload = receive.recv()
        except EOFError:  # the process died without a word (killed, segfault)
            kind, payload = "error", "the part's process ended without a result"
    else:
        kind, payload = "error", f"timed out after {timeout_s:.0f} s"
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    result["seconds"] = time.perf_counter() - started
    if kind == "error":
        return {**result, "status": "FAIL", "error": payload, "summary": payload.strip().splitlines()[-1]}
    outcome = Outcome(**payload)
    judged = {k: v for k, v in outcome.checks.items() if not (ctx.cpu_smoke and k in outcome.gpu_only)}
    failed = [k for k, ok in judged.items() if not ok]
    return {**result, "status": "FAIL" if failed else "PASS", "failed": failed, "summary": outcome.summary,
            "checks": outcome.checks, "judged": sorted(judged), "numbers": outcome.numbers}


def line(name: str, result: dict[str, Any]) -> str:
    failed = f" [failed: {', '.join(result['failed'])}]" if result.get("failed") else ""
    return f"{result['status']} {name} ({result['seconds']:.0f} s): {result['summary']}{failed}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="every part on CPU with a tiny GPT")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT, help="where the JSON report goes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every part's timeout")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="how part processes start (spawn: a fresh interpreter each, slower)")
    args = parser.parse_args()
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown or args.timeout_scale < 0:
        parser.error(f"--parts must be from {', '.join(PARTS)} (unknown: {', '.join(sorted(unknown)) or 'none'});"
                     f" --timeout-scale must be >= 0 (got {args.timeout_scale})")
    return args


def main() -> None:
    args = parse_args()
    require_gpu("gpu_check.py", args.cpu_smoke)
    import lightning  # noqa: F401  (imported once here: every forked part starts with it loaded)

    import lightning_3d  # noqa: F401

    if args.start == "fork" and torch.cuda.is_initialized():  # a forked child could not use CUDA then
        print("gpu_check: CUDA was initialized by the imports; parts start with spawn instead of fork")
        args.start = "spawn"
    ctx = Context(cpu_smoke=args.cpu_smoke, peak_tflops=args.peak_tflops)
    names = args.parts.split(",")
    timeouts = {name: (CPU_SMOKE_TIMEOUT_S if args.cpu_smoke else PARTS[name][1]) * args.timeout_scale
                for name in names}
    device = "CPU (--cpu-smoke: tiny GPT)" if args.cpu_smoke else f"CUDA device 0 of {torch.cuda.device_count()}"
    print(f"gpu_check: {device}, torch {torch.__version__} (CUDA {torch.version.cuda}), lightning"
          f" {lightning.__version__}; parts {', '.join(names)}; at most {sum(timeouts.values()):.0f} s", flush=True)
    started, results = time.perf_counter(), {}
    for name in names:
        print(f"\n[{name}] {time.perf_counter() - started:.0f} s, timeout {timeouts[name]:.0f} s", flush=True)
        results[name] = one_part(name, ctx, timeouts[name], args.start)
        if "error" in results[name]:
            print(results[name]["error"], flush=True)
        print(line(name, results[name]), flush=True)
    total = time.perf_counter() - started
    print(f"\n== gpu_check: {sum(r['status'] == 'PASS' for r in results.values())} of {len(results)} parts passed"
          f" in {total:.0f} s")
    for name, result in results.items():
        print(line(name, result))
    print("What one GPU cannot prove:\n" + "\n".join(f"  - {item}" for item in NOT_PROVEN))
    names_seen = {r["numbers"]["device_name"] for r in results.values() if "numbers" in r}
    report = {"device": ", ".join(sorted(names_seen)) or device, "torch": torch.__version__, "cuda": torch.version.cuda, "cpu_smoke": args.cpu_smoke,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "total_s": total, "parts": results,
              "not_proven": list(NOT_PROVEN)}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"report: {args.report}", flush=True)
    sys.exit(0 if all(r["status"] == "PASS" for r in results.values()) else 1)


if __name__ == "__main__":
    main()
