"""The planner against large published training runs (docs/planner.md, "Published runs"): their step times,
and whether the planner, given the same model, GPUs and batch, finds the layout the run used."""

from dataclasses import replace

import pytest

from lightning_3d.planner import PRECISIONS, Cluster, Layout, ModelSpec
from lightning_3d.planner.cluster import GIB
from lightning_3d.planner.memory import block_activation_bytes, interleaved_peak
from lightning_3d.planner.search import evaluate, plan
from lightning_3d.planner.time import estimate_step_time

MEGATRON = PRECISIONS["megatron-mixed"]
MEGATRON_BF16 = PRECISIONS["megatron-bf16"]
"""The published runs' precision: bf16 weights and activations, gradients accumulated and reduced in fp32."""


# Published runs of other models, sizes and GPUs (docs/planner.md, "Published runs": sources and assumptions).
# Megatron-style GPT blocks: unfused attention with dropout; Llama blocks: SwiGLU, RMSNorm, rotary, GQA.
BLOOM_176B = ModelSpec(num_layers=70, hidden_size=14336, num_heads=112, vocab_size=250880, seq_length=2048,
                       tied_embeddings=True, learned_positions=False, flash_attention=False, dropout=0.1)
MT_NLG_530B = ModelSpec(num_layers=105, hidden_size=20480, num_heads=128, vocab_size=51200, seq_length=2048,
                        tied_embeddings=True, flash_attention=False, dropout=0.1)


def llama3(layers, hidden, heads, ffn, vocab, seq=8192):
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=8, ffn_hidden_size=ffn,
                     vocab_size=vocab, seq_length=seq, gated_mlp=True, bias=False, norm="rmsnorm",
                     learned_positions=False, fused_qkv=False)


LLAMA3_405B = llama3(126, 16384, 128, 53248, 128000)


def llama3_405b_table_4(gpus, dp, per_dp, v=4):
    # Meta's 8K-token stage: tp 8, pp 16, FSDP over dp (optimizer and gradients sharded, parameters kept
    # from forward to backward: ZeRO-2), no recompute; micro-batches of one sequence assumed.
    return Layout(dp=dp, tp=8, pp=16, micro_batch_size=1, num_microbatches=per_dp, schedule="interleaved_1f1b",
                  virtual_stages=v, zero_stage=2, sequence_parallel=True)


def test_interleaving_sends_each_chunks_activations_and_gradients():
    # Narayanan et al. 2021, 2.2.2: with v model chunks per rank a micro-batch enters and leaves each rank v
    # times, so the point-to-point traffic is v times 1F1B's (on Llama 3 405B's first Table 4 layout).
    cluster = Cluster.preset("h100", nodes=1024)
    one = estimate_step_time(LLAMA3_405B, replace(llama3_405b_table_4(8192, 64, 32), schedule="1f1b",
                                                  virtual_stages=1), cluster, MEGATRON)
    four = estimate_step_time(LLAMA3_405B, llama3_405b_table_4(8192, 64, 32), cluster, MEGATRON)
    assert four.pp_communication == pytest.approx(4 * one.pp_communication)


