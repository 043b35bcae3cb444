"""What a census run came to -- PASS, refused, failed, wrong, unsplit -- judged against one process, and the
table of them.

The tolerances, and why:

* losses within ``LOSS_ATOL`` = 1e-4 of one process at every step (issue 52's bound): the tp and pp runs sum
  the same numbers in another order, a few 1e-7 on a loss of ~4 (the harness' ``assert_parity`` holds its
  own cases to 1e-5). The census' 150 architectures add ops of every kind (soft-capping, routers,
  state-space scans), so the bound leaves a margin of ~100 over rounding, while a wrong gradient shows
  from the second step as 1e-3 or more (Qwen3's unreduced k_norm: 1.1e-3 by step 6, 2.4e-2 on the weight).
* every parameter within ``PARAM_ATOL`` = 1e-4 after the steps: AdamW with eps 1e-3 (``ADAM_EPS``) moves a
  weight by at most lr = 1e-2 per step; a rounding-level gradient error moves it by ~1e-8 per step (see
  ``ADAM_EPS``), a wrong gradient by up to the learning rate. Some models amplify rounding far more: Gemma 4's
  per-layer input projection ends 4.1e-4 from where float64 takes it after 3 steps in one process, so another
  CPU's float32 kernels land 2.4e-4 from it. A run judged wrong by its parameters alone is judged again with
  each parameter allowed twice the distance float32 rounding alone moves the one-process run from float64
  (:func:`rounding_drift`): no layout can be held closer than that.
* every copy alike (``Result.replica_spread``) within ``REPLICA_ATOL`` = 1e-6: the ranks that hold a whole
  tensor (replicated over tp, or a tied weight on two stages) apply the same update to the same value, so
  their copies agree to the last bit or, reduced in another order, to fp32 rounding (~1e-7 of weights of
  size ~1); a gradient left partial on one rank moves that rank's copy by ~1e-3 per step.
* at tp=2, at least ``MIN_TP_SHARE`` = 90% of each rank's block parameters sharded over tp (else the run is
  "unsplit": the numbers may be right, the memory is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.harness import Result

LOSS_ATOL = 1e-4
PARAM_ATOL = 1e-4
REPLICA_ATOL = 1e-6
MIN_TP_SHARE = 0.9
STATUSES = ("PASS", "refused", "failed", "wrong", "unsplit")
"""refused: lightning_3d raised one of its own errors, on purpose, with a reason; failed: anything else raised,
or the launch died or hung; wrong: it trained, to other numbers than one process; unsplit: right numbers at
tp=2 with less than ``MIN_TP_SHARE`` of the block parameters split."""


@dataclass(frozen=True)
class Outcome:
    status: str
    detail: str = ""
    """The reason (refused, failed: the first line of the error) or the numbers (wrong, unsplit)."""

    def cell(self, width: int | None = None) -> str:
        text = self.status + (f": {self.detail}" if self.detail else "")
        return text if width is None or len(text) <= width else text[:width - 3] + "..."


def rounding_drift(reference: Result, exact: Result) -> dict[str, float]:
    """Per parameter, how far float32 rounding alone moved the one-process run (``reference``) from the same run in
    float64 (``exact``) over the steps: how far any other order of the same float32 sums may land."""
    return {name: (tensor.double() - exact.params[name].double()).abs().max().item()
            for name, tensor in reference.params.items() if tensor.is_floating_point()}


def judge(run, reference: Result, layout: str, rounding: dict[str, float] | None = None) -> Outcome:
    """``run`` (a Result, or a ``running.CaseError``) against the one-process ``reference``; with ``rounding``
    (:func:`rounding_drift`), a parameter may also be as far from it as twice one process's own drift."""
    if not isinstance(run, Result):
        lines = [line.strip() for line in run.message.splitlines() if line.strip()] or [""]
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "not split:" and what is not
        if run.refused:
            return Outcome("refused", first)
        return Outcome("failed", f"{run.type.rsplit('.', 1)[-1]}: {first}" + (f" (rank {run.rank})" if run.rank else ""))
    if len(run.losses) != len(reference.losses) or not all(map(math.isfinite, run.losses)):
        return Outcome("wrong", f"losses {run.losses} against {reference.losses}")
    if run.params.keys() != reference.params.keys():
        differ = sorted(set(run.params) ^ set(reference.params))
        return Outcome("failed", f"parameter names differ from one process: {differ[:3]}")
    wrong = []
    loss_gap = max(abs(a - b) for a, b in zip(run.losses, reference.losses))
    if not loss_gap <= LOSS_ATOL:
        wrong.append(f"losses {loss_gap:.1e} apart")
    gaps = {name: (run.params[name].double() - reference.params[name].double()).abs().max().item()
            for name in reference.params if reference.params[name].is_floating_point()}
    over = {name: gap - PARAM_ATOL - 2 * (rounding or {}).get(name, 0.0) for name, gap in gaps.items()}
    worst = max(over, key=over.get, default=None)
    if worst is not None and not over[worst] <= 0:
        wrong.append(f"{worst} {gaps[worst]:.1e} apart")
    apart = max(run.replica_spread, key=run.replica_spread.get, default=None)
    if apart is not None and not run.replica_spread[apart] <= REPLICA_ATOL:
        wrong.append(f"ranks' copies of {apart} {run.replica_spread[apart]:.1e} apart")
    if wrong:
        return Outcome("wrong", "; ".join(wrong))
    share = min(run.tp_sharded_block_share, default=0.0)
    if layout.startswith("tp") and share < MIN_TP_SHARE:
        return Outcome("unsplit", f"{share:.0%} of block parameters split over tp")
    return Outcome("PASS")


def table(rows: dict[str, dict[str, Outcome]], layouts: list[str], width: int | None = 110) -> str:
    """A markdown table, model | one column per layout, and the count of each status per layout."""
    lines = [f"| model | {' | '.join(layouts)} |", f"|---|{'---|' * len(layouts)}"]
    for model, outcomes in rows.items():
        cells = [outcomes[layout].cell(width).replace("|", "/") for layout in layouts]
        lines.append(f"| {model} | {' | '.join(cells)} |")
    lines += ["", f"| {len(rows)} models | {' | '.join(layouts)} |", f"|---|{'---|' * len(layouts)}"]
    for status in STATUSES:
        counts = [sum(outcomes[layout].status == status for outcomes in rows.values()) for layout in layouts]
        lines.append(f"| {status} | {' | '.join(map(str, counts))} |")
    return "\n".join(lines)
