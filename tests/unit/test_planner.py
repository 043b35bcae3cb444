"""The planner's cost model against published figures (ZeRO, Korthikanti et al., Narayanan et al.) and against
the activations one process saves (what our runs hold on 4 ranks: parity/test_planner_on_ranks.py)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.models import GPT, GPTConfig
from lightning_3d.planner import PRECISIONS, Cluster, Layout, ModelSpec, PlannerError, estimate_memory, zero_model_state_bytes
from lightning_3d.planner.memory import (
    autocast_weight_bytes,
    rank_parameters,
    step_gradient_bytes,
    block_activation_bytes,
    interleaved_peak,
    microbatch_activation_bytes,
    microbatches_in_flight,
    peak_activation_bytes,
)
from lightning_3d.planner.search import NoLayoutFits, plan
from lightning_3d.planner.time import estimate_step_time, step_flops

GB = 1e9
MEGATRON = PRECISIONS["megatron-mixed"]
MEGATRON_BF16 = PRECISIONS["megatron-bf16"]


# ------------------------------------------------------------------------------------------ published figures


def test_zero_memory_matches_the_zero_papers_worked_example():
    # Rajbhandari et al. 2020 (ZeRO), Figure 1: Psi = 7.5B parameters, mixed-precision Adam (K = 12),
    # N_d = 64: 120 GB per GPU replicated, 31.4 / 16.6 / 1.9 GB with ZeRO stage 1 / 2 / 3.
    published = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in published.items():
        states = zero_model_state_bytes(7.5e9, 64, stage, MEGATRON)
        assert sum(states.values()) / GB == pytest.approx(gb, abs=0.05), stage


def test_zero_1_runs_as_2_and_3_under_the_pipeline_as_2_in_the_planner_as_in_the_strategy():
    # lightning-3d runs zero_stage=1 as 2 (FSDP2 has no optimizer-only sharding) and 3 as 2 under the
    # pipeline (parallel/data_parallel.apply_zero): the planner gives those the same memory and time.
    model = ModelSpec.from_gpt_config(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=64))
    cluster = Cluster.preset("a100-40gb")
    for pp, same in [(1, (1, 2)), (2, (1, 2)), (2, (2, 3))]:
        layouts = [Layout(dp=4, pp=pp, num_microbatches=4, micro_batch_size=1, zero_stage=z) for z in same]
        memory = [estimate_memory(model, layout, FP32, 0) for layout in layouts]
        time = [estimate_step_time(model, layout, cluster, FP32) for layout in layouts]
        assert memory[0] == memory[1] and time[0] == time[1], (pp, same)


def test_under_bf16_mixed_zero_gathers_bf16_weights_that_autocast_does_not_copy():
    # lightning-3d's ZeRO layouts under bf16-mixed give FSDP2 MixedPrecisionPolicy(param_dtype=bf16)
    # (parallel/precision.py): the gathered weights are bf16 (half the bytes held and sent), and autocast, finding
    # them in its own dtype, copies none. Replicated, autocast keeps a bf16 copy beside each fp32 weight.
    bf16 = PRECISIONS["bf16-mixed"]
    model = ModelSpec.from_gpt_config(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=64))
    zero2 = Layout(dp=4, pp=2, num_microbatches=4, zero_stage=2)
    params = rank_parameters(model, zero2, 1)
    memory = estimate_memory(model, zero2, bf16, 1)
    whole_grads = step_gradient_bytes(model, zero2, bf16, 1) - memory.gradients
    assert autocast_weight_bytes(model, zero2, bf16, 1) == 0
    assert memory.gathered == pytest.approx(2 * params + whole_grads)  # was 4 (1 - 1/dp) + 2 bytes a parameter
    replicated = Layout(dp=4, pp=2, num_microbatches=4)
    assert autocast_weight_bytes(model, replicated, bf16, 1) == 2 * params
    zero3, cluster = Layout(dp=8, zero_stage=3), Cluster.preset("a100-40gb")
    gathers = [estimate_step_time(model, zero3, cluster, p, dp_overlap=False).dp_communication for p in (bf16, FP32)]
    assert gathers[0] < gathers[1]  # bf16 all-gathers, fp32 reduce-scatters in both


def test_fsdp2_with_bf16_params_saves_its_gathered_bf16_weights_and_autocast_adds_no_copy():
    # What the planner's bf16-mixed ZeRO accounting rests on, on one gloo rank: under autocast a matmul on an
    # fp32 weight saves autocast's bf16 copy of it; on FSDP2's bf16 gathered weight it saves that weight.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)  # ended by conftest

    def saved_weights(model, unsharded):
        weights = []

        def pack(tensor):
            if tensor.dim() == 2 and tensor.shape[0] != 8:  # not the (8, width) inputs
                weights.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(8, 32, requires_grad=True))
        kept = {w.untyped_storage().data_ptr() for w in unsharded()}
        result = [(w.dtype, w.untyped_storage().data_ptr() in kept) for w in weights]
        out.float().sum().backward()
        return result

    plain = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    assert saved_weights(plain, plain.parameters) == [(torch.bfloat16, False)] * 2  # autocast's copies

    sharded = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy, reshard_after_forward=False)
    unsharded = lambda: [p.to_local() if hasattr(p, "to_local") else p for p in sharded.parameters()]  # noqa: E731
    # While gathered (from forward to backward under ZeRO-2) the module's parameters are the bf16 unsharded ones.
    assert saved_weights(sharded, unsharded) == [(torch.bfloat16, True)] * 2


def test_reducing_per_microbatch_under_the_pipeline_trades_gradient_memory_for_reduce_scatters():
    model = ModelSpec.from_gpt_config(GPTConfig(n_layer=8, n_embd=256, n_head=4, block_size=64))
    cluster = Cluster.preset("a100-40gb")
    per_step, per_microbatch = (Layout(dp=4, pp=2, num_microbatches=8, micro_batch_size=1, zero_stage=2,
                                       pipeline_reduce_grads=when) for when in ("per_step", "per_microbatch"))
    held = [estimate_memory(model, layout, FP32, 0) for layout in (per_step, per_microbatch)]
    assert held[1].gathered < held[0].gathered and held[1].gradients == held[0].gradients
    wire = [estimate_step_time(model, layout, cluster, FP32, dp_overlap=False).dp_communication
            for layout in (per_step, per_microbatch)]
    # 8 reduce-scatters of the gradients instead of 1, the all-gather of the parameters once: (8 + 1) / (1 + 1)
    assert wire[1] == pytest.approx(wire[0] * 9 / 2)


def korthikanti_model(**overrides):
    # Their setting: attention scores kept (no fused attention), dropout on, 2-byte activations.
    return ModelSpec(**{**dict(num_layers=8, hidden_size=4096, num_heads=32, vocab_size=51200, seq_length=2048,
                               flash_attention=False, dropout=0.1), **overrides})


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_activations_per_layer_match_korthikanti_et_al(tp, sp):
    # Korthikanti et al. 2022, section 4: 34 sbh + 5 as^2 b bytes per layer; with tp, sbh (10 + 24/t) +
    # 5 as^2 b / t; with sequence parallelism everything / t (Megatron saves the sequence shard of the norm
    # outputs, hence gathered_region_inputs=False).
    model = korthikanti_model()
    s, b, h, a = model.seq_length, 2, model.hidden_size, model.num_heads
    layout = Layout(tp=tp, micro_batch_size=b, sequence_parallel=sp)
    ours = block_activation_bytes(model, layout, MEGATRON, gathered_region_inputs=False)
    if sp:
        paper = (34 * s * b * h + 5 * a * s * s * b) / tp
    else:
        paper = s * b * h * (10 + 24 / tp) + 5 * a * s * s * b / tp
    assert ours == pytest.approx(paper, rel=0.005)  # the norms' mean and 1/std (8 bytes per token) on top


def test_full_recompute_keeps_each_layers_input_only():
    model, layout = korthikanti_model(), Layout(micro_batch_size=2, recompute="full")
    assert block_activation_bytes(model, layout, MEGATRON, checkpointed=True) == 2 * 2048 * 2 * 4096  # 2 sbh


def test_schedules_keep_the_published_micro_batches_in_flight():
    p, m, v = 8, 64, 4
    assert microbatches_in_flight(Layout(pp=p, num_microbatches=m, schedule="1f1b"), 0) == p
    assert microbatches_in_flight(Layout(pp=p, num_microbatches=m, schedule="gpipe"), 0) == m
    assert microbatches_in_flight(Layout(pp=p, num_microbatches=m, schedule="1f1b"), p - 1) == 1
    # Interleaving: the first rank holds L (1 + (p - 1) / (p v)) layers' worth (Korthikanti et al., 4.2.3),
    # i.e. p (1 + (p - 1) / (p v)) micro-batches through its L / p layers.
    interleaved = Layout(pp=p, num_microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
    assert microbatches_in_flight(interleaved, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_first_rank_under_interleaved_1f1b_with_sp_holds_korthikanti_et_als_layers_plus_the_gathered_norm_outputs():
    # Korthikanti et al. 2022, their GPT (scores kept, dropout 0.1, 2-byte activations), L = 16, t = 8 with
    # sequence parallelism, interleaved 1F1B over p = 4 ranks with v = 2 chunks, m = 8: the first rank holds
    # (34 sbh + 5 as^2 b) / t per layer (section 4.2.2) for L (1 + (p - 1) / (p v)) = 22 layers (4.2.3).
    # lightning-3d keeps the two norm outputs each region all-gathers whole (DTensor's all-gather is an
    # autograd op; Megatron-LM keeps the shard and gathers again in backward): 2 x 2 sbh (1 - 1/t) more per layer.
    model = korthikanti_model(num_layers=16)
    s, b, h, a, t, p, v, m = model.seq_length, 1, model.hidden_size, model.num_heads, 8, 4, 2, 8
    layout = Layout(tp=t, pp=p, num_microbatches=m, micro_batch_size=b, schedule="interleaved_1f1b",
                    virtual_stages=v, sequence_parallel=True)
    layers = model.num_layers * (1 + (p - 1) / (p * v))
    paper = layers * (34 * s * b * h + 5 * a * s * s * b) / t
    gathered = layers * 2 * 2 * s * b * h * (1 - 1 / t)
    # The embedding's dropout mask (sbh / t) and token ids, in the 2p - 1 micro-batches of chunk 0 in flight.
    embedding = (2 * p - 1) * (s * b * h / t + 8 * s * b)
    ours = peak_activation_bytes(model, layout, MEGATRON, 0)
    assert ours == pytest.approx(paper + gathered + embedding, rel=0.001)  # the norms' statistics on top


def test_interleaved_peak_follows_the_chunks_so_the_last_ranks_head_is_held_once():
    # Equal chunks: the walk through PyTorch's order gives the closed form above, on every rank.
    p, m, v = 4, 8, 4
    for rank in range(p):
        layout = Layout(pp=p, num_microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
        assert interleaved_peak([1.0] * v, m, p, rank) == pytest.approx(v * microbatches_in_flight(layout, rank))
    # The last rank's last chunk holds the head (its fp32 log-softmax: V / t floats per token). Warm-up runs
    # chunks 0-2 (12 forwards); from then on each forward of chunk 3 is followed by its backward, so the head
    # is in flight once -- the block-average count held it 13/4 times.
    head = 10.0
    assert interleaved_peak([1.0, 1.0, 1.0, 1.0 + head], m, p, p - 1) == 13 + head
    model = ModelSpec(num_layers=16, hidden_size=256, num_heads=4, vocab_size=128000, seq_length=512)
    layout = Layout(pp=p, num_microbatches=m, schedule="interleaved_1f1b", virtual_stages=v)
    averaged = microbatches_in_flight(layout, p - 1) * microbatch_activation_bytes(model, layout, MEGATRON, p - 1)
    assert peak_activation_bytes(model, layout, MEGATRON, p - 1) < 0.5 * averaged


def test_pipeline_bubble_is_p_minus_1_over_v_m():
    model = korthikanti_model(num_layers=16)
    fast_links = Cluster(intra_node_bandwidth_gbs=1e12, inter_node_bandwidth_gbs=1e12)
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        layout = Layout(pp=4, num_microbatches=16, schedule=schedule, virtual_stages=v)
        time = estimate_step_time(model, layout, fast_links, MEGATRON)
        assert time.pp_bubble / (time.compute + time.pp_communication) == pytest.approx(3 / (v * 16), rel=1e-6)


def test_step_flops_are_narayanan_et_als_formula():
    # Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s / 6h + V / 16 l h) with full recompute.
    model = korthikanti_model()
    B, s, l, h, V = 64, model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    published = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert step_flops(model, B, recompute="full") == pytest.approx(published, rel=1e-12)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
# (SC '21), Table 1: weak scaling on Selene (A100 80GB, 8 per node, 8 x 200 Gb/s InfiniBand per node), GPT with
# V = 51,200 and s = 2048, mixed precision, full activation recomputation. Columns: parameters (billions),
# heads, hidden, layers, tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s
# per GPU (counted with eq. (3)).
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def test_throughput_reproduces_narayanan_et_al_table_1_within_15_percent():
    report = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, published in NARAYANAN_TABLE_1:
        # GPT as Megatron-LM builds it: tied embeddings, learned positions, unfused attention with dropout.
        model = ModelSpec(num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=51200,
                          seq_length=2048, tied_embeddings=True, flash_attention=False, dropout=0.1)
        assert model.num_parameters() / 1e9 == pytest.approx(billions, abs=0.05)  # the table rounds to 0.1B
        dp = gpus // (tp * pp)
        # Micro-batches of one sequence, 1F1B (the table names neither: an assumption).
        layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=1, num_microbatches=batch // dp, recompute="full")
        # Megatron-LM then all-reduced its fp32 main gradients after backward, not overlapped with it.
        time = estimate_step_time(model, layout, Cluster.preset("a100-80gb", nodes=gpus // 8), MEGATRON,
                                  dp_overlap=False, dp_reduce_bytes=4)
        ours = time.hardware_flops / time.total / gpus / 1e12
        report.append((billions, ours, published, ours / published - 1))
    print("\n".join(f"{b:7.1f}B: planner {o:6.1f} TFLOP/s per GPU, published {p}, {e:+.1%}" for b, o, p, e in report))
    assert all(abs(error) <= 0.15 for *_, error in report), report


# ---------------------------------------------------------------------------------------------- measured

CONFIG = dict(n_layer=4, n_embd=64, n_head=4, block_size=32)
FP32 = PRECISIONS["32-true"]


def saved_bytes(module, run) -> int:
    """What ``run()``'s forward leaves saved for backward, parameters excluded, each storage once."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("recompute, precision", [(None, "32-true"), ("selective", "32-true"), ("full", "32-true"),
                                                  (None, "bf16-mixed")])
