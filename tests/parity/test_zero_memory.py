"""Each ZeRO stage holds the bytes it promises: per rank, parameters, gradients and optimizer state are the
full model's at zero_stage=0 and 1/dp of them at 1, 2, 3 (within 5%); within a step, stage 3 holds fewer
gathered parameters than stage 2. Under the pipeline, the gradients a rank holds within a step are what the
run logs and the planner predicts, per step and per micro-batch reduction."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun
from helpers.workers.zero_memory_worker import CONFIG, PIPELINED_CONFIG
from lightning_3d.models import GPT
from lightning_3d.planner import PRECISIONS, Layout, ModelSpec
from lightning_3d.planner.memory import step_gradient_bytes

pytestmark = pytest.mark.multiprocess
DP = 4


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero_memory")
    proc = forkrun(DP, str(WORKERS / "zero_memory_worker.py"), str(out), timeout=300, rank_files=out)
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def per_rank(launched):
    out, _ = launched
    return [{int(k) if k.isdigit() else k: v for k, v in json.loads((out / f"rank{r}.json").read_text()).items()}
            for r in range(DP)]


def test_a_zero_stage_that_runs_as_another_says_so_at_set_up(launched):
    # The worker runs zero_stage 0-3 at dp=4 without a pipeline, then 2 and 3 twice each at (2, 2, 1).
    _, output = launched
    assert output.count("lightning_3d: zero_stage=1 runs as ZeRO-2: FSDP2 has no optimizer-only sharding") == 1
    assert output.count("lightning_3d: zero_stage=3 runs as ZeRO-2: under the pipeline") == 2
    assert "zero_stage=2 runs as" not in output and "zero_stage=0 runs as" not in output
    assert output.count("gradients in step") == 4  # the memory line of each pipelined run


def test_sharded_bytes_are_one_dp_th_of_the_full_ones(per_rank):
    full = sum(p.numel() * 4 for p in GPT(CONFIG).parameters())  # fp32
    for rank, results in enumerate(per_rank):
        stages = {z: r for z, r in results.items() if isinstance(z, int)}
        print(f"rank {rank}: " + "; ".join(f"zero{z} {s}" for z, s in stages.items()))
        replicated = stages[0]
        assert replicated["parameters"] == replicated["gradients"] == full
        # AdamW: exp_avg and exp_avg_sq per parameter, plus one scalar step count per parameter tensor.
        assert replicated["optimizer_state"] == pytest.approx(2 * full, rel=0.01)
        for zero in (1, 2, 3):
            for kind, expected in [("parameters", full / DP), ("gradients", full / DP),
                                   ("optimizer_state", 2 * full / DP)]:
                assert stages[zero][kind] == pytest.approx(expected, rel=0.05), (zero, kind, stages[zero])


def test_stage_3_frees_each_block_after_its_forward(per_rank):
    full = sum(p.numel() * 4 for p in GPT(CONFIG).parameters())
    stages = per_rank[0]
    assert stages[0]["gathered_at_end_of_forward"] == full  # replicas
    assert stages[2]["gathered_at_end_of_forward"] == full  # every block gathered until its backward
    # Stage 3: only the root's parameters (embeddings, final norm, head); the last block was freed as its
    # forward ended.
    assert stages[3]["gathered_at_end_of_forward"] < 0.5 * full


@pytest.mark.parametrize("zero", [2, 3])
def test_under_the_pipeline_reducing_per_microbatch_holds_fewer_whole_gradients(per_rank, zero):
    # (dp, pp, tp) = (2, 2, 1), 4 blocks per stage, 4 micro-batches. Per step a stage holds its whole gradients
    # until the last backward; per micro-batch, the dp shards plus its root unit's and one block's whole.
    model = ModelSpec.from_gpt_config(PIPELINED_CONFIG)
    for rank, results in enumerate(per_rank):
        peaks = {}
        for when in ("per_step", "per_microbatch"):
            run = results[f"zero{zero}_pp2_{when}"]
            layout = Layout(dp=2, pp=2, num_microbatches=4, micro_batch_size=1, zero_stage=zero,
                            pipeline_reduce_grads=when)
            planned = step_gradient_bytes(model, layout, PRECISIONS["32-true"], run["pp_rank"])
            print(f"rank {rank} zero{zero} {when}: measured {run['gradient_peak']} B, logged"
                  f" {run['step_gradient_bytes']} B, planner {planned:.0f} B")
            # What the run logs ("gradients in step") and the planner agree; the first stage reduces its
            # embedding's gradient after its blocks', so the sum of the root's and one block's is an upper bound.
            assert run["step_gradient_bytes"] == pytest.approx(planned, rel=0.01), (rank, when)
            assert 0.95 * run["step_gradient_bytes"] <= run["gradient_peak"] <= run["step_gradient_bytes"], (rank, when)
            peaks[when] = run["gradient_peak"]
        assert peaks["per_microbatch"] < 0.8 * peaks["per_step"], (rank, peaks)
