"""Tensor (and sequence) parallel matches one process, step by step, alone and combined with data parallel,
with gradient clipping by the global norm too.

One launch per world size runs every case of that size."""

import pytest

from helpers.harness import Case, assert_parity, launch, reference_for

pytestmark = pytest.mark.multiprocess


# Small enough to clip at every step (the tiny GPT's gradient norm is about 1): see test_clipping_is_active.
CLIP_NORM, CLIP_VALUE = 0.3, 0.01


def tp_case(name, tp, dp=1, **kwargs):
    strategy_kwargs = {"tensor_parallel_size": tp, **kwargs.pop("strategy_kwargs", {})}
    return Case(name=name, dp=dp, strategy_kwargs=strategy_kwargs, steps=5, **kwargs)


WORLD_2 = [
    tp_case("tp2", 2),
    tp_case("tp2_sp", 2, strategy_kwargs=dict(sequence_parallel=True)),
    tp_case("tp2_gathered_logits", 2, strategy_kwargs=dict(vocab_parallel_loss=False)),
    tp_case("tp2_eager_init", 2, module="gpt_eager"),
    tp_case("tp2_user_policy", 2, module="toy", strategy_kwargs=dict(policy="toy")),
    tp_case("tp2_auto_policy_unknown_model", 2, module="toy", strategy_kwargs=dict(policy="auto")),
    tp_case("tp2_clip_norm", 2, gradient_clip_val=CLIP_NORM),
    tp_case("tp2_sp_clip_value", 2, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value",
            strategy_kwargs=dict(sequence_parallel=True)),
    tp_case("dp2_clip_norm", 1, dp=2, gradient_clip_val=CLIP_NORM),
]
WORLD_4 = [
    tp_case("tp4", 4),
    tp_case("tp4_sp", 4, strategy_kwargs=dict(sequence_parallel=True)),
    tp_case("dp2_tp2", 2, dp=2),
    tp_case("dp2_tp2_sp", 2, dp=2, strategy_kwargs=dict(sequence_parallel=True)),
    tp_case("dp2_tp2_accumulate2", 2, dp=2, accumulate_grad_batches=2),
    tp_case("dp2_tp2_sp_clip_norm", 2, dp=2, gradient_clip_val=CLIP_NORM, strategy_kwargs=dict(sequence_parallel=True)),
]
CASES = {c.name: c for c in WORLD_2 + WORLD_4}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity_tp")
    return {**launch(WORLD_2, 2, out / "world2"), **launch(WORLD_4, 4, out / "world4")}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name, results):
    assert_parity(results[name], reference_for(CASES[name]))


def test_clipping_is_active():
    """The clipping cases above would prove nothing if the thresholds never clipped."""
    plain = reference_for(tp_case("plain", 1))
    for kwargs in (dict(gradient_clip_val=CLIP_NORM), dict(gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")):
        clipped = reference_for(tp_case("clipped", 1, **kwargs))
        assert abs(clipped.losses[-1] - plain.losses[-1]) > 1e-3, kwargs
