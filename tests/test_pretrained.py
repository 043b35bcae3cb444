"""Starting from pretrained weights (``init_from``, lightning_3d.checkpoint.pretrained): at any layout every
rank reads only its slices, and the run trains as one process that loaded the same file with
``load_state_dict`` does."""

import json

import pytest
import torch

from harness import Case, assert_parity, launch_by_world_size, reference_for
from lightning_3d.checkpoint.pretrained import check_init_from, load_pretrained
from lightning_3d.checkpoint.safetensors_io import SafetensorsWriter
from lightning_3d.models import GPT, GPTConfig

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def _write_weights(root):
    """Weights unlike any seeded init, in three formats: torch file, safetensors file, HF sharded directory."""
    torch.manual_seed(99)
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in GPT(GPTConfig(**MODEL)).state_dict().items()}
    torch.save(state, root / "gpt.pt")
    layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    with SafetensorsWriter(root / "gpt.safetensors", layout) as writer:
        for k, v in state.items():
            writer.write(k, v)
    directory = root / "hf"
    directory.mkdir()
    halves = [list(state)[: len(state) // 2], list(state)[len(state) // 2:]]
    weight_map = {}
    for i, names in enumerate(halves):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        with SafetensorsWriter(directory / file, {k: layout[k] for k in names}) as writer:
            for k in names:
                writer.write(k, state[k])
        weight_map.update({k: file for k in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"pt": str(root / "gpt.pt"), "safetensors": str(root / "gpt.safetensors"), "hf": str(directory)}


def _case(name, dp, pp, tp, init_from, reference):
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, init_from=init_from)
    return Case(name=name, strategy_kwargs=kwargs, dp=dp, model=MODEL, steps=4, reference_weights=reference)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    files = _write_weights(root)
    cases = [_case("safetensors_2_2_2", 2, 2, 2, files["safetensors"], files["pt"]),
             _case("torch_1_2_2", 1, 2, 2, files["pt"], files["pt"]),
             _case("hf_dir_1_1_4", 1, 1, 4, files["hf"], files["pt"]),
             _case("safetensors_zero3_2_1_2", 2, 1, 2, files["safetensors"], files["pt"])]
    cases[-1].strategy_kwargs["zero_stage"] = 3
    return {c.name: c for c in cases}, launch_by_world_size(cases, root / "runs")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["safetensors_2_2_2", "torch_1_2_2", "hf_dir_1_1_4", "safetensors_zero3_2_1_2"])
def test_a_run_started_from_a_file_trains_as_one_process_that_loaded_it(runs, name):
    cases, results = runs
    reference = reference_for(cases[name])
    assert abs(results[name].losses[0] - reference.losses[0]) <= 1e-5  # the first step: the loaded weights
    assert_parity(results[name], reference)


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
    with pytest.raises(ValueError, match=r"cut.safetensors is truncated \(half-written\?\): its header describes"):
        load_pretrained(model, str(tmp_path / "cut.safetensors"))
    # a checkpoint directory still being written (lightning_3d.checkpoint.atomic)
    (tmp_path / ".last.ckpt.partial").mkdir()
    with pytest.raises(ValueError, match=r"still being written, or left half-written .* use the complete one, 'last.ckpt'"):
        check_init_from(str(tmp_path / ".last.ckpt.partial"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        check_init_from(str(tmp_path / "nowhere.safetensors"))