def test_saved_activations_of_one_process_match_the_planner(recompute, precision):
    from lightning_3d.parallel.activation_checkpointing import apply_activation_checkpointing
    from lightning_3d.policies import PlanOptions
    from lightning_3d.policies.gpt import GPTPolicy

    torch.manual_seed(0)
    config = GPTConfig(**CONFIG)
    model = GPT(config)
    if recompute:
        apply_activation_checkpointing(model, GPTPolicy().plan(model, PlanOptions()), recompute)
    tokens = torch.randint(0, config.vocab_size, (8, config.block_size))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    measured = saved_bytes(model, step)
    layout, spec, precision = Layout(micro_batch_size=8, recompute=recompute), ModelSpec.from_gpt_config(config), PRECISIONS[precision]
    # Under autocast the bf16 weight copies are saved too (not parameters, so the measurement counts them).
    predicted = (microbatch_activation_bytes(spec, layout, precision, 0)
                 + autocast_weight_bytes(spec, layout, precision, 0))
    print(f"{recompute} {precision.name}: measured {measured} B, planner {predicted:.0f} B"
          f" ({predicted / measured - 1:+.1%})")
    assert predicted == pytest.approx(measured, rel=0.05)


# ------------------------------------------------------------------------------------------- search and inputs


def test_plan_ranks_fitting_layouts_and_writes_a_config_the_strategy_accepts():
    import yaml

    from lightning_3d.parallel.config import ParallelConfig

    model = ModelSpec.from_gpt_config(GPTConfig(vocab_size=50304, block_size=2048, n_layer=20, n_head=16, n_embd=2048))
    result = plan(model, Cluster.preset("a100-40gb"), global_batch_size=64)
    times = [c.time.total for c in result.candidates]
    assert times == sorted(times)
    assert 0 < len(result.candidates) < result.considered  # some layouts were refused for memory
    config = yaml.safe_load(result.to_yaml())
    ParallelConfig(**config["trainer"]["strategy"]["init_args"])
    GPTConfig(**config["model"]["init_args"]["config"])
    layout = result.best.layout
    per_replica = config["data"]["init_args"]["batch_size"] * config["trainer"].get("accumulate_grad_batches", 1)
    assert per_replica * layout.dp == 64
    assert result.best.layout.describe() in result.table()


