"""The check of a run against its reference, with where its tolerances come from."""

from __future__ import annotations

from helpers.harness.cases import Result


def assert_parity(result: Result, reference: Result, *, loss_atol: float = 1e-5, param_atol: float = 1e-5) -> None:
    """Same per-step losses, global gradient norms (GradNormMonitor) and final parameters (by FQN) as the
    reference.

    Where the sizes come from: a loss (~4, a mean over the batch's tokens summed in another order across dp
    ranks, micro-batches and vocabulary shards) differs by fp32 rounding, a few 1e-7 (seen: <= 1e-6), so
    1e-5 is ten times that; a global gradient norm is a square root of a sum of squares whose order depends
    on the layout: 1e-5 relative is ~100 times fp32's 6e-8; parameters: see ``ADAM_EPS``."""
    assert len(result.losses) == len(reference.losses) > 0, (result.losses, reference.losses)
    assert result.model_parameters == reference.model_parameters > 0
    assert len(result.grad_norms) == len(reference.grad_norms) == len(result.losses)
    for ours, theirs in zip(result.grad_norms, reference.grad_norms):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, theirs), (result.grad_norms, reference.grad_norms)
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert loss_diff <= loss_atol, f"losses differ by {loss_diff:.3g}:\n{result.losses}\n{reference.losses}"
    assert result.params.keys() == reference.params.keys(), (
        sorted(set(result.params) ^ set(reference.params))
    )
    worst = max(result.params, key=lambda k: (result.params[k] - reference.params[k]).abs().max().item())
    param_diff = (result.params[worst] - reference.params[worst]).abs().max().item()
    assert param_diff <= param_atol, f"parameter {worst} differs by {param_diff:.3g} after training"
    # Every rank's copy, not only the one compared: a gradient left unreduced over tp (a replicated weight on
    # split features) lets the copies drift apart while one of them may still look right.
    apart = {name: gap for name, gap in result.replica_spread.items() if gap > param_atol}
    assert not apart, f"ranks hold different copies of {sorted(apart)[:5]}: {apart}"
