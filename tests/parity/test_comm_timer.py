"""CommTimer: bytes per parallel dimension equal the analytic count for the reference GPT, in every layout of
one 4-rank launch (helpers/workers/comm_worker.py), also under Lightning's own DDPStrategy (a single process
logs zeros: unit/test_callbacks.py)."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

# comm_worker.py: GPT(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64), 4 sequences of
# 16 tokens per data-parallel rank, fp32; the third training batch is measured (DDP rebuilds its buckets,
# with a broadcast, in the second).
L, C, T, V, B, FP32 = 2, 32, 16, 64, 4, 4
LOSS_SYNC = 4  # train_loss is logged with sync_dist=True: one fp32 all-reduce over dp (the ranks with other data)


def activation_bytes(batch: int) -> int:
    return batch * T * C * FP32  # (batch, T, C) hidden states


def tp_bytes(*, tp: int, blocks: int, first: bool, last: bool, microbatches: int, sp: bool) -> int:
    """One rank's tensor-parallel bytes in one step (forward + backward), Megatron's count."""
    if tp == 1:
        return 0
    b = B // microbatches
    # Per block: two all-reduces forward (after o_proj, down_proj), two backward (entering attn, mlp). With
    # sequence parallelism each becomes an all-gather plus a reduce-scatter of the same full size.
    messages = 4 * blocks + first + last  # + token embedding's output (fwd), output head's input grad (bwd)
    total = messages * (2 if sp else 1) * activation_bytes(b)
    if last:  # vocabulary-parallel cross-entropy: all-reduces of max, sum of exp and target logit per token
        total += 3 * b * T * FP32
    total *= microbatches
    if sp:  # once per step: the norms' partial weight and bias gradients; the position table's gradient
        norms = 2 * blocks + last
        total += norms * 2 * C * FP32 + first * T * C * FP32
    return total


def pp_p2p_bytes(*, pp: int, microbatches: int) -> int:
    """Each stage boundary: one activation forward and its gradient backward per micro-batch."""
    return 0 if pp == 1 else 2 * microbatches * activation_bytes(B // microbatches)


def local_parameters(*, tp: int, blocks: int, first: bool, last: bool) -> int:
    """Parameters this rank holds (q/k/v/up column-wise and o/down row-wise split over tp; the embedding and
    head split over the vocabulary; norms, row-wise biases and the position table replicated)."""
    block = (4 * C * C + 2 * C + 8 * C * C + 4 * C) // tp + 6 * C  # q/k/v/o (+q, v bias), up/down (+up bias)
    return blocks * block + first * (V * C // tp + T * C) + last * (2 * C + V * C // tp)


LAYOUTS = {  # comm_worker.py's layouts: (dp, pp, tp, micro-batches, sequence parallel)
    "dp2_pp1_tp2": (2, 1, 2, 1, False),
    "dp1_pp2_tp2": (1, 2, 2, 2, False),
    "dp2_pp2_tp1": (2, 2, 1, 2, False),
    "dp4_pp1_tp1": (4, 1, 1, 1, False),
    "dp2_pp1_tp2_sp": (2, 1, 2, 1, True),
    "lightning_ddp": (4, 1, 1, 1, False),  # Lightning's DDPStrategy: counted as dp over the world
}
HSDP = "hsdp_rep2_shard2_zero2"  # comm_worker.py: dp 4 = 2 replicas x 2 shards, ZeRO-2


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_worker")
    forkrun(4, str(WORKERS / "comm_worker.py"), str(out), rank_files=out, timeout=420)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def expected(layout: str, rank: int) -> dict[str, int]:
    dp, pp, tp, microbatches, sp = LAYOUTS[layout]
    stage = rank // (tp * dp)  # global_rank = tp_rank + tp * (dp_rank + dp * pp_rank)
    where = dict(blocks=L // pp, first=stage == 0, last=stage == pp - 1)
    return {
        "tp": tp_bytes(tp=tp, microbatches=microbatches, sp=sp, **where),
        "pp_p2p": pp_p2p_bytes(pp=pp, microbatches=microbatches),
        # the gradient all-reduce of every parameter this rank holds, plus the loss sync over dp
        "dp": (FP32 * local_parameters(tp=tp, **where) + LOSS_SYNC) if dp > 1 else 0,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytes_per_dimension_equal_the_analytic_count_for_the_reference_gpt(measured, layout):
    for rank, result in enumerate(measured):
        ops, values = result[layout]["ops"], result[layout]["values"]
        want = expected(layout, rank)
        p2p = sum(b for dim, op, b in ops if dim == "pp" and op in ("send", "recv_"))
        assert (values["tp_bytes"], p2p, values["dp_bytes"]) == (want["tp"], want["pp_p2p"], want["dp"]), (rank, ops)
        # pp also carries the engine's broadcast of the loss and logged values (pickled, so not analytic)
        assert {op for dim, op, _ in ops if dim == "pp"} <= {"send", "recv_", "broadcast_"}
        assert values["pp_bytes"] >= p2p
        for dim in ("tp", "pp", "dp"):
            assert (values[f"{dim}_time_s"] > 0) == (values[f"{dim}_bytes"] > 0)
            assert values[f"{dim}_time_s"] <= values["step_time_s"]


def dp_bytes_per_batch(result: dict, ops: tuple[str, ...]) -> list[int]:
    return [sum(b for dim, op, b in batch if dim == "dp" and op in ops) for batch in result["per_batch"]]


REDUCTIONS = ("allreduce_", "_reduce_scatter_base_")
ALL_GATHERS = ("_allgather_base_",)


@pytest.mark.multiprocess
def test_accumulation_under_the_pipeline_reduces_over_dp_once_per_optimizer_step(measured):
    # (2, 2, 1), accumulate_grad_batches=2, two optimizer steps: batches 0 and 2 only accumulate.
    for rank, result in enumerate(measured):
        stage = rank // 2
        one_reduction = FP32 * local_parameters(tp=1, blocks=1, first=stage == 0, last=stage == 1)
        for name in ("dp2_pp2_tp1_accumulate2", "dp2_pp2_tp1_zero2_accumulate2"):  # all-reduce; reduce-scatter
            reduced = dp_bytes_per_batch(result[name], REDUCTIONS)
            syncs = [LOSS_SYNC] * 4  # every batch's train_loss sync_dist
            assert reduced == [a + b for a, b in zip(syncs, [0, one_reduction, 0, one_reduction])], (rank, name, reduced)


@pytest.mark.multiprocess
def test_reducing_per_microbatch_costs_one_reduce_scatter_per_microbatch(measured):
    # pipeline_reduce_grads="per_microbatch" at (2, 2, 1), 2 micro-batches per batch: each batch (accumulating
    # or not) reduce-scatters the stage's gradients twice; the parameters' all-gathers are those of "per_step".
    for rank, result in enumerate(measured):
        stage = rank // 2
        one_reduction = FP32 * local_parameters(tp=1, blocks=1, first=stage == 0, last=stage == 1)
        per_step, per_microbatch = (result[f"dp2_pp2_tp1_zero2{mode}_accumulate2"] for mode in ("", "_per_microbatch"))
        assert dp_bytes_per_batch(per_microbatch, REDUCTIONS) == [2 * one_reduction + LOSS_SYNC] * 4, rank
        assert dp_bytes_per_batch(per_microbatch, ALL_GATHERS) == dp_bytes_per_batch(per_step, ALL_GATHERS), rank


@pytest.mark.multiprocess
def test_logged_values_are_the_maximum_over_ranks(measured):
    logged = measured[0]["dp1_pp2_tp2"]["logged"]
    assert logged["comm/tp_bytes"] == max(expected("dp1_pp2_tp2", r)["tp"] for r in range(4))
    shares = [r["dp1_pp2_tp2"]["values"]["pp_time_s"] / r["dp1_pp2_tp2"]["values"]["step_time_s"] for r in measured]
    assert logged["comm/pp_share"] == pytest.approx(max(shares))
    assert 0 < logged["comm/pp_share"] < 1


@pytest.mark.multiprocess
def test_hsdp_reports_its_shard_and_replica_groups_apart(measured):
    # ZeRO-2 within each shard group (all-gather of the parameters, reduce-scatter of the gradients: the whole
    # model's bytes each), then the all-reduce of this rank's half across the 2 replicas; "dp" keeps the loss sync.
    whole = FP32 * local_parameters(tp=1, blocks=L, first=True, last=True)
    for rank, result in enumerate(measured):
        ops, values = result[HSDP]["ops"], result[HSDP]["values"]
        on = lambda dim, kinds: sum(b for d, op, b in ops if d == dim and op in kinds)  # noqa: E731
        assert (on("dp_shard", ALL_GATHERS), on("dp_shard", REDUCTIONS)) == (whole, whole), (rank, ops)
        assert values["dp_replicate_bytes"] == on("dp_replicate", ("allreduce_",)) == whole // 2, (rank, ops)
        assert values["dp_bytes"] == LOSS_SYNC and values["tp_bytes"] == values["pp_bytes"] == 0, (rank, values)
        assert values["other_bytes"] == 0, (rank, ops)
