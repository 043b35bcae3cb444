"""Starting from pretrained weights (``init_from``, lightning_3d.checkpoint.pretrained): at any layout every
rank reads only its slices, and files that do not fit are refused, naming the tensor (the runs from a file on
ranks: parity/test_parity_pretrained.py)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_3d.checkpoint.pretrained import check_init_from, load_pretrained
from lightning_3d.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.tensor_parallel import apply_tensor_parallel
from lightning_3d.policies import PlanOptions, resolve_policy

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def test_a_file_of_another_model_is_refused_naming_the_tensor(tmp_path):
    torch.save(GPT(GPTConfig(**dict(MODEL, n_embd=48))).state_dict(), tmp_path / "other.pt")
    model = torch.nn.Module()
    model.model = GPT(GPTConfig(**MODEL))
    with pytest.raises(ValueError, match=r"tok_emb.weight has shape \(64, 48\) there but model.tok_emb.weight has \(64, 32\)"):
        load_pretrained(model, str(tmp_path / "other.pt"))
    torch.save({"something.else": torch.zeros(1)}, tmp_path / "unrelated.pt")
    with pytest.raises(KeyError, match="has no 'model.tok_emb.weight' \\(nor 'tok_emb.weight'\\)"):
        load_pretrained(model, str(tmp_path / "unrelated.pt"))


def test_a_policy_names_the_checkpoint_tensors_when_they_differ(tmp_path):
    hf_like = {k.replace("blocks.", "transformer.h."): v for k, v in GPT(GPTConfig(**MODEL)).state_dict().items()}
    torch.save(hf_like, tmp_path / "renamed.pt")
    model = torch.nn.Module()
    model.model = GPT(GPTConfig(**MODEL))
    load_pretrained(model, str(tmp_path / "renamed.pt"), renames={"model.blocks.": "transformer.h.", "model.": ""})
    for key, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, hf_like[key.replace("blocks.", "transformer.h.")]), key
    with pytest.raises(KeyError, match="has no 'h.0.ln_1.weight' \\(the policy's name for 'model.blocks.0.ln_1.weight"):
        load_pretrained(model, str(tmp_path / "renamed.pt"), renames={"model.blocks.": "h.", "model.": ""})


def test_bad_files_are_refused_before_anything_is_copied(tmp_path):
    model = torch.nn.Module()
    model.model = GPT(GPTConfig(**MODEL))
    state = model.model.state_dict()
    # integers where the model has floats (float formats convert: a bf16 file loads into an fp32 model)
    torch.save({k: v.long() if k == "lm_head.weight" else v for k, v in state.items()}, tmp_path / "ints.pt")
    with pytest.raises(ValueError, match=r"lm_head.weight is torch.int64 there but model.lm_head.weight is torch.float32"):
        load_pretrained(model, str(tmp_path / "ints.pt"))
    torch.save({k: v.bfloat16() for k, v in state.items()}, tmp_path / "bf16.pt")
    load_pretrained(model, str(tmp_path / "bf16.pt"))
    # a safetensors file cut short
    layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    with SafetensorsWriter(tmp_path / "whole.safetensors", layout) as writer:
        for k, v in state.items():
            writer.write(k, v)
    data = (tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.safetensors is not a safetensors file, or is truncated \(half-written\?"
                                         r".* the safetensors package says .* of its \d+ bytes. Write or fetch it again"):
        load_pretrained(model, str(tmp_path / "cut.safetensors"))
    # a checkpoint directory still being written (lightning_3d.checkpoint.atomic)
    (tmp_path / ".last.ckpt.partial").mkdir()
    with pytest.raises(ValueError, match=r"still being written, or left half-written .* use the complete one, 'last.ckpt'"):
        check_init_from(str(tmp_path / ".last.ckpt.partial"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_init_from(str(tmp_path / "nowhere.safetensors"))


# ------------------------------------------------------------------ one process playing each tp rank of 2


@contextlib.contextmanager
def _tp_rank(rank, tp=2):
    """Rank ``rank`` of a ``tp``-rank fake process group in this process: DTensor placements and local
    slices are the real ones, collectives do nothing (init_from needs none for a file). The mesh is named
    after the rank: two unnamed meshes of two ranks compare equal, and the second rank's parameters were
    given the first rank's mesh (coordinates included) by a cache in torch."""
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=(f"tp_as_rank{rank}",))
    finally:
        dist.destroy_process_group()


def _gpt_root():
    root = torch.nn.Module()
    root.model = GPT(GPTConfig(**MODEL))
    return root, "gpt"


def _gpt2_root():
    """Hugging Face GPT-2: its fused c_attn columns [q | k | v] are a strided shard, three boxes per tp rank."""
    transformers = pytest.importorskip("transformers")
    root = torch.nn.Module()
    root.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))
    return root, "gpt2"


