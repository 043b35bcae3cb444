"""ZeRO stages 1, 2, 3 (FSDP2 over "dp") match one process, step by step, with tp and pp > 1.

Per-step losses, global gradient norms and all parameters after ``SWEEP_STEPS`` (3) AdamW steps, gathered by
their single-device names, at atol 1e-5 -- for each stage at (dp, pp, tp) = (2,1,1) (2,1,2) (2,2,1) (2,2,2),
under 1F1B, GPipe and interleaved 1F1B, with gradient clipping by the global norm, with accumulation, with
sequence parallelism and with activation checkpointing.
One launch per world size runs every case of that size."""

import pytest

from helpers.harness import SWEEP_STEPS, Case, assert_parity, launch_by_world_size, reference_for

pytestmark = pytest.mark.multiprocess

GPT4 = dict(n_layer=4, n_embd=32, n_head=4, block_size=16)  # 4 blocks: pp=2 x 2 virtual stages
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def zero_case(zero, dp, pp, tp, schedule="1f1b", **kwargs):
    strategy = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, zero_stage=zero)
    if pp > 1:
        strategy.update(pipeline_schedule=schedule, virtual_pipeline_size=VIRTUAL[schedule], num_microbatches=4)
    name = f"zero{zero}_dp{dp}_pp{pp}_tp{tp}" + (f"_{schedule}" if pp > 1 else "")
    name += "".join(f"_{k}{v}" for k, v in kwargs.items())
    return Case(name=name, dp=dp, strategy_kwargs=strategy, steps=SWEEP_STEPS, model=GPT4, learning_rate=3e-3,
                **kwargs)


LAYOUTS = [(2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2)]  # (dp, pp, tp)
CASES = [zero_case(zero, *layout) for layout in LAYOUTS for zero in (1, 2, 3)]
CASES += [
    zero_case(3, 2, 2, 1, "gpipe"),
    zero_case(2, 2, 2, 1, "interleaved_1f1b"),
    zero_case(3, 2, 2, 2, "interleaved_1f1b"),
    zero_case(3, 2, 1, 1, gradient_clip_val=0.3),  # the global norm over dp shards
    zero_case(2, 2, 1, 2, gradient_clip_val=0.3),  # ... over (dp, tp) shards
    zero_case(3, 2, 2, 2, gradient_clip_val=0.3),  # ... and stages
    zero_case(3, 2, 1, 1, accumulate_grad_batches=2),  # gradients accumulate unsharded, reduced once
    zero_case(2, 2, 2, 1, accumulate_grad_batches=2),
]
# Gradients reduce-scattered per micro-batch under the pipeline, not once per step.
for case in [zero_case(2, 2, 2, 1), zero_case(3, 2, 2, 1, accumulate_grad_batches=2),
             zero_case(3, 2, 2, 2, "interleaved_1f1b")]:
    case.strategy_kwargs["pipeline_reduce_grads"] = "per_microbatch"
    case.name += "_per_microbatch"
    CASES.append(case)
# Composed with sequence parallelism and activation checkpointing.
for zero, (dp, pp, tp), suffix, extra in [(3, (2, 1, 2), "sp", dict(sequence_parallel=True)),
                                          (3, (2, 1, 2), "full_ac", dict(activation_checkpointing="full")),
                                          (2, (2, 2, 1), "selective_ac", dict(activation_checkpointing="selective"))]:
    CASES.append(zero_case(zero, dp, pp, tp))
    CASES[-1].strategy_kwargs.update(extra)
    CASES[-1].name += f"_{suffix}"
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_by_world_size(CASES, tmp_path_factory.mktemp("parity_zero"))


@pytest.mark.parametrize("name", list(BY_NAME))
def test_zero_matches_single_process(name, results):
    result, reference = results[name], reference_for(BY_NAME[name])
    assert_parity(result, reference)
    assert max(abs(a - b) for a, b in zip(result.logged, reference.logged)) <= 1e-5, (result.logged, reference.logged)
