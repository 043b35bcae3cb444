"""A run started from pretrained weights (``init_from``) trains as one process that loaded the same file with
``load_state_dict`` does: a torch file, a safetensors file and a Hugging Face sharded directory, at (2,2,2),
(1,2,2), (1,1,4) and under ZeRO-3 (2,1,2)."""

import json

import pytest
import torch

from helpers.harness import Case, assert_parity, launch_by_world_size, reference_for
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