def test_a_model_that_fits_nowhere_says_how_much_it_needs_and_what_to_change():
    gpt3 = ModelSpec(num_layers=96, hidden_size=12288, num_heads=96, vocab_size=51200, seq_length=2048)
    with pytest.raises(NoLayoutFits, match=r"smallest need is \d+\.\d GiB per GPU.*To fit: \d+ nodes"):
        plan(gpt3, Cluster.preset("a100-80gb"), global_batch_size=64)


@pytest.mark.parametrize("sizes, message", [
    (dict(hidden_size=100, num_heads=3), "does not divide hidden_size"),
    (dict(num_heads=32, num_kv_heads=5), "does not divide num_heads"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
])
def test_inconsistent_sizes_are_refused_with_the_numbers(sizes, message):
    with pytest.raises(PlannerError, match=message):
        ModelSpec(**{**dict(num_layers=4, hidden_size=4096, num_heads=32, vocab_size=32000, seq_length=128), **sizes})


def test_no_tensor_parallel_size_divides_the_vocabulary_and_heads_is_an_error():
    # tp = 2 splits neither 3 heads nor 50257 ids, one layer allows no pp = 2, and dp = 2 does not divide 3.
    model = ModelSpec(num_layers=1, hidden_size=96, num_heads=3, vocab_size=50257, seq_length=64)
    with pytest.raises(PlannerError, match="Pad vocab_size"):
        plan(model, Cluster(gpus_per_node=2, memory_gib=1), global_batch_size=3)


def test_command_plans_from_a_fit_config(capsys, tmp_path):
    from lightning_3d.cli import main

    out = tmp_path / "plan.yaml"
    main(["plan", "--fit-config", str(Path(__file__).parents[2] / "example_configs/gpt_1b_8gpu.yaml"),
          "--gpu", "h100", "--global-batch-size", "32", "--top", "3", "--yaml-out", str(out)])
    printed = capsys.readouterr().out
    assert "1.22B parameters" in printed and "tokens/s" in printed
    assert "class_path: lightning_3d.ThreeDStrategy" in out.read_text()
    with pytest.raises(SystemExit, match="does not divide hidden_size"):
        main(["plan", "--layers", "2", "--hidden", "100", "--heads", "3", "--vocab", "64", "--seq-len", "32",
              "--global-batch-size", "8"])


def test_hugging_face_llama_config_gives_its_parameter_count():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    assert ModelSpec.from_hf_config(config, seq_length=128).num_parameters() == expected


@pytest.mark.parametrize("model_type, planned_share", [("llama", 1.0), ("qwen2", 1.0), ("gpt2", 0.934)])
def test_a_hugging_face_layer_saves_the_bytes_the_planner_gives_it(model_type, planned_share):
    """Counted by autograd on transformers' own model, three layers less two. Llama's and Qwen2's RMSNorm
    multiplies by its weight as a separate op, which saves the normalized tensor: one more (b, s, h) per norm
    than a fused norm (0.90 of a Llama layer was planned without it). GPT-2's ``gelu_new`` is the tanh formula
    in separate ops, three more (b, s, 4h) tensors (0.54 of a GPT-2 layer was planned without them). Not
    modelled, GPT-2's last 2 h per token: SDPA on its fused qkv saves a copy of q, and the attention's output
    and the projection's input are two tensors there."""
    transformers = pytest.importorskip("transformers")
    from lightning_3d.parallel.memory import SavedActivations

    sizes = dict(vocab_size=512, max_position_embeddings=32)
    configs = {
        "llama": lambda n: transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=n,
                                                    num_attention_heads=4, num_key_value_heads=2, **sizes),
        "qwen2": lambda n: transformers.Qwen2Config(hidden_size=64, intermediate_size=172, num_hidden_layers=n,
                                                    num_attention_heads=4, num_key_value_heads=2, **sizes),
        "gpt2": lambda n: transformers.GPT2Config(n_embd=64, n_layer=n, n_head=4, n_positions=32, vocab_size=512,
                                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                                                  eos_token_id=0),
    }

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        config = configs[model_type](layers)
        config._attn_implementation = "sdpa"
        model = transformers.AutoModel.from_config(config)
        measured = SavedActivations(model)
        with measured:
            output = model(input_ids=torch.randint(0, 512, (4, 32)))  # its graph holds what is counted
        held = measured.current
        del output
        return held

    per_layer = saved(3) - saved(2)
    spec = ModelSpec.from_hf_config(configs[model_type](2), seq_length=32)
    planned = block_activation_bytes(spec, Layout(micro_batch_size=4), FP32)
    assert planned / per_layer == pytest.approx(planned_share, abs=0.005)