def published_runs():
    """(name, model, layout, cluster, reported, unit, estimate_step_time keywords) of each published run."""
    fp32_reduce = dict(dp_reduce_bytes=4)  # every run reduces fp32 gradients (the precision's own 4 bytes)
    megatron = dict(fp32_reduce, dp_overlap=False)  # Megatron-DeepSpeed: after backward, not overlapped
    a100 = lambda nodes, **kw: Cluster.preset("a100-80gb", nodes=nodes, **kw)  # noqa: E731
    runs = [("BLOOM-176B, 384 A100", BLOOM_176B, Layout(dp=8, tp=4, pp=12, micro_batch_size=2, num_microbatches=128,
             recompute="full"), a100(48, inter_node_bandwidth_gbs=6.25), 149.77, "TFLOP/s", megatron)]
    runs += [(f"MT-NLG 530B, {nodes * 8} A100", MT_NLG_530B, Layout(dp=nodes // 35, tp=8, pp=35, num_microbatches=
              1920 // (nodes // 35), recompute="full"), a100(nodes), tflops, "TFLOP/s", megatron)
             for nodes, tflops in [(280, 126), (350, 121), (420, 113)]]
    runs += [(f"Llama 3 405B, {gpus} H100", LLAMA3_405B, llama3_405b_table_4(gpus, dp, per_dp),
              Cluster.preset("h100", nodes=gpus // 8), mfu, "MFU", fp32_reduce)
             for gpus, dp, per_dp, mfu in [(8192, 64, 32, 0.43), (16384, 128, 16, 0.41)]]
    fsdp = dict(dp=64, zero_stage=3)  # torchtitan: FSDP2, bf16 parameters, fp32 gradient reduce-scatter
    runs += [("torchtitan Llama 3 8B, 64 A100", llama3(32, 4096, 32, 14336, 128256),
              Layout(**fsdp, recompute="selective"), a100(8), 2904, "tokens/s", fp32_reduce),
             ("torchtitan Llama 3 70B, 64 A100", llama3(80, 8192, 64, 28672, 128256),
              Layout(**fsdp, recompute="full"), a100(8), 331, "tokens/s", fp32_reduce),
             # H100 of 96 GB HBM2e at a 500 W cap: torchtitan states its peak is unknown.
             ("torchtitan Llama 3.1 8B, 8 H100", llama3(32, 4096, 32, 14336, 128256), Layout(dp=8, zero_stage=3,
              micro_batch_size=2, recompute="selective"), Cluster.preset("h100", memory_gib=96,
              hbm_bandwidth_gbs=2400), 5762, "tokens/s", fp32_reduce)]
    return runs


LLAMA3_RUN_CHUNKS = 8
"""Llama 3 ran 8 one-layer chunks per rank, the first holding only the embedding and the last only the head;
lightning-3d cuts 126 blocks over 16 ranks into at most 4 chunks per rank, with the same 8 blocks on the
busiest rank."""


def predicted(name, model, layout, cluster, unit, keywords) -> float:
    time = estimate_step_time(model, layout, cluster, MEGATRON_BF16, **keywords)
    seconds = time.total
    if name.startswith("Llama 3 405B"):
        # From the v chunks we can cut to the run's, in the planner's own terms: bubble / v, p2p traffic * v.
        scale = LLAMA3_RUN_CHUNKS / layout.virtual_stages
        seconds += time.pp_communication * (scale - 1) - time.pp_bubble * (1 - 1 / scale)
    gpus = layout.world_size
    return {"TFLOP/s": time.hardware_flops / seconds / gpus / 1e12,
            "MFU": time.model_flops / seconds / gpus / (cluster.peak_tflops * 1e12),
            "tokens/s": layout.global_batch_size * model.seq_length / seconds / gpus}[unit]


KNOWN_MISSES = ("MT-NLG", "torchtitan Llama 3.1 8B, 8 H100")
"""Runs the planner over-predicts by more than 15 % for reasons its inputs do not carry (docs/planner.md)."""


def test_step_time_reproduces_published_runs_of_other_models_and_gpus_within_15_percent():
    report = []
    for name, model, layout, cluster, reported, unit, keywords in published_runs():
        ours = predicted(name, model, layout, cluster, unit, keywords)
        report.append((name, ours, reported, unit, ours / reported - 1))
    print("\n".join(f"{n:32s} planner {o:8.4g} {u}, published {p}, {e:+.1%}" for n, o, p, u, e in report))
    for name, *_, error in report:
        if name.startswith(KNOWN_MISSES):
            assert error > 0.15, (name, error)  # still the optimistic miss the documentation explains
        else:
            assert abs(error) <= 0.15, (name, error)


# ------------------------------------------------------- given the run's GPUs and batch, does the planner find it?
# Each published layout is checked against plan() over the run's world size, global batch and cluster, with
# the search held to what the run's framework offered. A layout the search cannot name is evaluated directly
# and the test says why it is outside (docs/planner.md, "Does the planner find the published layouts?").

WITHIN = 0.10
"""The published layout's estimated step time may exceed the planner's best by this share."""


def a100(nodes, **overrides):
    return Cluster.preset("a100-80gb", nodes=nodes, **overrides)


def search(model, layout, cluster, **space):
    """The published layout's estimate, and the planner's ranked layouts for the same GPUs and batch."""
    published = evaluate(model, layout, cluster, MEGATRON_BF16)
    result = plan(model, cluster, global_batch_size=layout.global_batch_size, precision=MEGATRON_BF16, **space)
    return published, result


def describe(name, published, result) -> str:
    best = result.best
    return (f"{name}: published {published.layout.describe()} {published.memory.total / GIB:.1f} GiB,"
            f" {published.time.total:.4g} s; best {best.layout.describe()} {best.memory.total / GIB:.1f} GiB,"
            f" {best.time.total:.4g} s; published / best {published.time.total / best.time.total:.3f}")


TORCHTITAN_A100 = [  # torchtitan docs/performance.md, A100 table: FSDP2 only (no tp, no pp), local batch 1
    ("torchtitan Llama 3 8B, 64 A100", llama3(32, 4096, 32, 14336, 128256), "selective"),
    ("torchtitan Llama 3 70B, 64 A100", llama3(80, 8192, 64, 28672, 128256), "full"),
]


@pytest.mark.parametrize("name, model, recompute", TORCHTITAN_A100, ids=["8B", "70B"])
def test_torchtitans_fsdp_layouts_fit_and_are_within_10_percent_of_the_planners_best_fsdp_layout(name, model,
                                                                                                  recompute):
    layout = Layout(dp=64, zero_stage=3, recompute=recompute)
    # The framework of the table: FSDP2 alone (1D: no HSDP), so tp = pp = 1; recompute, ZeRO stage and
    # micro-batches are the planner's to choose.
    published, result = search(model, layout, a100(8), fixed={"tp": 1, "pp": 1, "dp_shard": 0})
    print(describe(name, published, result))
    assert layout in [c.layout for c in result.candidates]
    assert published.time.total <= (1 + WITHIN) * result.best.time.total


def test_bloom_layout_fits_and_is_outside_the_search_which_finds_it_without_recompute_faster():
    # BLOOM-176B (Megatron-DeepSpeed): t4 p12 d8, 1F1B, micro-batch 2, full recompute, ZeRO-1 (which lightning-3d
    # runs as ZeRO-2: the same bytes per rank but the gathered parameters). Its dropout (0.1) under tp with
    # recompute is refused by lightning-3d (a recompute would redraw the masks), so the search cannot name this
    # layout: it is evaluated directly. Its framework had neither sequence parallelism nor interleaving.
    layout = Layout(dp=8, tp=4, pp=12, micro_batch_size=2, num_microbatches=128, recompute="full", zero_stage=1)
    cluster = a100(48, inter_node_bandwidth_gbs=6.25)
    published, result = search(BLOOM_176B, layout, cluster, fixed={"sequence_parallel": False},
                               schedules=("1f1b",), zero_stages=(0, 2))
    print(describe("BLOOM-176B", published, result))
    assert published.memory.total <= cluster.usable_bytes
    assert replace(layout, zero_stage=2) not in [c.layout for c in result.candidates]
    # What the planner finds instead: no recompute (tp 8 leaves room for the activations), 1.1-1.3x faster by
    # its estimate. The run did not report trying it (docs/planner.md); this pins the claim.
    assert result.best.layout.recompute is None
    assert 1 + WITHIN < published.time.total / result.best.time.total < 1.3


def korthikanti_layer_bytes(model: ModelSpec, tp: int) -> float:
    """One Llama layer's saved bytes per sequence as Megatron-LM keeps them (Korthikanti et al. 2022 with
    sequence parallelism: every tensor a sequence shard, the norm outputs re-gathered in backward; flash
    attention: no scores) and with Megatron's fused SwiGLU, which saves gate and up (2f) and its output (f):
    three tensors of f where eager PyTorch keeps four."""
    layout = Layout(tp=tp, sequence_parallel=True)
    eager = block_activation_bytes(model, layout, MEGATRON_BF16, gathered_region_inputs=False)
    return eager - model.seq_length * model.ffn * MEGATRON_BF16.activation_bytes / tp


@pytest.mark.parametrize("gpus, dp, per_dp", [(8192, 64, 32), (16384, 128, 16)], ids=["8K", "16K"])
def test_llama3_405b_without_recompute_fits_no_accounting_the_planner_knows_and_its_best_recomputes(gpus, dp, per_dp):
    cluster = Cluster.preset("h100", nodes=gpus // 8)
    layout = llama3_405b_table_4(gpus, dp, per_dp)
    published, result = search(LLAMA3_405B, layout, cluster)
    print(describe(f"Llama 3 405B, {gpus} H100", published, result))
    # 1. As lightning-3d runs it (the closest layout it can cut: 4 chunks of 2 blocks per rank), the step saves
    #    the all-gathered norm outputs whole (DTensor) and SwiGLU's four tensors: far over the 72 GiB usable.
    assert published.memory.total > 2 * cluster.usable_bytes
    # 2. As Meta cut it (V = 8 one-layer chunks, the first rank's first chunk the embedding alone, the last
    #    rank's last the head alone) and as Megatron-LM saves a layer (the leanest accounting published), the
    #    busiest rank, with the gathered bf16 parameters the run's FSDP kept, needs more than the 72 GiB a plan
    #    may fill: with the fp32 gradients held whole through the step over 80 GiB, reduce-scattered per
    #    micro-batch (the paper does not say which) 91-100 % of the H100. Meta's run fit by its own framework's
    #    memory work (section 3.3.2), not by anything the planner's inputs describe (docs/planner.md).
    layer = korthikanti_layer_bytes(LLAMA3_405B, 8)
    head = LLAMA3_405B.seq_length * (LLAMA3_405B.vocab_size / 8 * 4 + LLAMA3_405B.hidden_size * 2)
    chunks = {0: [0.0] + [layer] * 7, 15: [layer] * 7 + [head]}
    activations = max(interleaved_peak(chunks.get(r, [layer] * 8), per_dp, 16, r) for r in range(16))
    for held in ("per_step", "per_microbatch"):  # 8 blocks' parameters, as on Meta's busiest rank
        memory = evaluate(LLAMA3_405B, replace(layout, pipeline_reduce_grads=held), cluster, MEGATRON_BF16).memory
        need = activations + memory.total - memory.activations
        print(f"  Megatron-LM's saving at Meta's layout, gradients reduced {held}: activations"
              f" {activations / GIB:.1f} GiB + the rest {(need - activations) / GIB:.1f} GiB = {need / GIB:.1f} GiB")
        assert need > cluster.usable_bytes
        if held == "per_step":
            assert need > cluster.memory_gib * GIB
    # 3. So the published layout is not among the candidates, and the planner's best recomputes: by its
    #    estimate 1.08-1.35x the published layout's step time (on 16K GPUs it splits each sequence over 2
    #    context-parallel ranks, which halves the blocks' activations of a sequence).
    assert layout not in [c.layout for c in result.candidates]
    assert result.best.layout.recompute is not None
    assert 1 < result.best.time.total / published.time.total < 1.35


LLAMA3_405B_TABLE_4 = [(8192, 430), (16384, 400)]
"""Llama 3 405B's 8K-token stage (Table 4): GPUs, model TFLOP/s per GPU reported (batch 16M tokens: 2048
sequences of 8192)."""


@pytest.mark.parametrize("gpus, reported", LLAMA3_405B_TABLE_4, ids=["8K", "16K"])
def test_lightning_3d_plan_picks_a_layout_for_llama3_405b_within_25_percent_of_the_published_tflops(
        gpus, reported, tmp_path):
    # `lightning-3d plan` as a user runs it: the run's cluster and batch, the command's default precision
    # (bf16-mixed: what lightning-3d itself runs). Under ZeRO lightning-3d gathers the parameters in bf16
    # (FSDP2's MixedPrecisionPolicy), so autocast copies none; charged as fp32 gathers plus bf16 copies, the
    # pick was full recompute at 291 and 243 TFLOP/s per GPU.
    import yaml

    from lightning_3d.planner.command import build_parser, inputs

    config = tmp_path / "llama3_405b.yaml"
    config.write_text(yaml.safe_dump({"model": {f: getattr(LLAMA3_405B, f) for f in (
        "num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_length",
        "gated_mlp", "bias", "norm", "learned_positions", "fused_qkv")}}))
    args = build_parser().parse_args(["--config", str(config), "--gpu", "h100", "--nodes", str(gpus // 8),
                                      "--global-batch-size", "2048"])
    model, cluster, batch, precision = inputs(args)
    assert precision == "bf16-mixed"
    best = plan(model, cluster, global_batch_size=batch, precision=precision).best
    tflops = best.time.model_flops / best.time.total / gpus / 1e12
    print(f"Llama 3 405B, {gpus} H100: {best.layout.describe()}, {best.memory.total / GIB:.1f} GiB,"
          f" {tflops:.0f} model TFLOP/s per GPU (published {reported})")
    assert abs(tflops / reported - 1) <= 0.25