@pytest.mark.parametrize("build", [_gpt_root, _gpt2_root], ids=["gpt", "gpt2_fused_qkv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_a_low_precision_file_gives_each_tp_rank_its_slices(tmp_path, build, dtype):
    """At (dp, pp, tp) = (1, 1, 2) each rank's shards hold the file's values (as the safetensors package
    reads them, converted to the model's fp32) at the places its placements say, strided boxes included."""
    root, policy = build()
    torch.manual_seed(5)
    inner = root.model.state_dict()
    tied = [first.removeprefix("model.") for first, _ in resolve_policy(policy).plan(root, PlanOptions(tp=2)).tied_parameters]
    stored = {k: (0.5 * torch.randn_like(v)).to(dtype) for k, v in inner.items()
              if not (tied and k == "lm_head.weight")}  # a tied head stored once, as Hugging Face does
    save_file(stored, tmp_path / "weights.safetensors")
    expected = {k: v.float() for k, v in load_file(tmp_path / "weights.safetensors").items()}
    for rank in (0, 1):
        root, _ = build()
        with _tp_rank(rank) as mesh:
            plan = resolve_policy(policy).plan(root, PlanOptions(tp=2))
            apply_tensor_parallel(root, plan, mesh)
            load_pretrained(root, str(tmp_path / "weights.safetensors"), plan.checkpoint_names, plan.tied_parameters)
            sharded = strided = 0
            for key, tensor in get_model_state_dict(root).items():
                name = key.removeprefix("model.")
                full = expected[name if name in expected else tied[0]]
                if isinstance(tensor, DTensor):
                    assert tuple(tensor.device_mesh.get_coordinate()) == (rank,)
                    sharded += 1
                    strided += any(isinstance(p, _StridedShard) for p in tensor.placements)
                    want = distribute_tensor(full, mesh, tensor.placements, src_data_rank=None).to_local()
                    tensor = tensor.to_local()
                else:
                    want = full
                assert torch.equal(tensor, want), (rank, key)
        assert sharded >= 8 and (strided == 4 if policy == "gpt2" else strided == 0), (sharded, strided)


FORMAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                 torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool, torch.complex64]
"""Every torch dtype the safetensors package (0.8) stores."""


def test_every_dtype_of_the_format_is_written_and_read_as_the_package_does(tmp_path):
    """Our streamed writer's files load with the package, and files the package wrote read through ours."""
    torch.manual_seed(6)
    tensors = {str(dtype): torch.randn(3, 5, dtype=torch.complex64 if dtype.is_complex else torch.float32).to(dtype)
               if dtype.is_floating_point or dtype.is_complex else torch.randint(0, 100, (3, 5)).to(dtype)
               for dtype in FORMAT_DTYPES}
    with SafetensorsWriter(tmp_path / "ours.safetensors", {k: ((3, 5), v.dtype) for k, v in tensors.items()}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    save_file(tensors, tmp_path / "package.safetensors")
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        for name, tensor in tensors.items():
            read = f.get_tensor(name)
            assert read.dtype == tensor.dtype and torch.equal(read.view(torch.uint8), tensor.view(torch.uint8)), name
    reader = SafetensorsReader(tmp_path / "package.safetensors")
    for name, tensor in tensors.items():
        assert reader.dtype(name) == tensor.dtype and reader.shape(name) == (3, 5), name
        assert torch.equal(reader.read(name, (slice(1, 3), slice(2, 4))).view(torch.uint8),
                           tensor[1:3, 2:4].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("model_type, sizes", [
    ("mixtral", dict(num_local_experts=4)),  # w1 | w3 under block_sparse_moe, renamed to mlp
    ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, head_dim=8)),  # gate_proj | up_proj
    ("olmoe", dict(num_experts=4)),
])
def test_a_save_pretrained_mixture_of_experts_stored_expert_by_expert_loads_into_the_stacked_experts(
        tmp_path, model_type, sizes):
    """save_pretrained writes each expert apart (the models' published layout); init_from stacks them as
    transformers' conversion mapping says: every tensor equals the saved model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               num_experts_per_tok=2, use_cache=False, **sizes)
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        assert not any(key.endswith("gate_up_proj") for key in f.keys())  # stored expert by expert
    torch.manual_seed(1)
    loaded = torch.nn.ModuleDict({"model": transformers.AutoModelForCausalLM.from_config(config)})
    load_pretrained(loaded, str(tmp_path / "saved"))
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded["model"].state_dict()[name], tensor), name


def test_a_region_of_a_stacked_tensor_reads_only_the_experts_and_features_it_covers():
    """The gate | up stack of 4 experts read in regions that cross the gate / up boundary: each copy asks the
    per-expert tensors for the rows inside the region only."""
    from lightning_3d.checkpoint.stacked_experts import stacked_names

    gate = {e: torch.randn(6, 5) for e in range(4)}
    up = {e: torch.randn(6, 5) for e in range(4)}
    tensors = {**{f"l.0.experts.{e}.w1.weight": t for e, t in gate.items()},
               **{f"l.0.experts.{e}.w3.weight": t for e, t in up.items()}}
    reads = []

    def copy_into(name, region, out):
        reads.append((name, region))
        out.copy_(tensors[name][region])

    merge = type("MergeModulelist", (), {"dim": 0})()
    concat = type("Concatenate", (), {"dim": 1})()
    converter = type("WeightConverter", (), {})()
    converter.__dict__.update(source_patterns=[".experts.*.w1.weight", ".experts.*.w3.weight"],
                              target_patterns=[".experts.gate_up_proj"], operations=[merge, concat])
    shapes, dtypes, copy = stacked_names({k: tuple(t.shape) for k, t in tensors.items()},
                                         {k: t.dtype for k, t in tensors.items()}, copy_into, [converter])
    whole = torch.stack([torch.cat([gate[e], up[e]]) for e in range(4)])
    assert shapes == {"l.0.experts.gate_up_proj": (4, 12, 5)}
    region = (slice(2, 4), slice(4, 9), slice(0, 5))  # experts 2, 3; gate rows 4-5 and up rows 0-2
    out = torch.empty(2, 5, 5)
    copy("l.0.experts.gate_up_proj", region, out)
    assert torch.equal(out, whole[region])
    assert sorted(name for name, _ in reads) == ["l.0.experts.2.w1.weight", "l.0.experts.2.w3.weight",
                                                 "l.0.experts.3.w1.weight", "l.0.experts.3.w3.weight"]
    assert {(r[0].start, r[0].stop) for _, r in reads} == {(4, 6), (0, 3)}