def test_zero_bubble_holds_a_chunk_until_its_weight_gradient_which_rank_r_defers_by_r_backwards():
    # Rank 1 of 2, chunks (a block, a block + the head + the loss), 2 micro-batches. PyTorch's order there:
    # F F | F I | F I W | ...: the weight gradient of the first backward waits for the second backward, so both
    # micro-batches' head chunks are held at once, the first without its loss (the input gradient freed it).
    # Interleaved 1F1B frees each at its (full) backward.
    block, head, loss = 1.0, 5.0, 3.0
    chunks = [block, block + head + loss]
    assert interleaved_peak(chunks, 2, 2, 1, zero_bubble=True, input_gradient_frees=[0.0, loss]) == \
        2 * block + (block + head) + (block + head + loss)
    assert interleaved_peak(chunks, 2, 2, 1, zero_bubble=True) == 2 * block + 2 * (block + head + loss)
    assert interleaved_peak(chunks, 2, 2, 1) == 2 * block + (block + head + loss)
    assert interleaved_peak(chunks, 2, 2, 1, input_gradient_frees=[0.0, loss]) == 2 * block + (block + head + loss)
    # Rank 0 defers by none: on 4 ranks with 8 micro-batches its peak is the plain walk's, with zero bubble's
    # shorter warm-up (one forward per later rank, not two).
    assert interleaved_peak([1.0, 1.0], 8, 4, 0, zero_bubble=True) < interleaved_peak([1.0, 1.0], 8, 4, 0)
