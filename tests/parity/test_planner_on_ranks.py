"""The planner's memory model against what our own runs hold on 4 gloo ranks (helpers/workers/planner_worker.py):
parameters, gradients, optimizer state and saved activations per rank, at twelve layouts (dp, pp, tp; cp), within
5%."""

import json

import pytest

from lightning_3d.models import GPTConfig
from lightning_3d.planner import PRECISIONS, Layout, ModelSpec, estimate_memory

CONFIG = dict(n_layer=4, n_embd=64, n_head=4, block_size=32)
FP32 = PRECISIONS["32-true"]


# Layouts of the reference GPT run on 4 gloo ranks; batch_size is per data-parallel replica.
MEASURED = [
    dict(name="dp2_tp2_sp_zero2", batch_size=4,
         strategy=dict(data_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True, zero_stage=2)),
    dict(name="pp2_tp2_1f1b", batch_size=8,
         strategy=dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4)),
    dict(name="pp4_gpipe", batch_size=8,
         strategy=dict(pipeline_parallel_size=4, pipeline_schedule="gpipe", num_microbatches=4)),
    dict(name="dp2_pp2_selective", batch_size=4,
         strategy=dict(data_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2,
                       activation_checkpointing="selective")),
    dict(name="dp4_zero3_full", batch_size=4, strategy=dict(data_parallel_size=4, zero_stage=3,
                                                            activation_checkpointing="full")),
    # Two chunks per rank: zero bubble holds the last rank's chunks until their deferred weight gradients, less
    # the loss, which the input gradient frees. A large vocabulary, as the layout sweep's vocab GPT, makes the
    # loss the largest part. Fails if a logged loss keeps its graph until the step's end (the engine's
    # recorded self.log values), or if SavedActivations keeps what a retain_graph backward left.
    dict(name="dp2_pp2_zero_bubble_v2", batch_size=8, model={**CONFIG, "vocab_size": 4096},
         strategy=dict(data_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="zero_bubble",
                       virtual_pipeline_size=2, num_microbatches=2)),
    # More micro-batches than stages: the first rank defers each weight gradient past the next forward.
    dict(name="dp2_pp2_zero_bubble_v2_m4", batch_size=8,
         strategy=dict(data_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="zero_bubble",
                       virtual_pipeline_size=2, num_microbatches=4)),
    dict(name="dp2_pp2_interleaved_v2", batch_size=4,
         strategy=dict(data_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                       virtual_pipeline_size=2, num_microbatches=2)),
    # Context parallel: the blocks' activations of this rank's part of each sequence, ZeRO over dp x cp.
    dict(name="dp2_cp2_zero2", batch_size=4, strategy=dict(data_parallel_size=2, context_parallel_size=2, zero_stage=2)),
    dict(name="cp2_tp2_sp", batch_size=4, strategy=dict(context_parallel_size=2, tensor_parallel_size=2,
                                                        sequence_parallel=True)),
    dict(name="cp2_pp2_1f1b", batch_size=8, strategy=dict(context_parallel_size=2, pipeline_parallel_size=2,
                                                          num_microbatches=4)),
    dict(name="cp4_full", batch_size=4, strategy=dict(context_parallel_size=4, activation_checkpointing="full")),
]


def layout_of(case) -> Layout:
    k = case["strategy"]
    pp, m = k.get("pipeline_parallel_size", 1), k.get("num_microbatches", 1)
    return Layout(dp=k.get("data_parallel_size", 1), tp=k.get("tensor_parallel_size", 1), pp=pp,
                  cp=k.get("context_parallel_size", 1),
                  num_microbatches=m, micro_batch_size=case["batch_size"] // m,
                  schedule=k.get("pipeline_schedule", "1f1b"), virtual_stages=k.get("virtual_pipeline_size", 1),
                  sequence_parallel=k.get("sequence_parallel", False),
                  zero_stage=k.get("zero_stage", 0), recompute=k.get("activation_checkpointing"))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from helpers import WORKERS
    from helpers.launchers import forkrun

    out = tmp_path_factory.mktemp("planner")
    cases = [{"model": CONFIG, **case} for case in MEASURED]
    (out / "cases.json").write_text(json.dumps(cases))
    forkrun(4, str(WORKERS / "planner_worker.py"), str(out / "cases.json"), str(out), timeout=120,
            rank_files=out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", MEASURED, ids=[c["name"] for c in MEASURED])
def test_bytes_per_rank_of_our_runs_match_the_planner(measured, case):
    model, layout = ModelSpec.from_gpt_config(GPTConfig(**case.get("model", CONFIG))), layout_of(case)
    for rank, results in enumerate(measured):
        ours = results[case["name"]]
        dp_rank, pp_rank, tp_rank = ours["coords"][:3]  # (dp, pp, tp, cp)
        predicted = estimate_memory(model, layout, FP32, pp_rank)
        for kind in ("parameters", "gradients", "optimizer_state", "activations"):
            print(f"{case['name']} rank {rank} (pp {pp_rank}) {kind}: measured {ours[kind]}, planner"
                  f" {getattr(predicted, kind):.0f} ({getattr(predicted, kind) / ours[kind] - 1:+.1%})")
            assert getattr(predicted, kind) == pytest.approx(ours[kind], rel=0.05), (kind, rank)
