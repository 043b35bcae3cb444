"""Hugging Face weights in and out: a run started from a ``save_pretrained`` directory (``init_from``) trains as
one process that loaded it (a Mixtral's experts read per rank under expert parallelism too, stacked or stored
expert by expert), its sharded checkpoint exports (``lightning-3d convert --hf``) to a directory
``from_pretrained`` loads, and export -> load at another layout -> export gives identical files."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.harness import Case, assert_parity, launch, reference_for  # noqa: E402
from lightning_3d.checkpoint.convert import export_hf  # noqa: E402
from lightning_3d.checkpoint.safetensors_io import SafetensorsWriter  # noqa: E402

# Tied input and output embeddings, and fewer kv heads than query heads.
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
MODEL = dict(model_type="llama", seq_len=16, **SIZES)


def _pretrained(root):
    """A save_pretrained directory (one safetensors file, the tied weight stored once) of weights unlike any
    seeded init, and the same state dict as a torch file for the reference's load_state_dict."""
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SIZES))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    model.save_pretrained(root / "source")
    torch.save(model.state_dict(), root / "source.pt")
    return str(root / "source"), str(root / "source.pt")


# A mixture of experts split over ep: each rank reads only its experts' rows of the stacked weights.
MOE_SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                 use_cache=False)


def _pretrained_moe(root):
    """A Mixtral config directory, its weights (unlike any seeded init) as a safetensors file of the stacked experts
    the model holds and as a save_pretrained directory (each expert's matrices apart, Mixtral's published layout),
    and the same state dict as a torch file."""
    torch.manual_seed(8)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("mixtral", **MOE_SIZES))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    model.config.save_pretrained(root / "moe_config")
    state = model.state_dict()
    with SafetensorsWriter(root / "moe.safetensors", {k: (tuple(v.shape), v.dtype) for k, v in state.items()}) as writer:
        for name, tensor in state.items():
            writer.write(name, tensor)
    torch.save(state, root / "moe_source.pt")
    model.save_pretrained(root / "moe_saved")
    return (str(root / "moe_config"), str(root / "moe.safetensors"), str(root / "moe_saved"),
            str(root / "moe_source.pt"))


def _case(name, dp, pp, tp, strategy=(), **fields):
    kwargs = dict(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                  init_from=fields.pop("init_from"), **dict(strategy))
    return Case(name=name, module="hf", strategy_kwargs=kwargs, dp=dp, **{"model": MODEL, "steps": 4, **fields})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_weights")
    source, source_pt = _pretrained(root)
    moe_config, moe_weights, moe_saved, moe_source_pt = _pretrained_moe(root)
    # from_hf_*_meta: HFCausalLMModule(pretrained=source) builds on the meta device; no rank holds the model.
    meta = dict(MODEL, pretrained=source)
    trained = [_case("from_hf_pp2_tp2", 1, 2, 2, init_from=source, reference_weights=source_pt,
                     save_checkpoint=str(root / "pp2_tp2.ckpt")),
               _case("from_hf_tp4", 1, 1, 4, init_from=source, reference_weights=source_pt),
               _case("from_hf_pp2_tp2_meta", 1, 2, 2, init_from=source, reference_weights=source_pt, model=meta),
               _case("from_hf_dp2_tp2_zero3_meta", 2, 1, 2, init_from=source, reference_weights=source_pt, model=meta,
                     strategy={"zero_stage": 3}),
               # Mixtral built on the meta device, its experts over ep2 (of dp4) and ZeRO-3 over dp_mod_ep
               _case("from_hf_mixtral_dp4_ep2_zero3_meta", 4, 1, 1, init_from=moe_weights, reference_weights=moe_source_pt,
                     model=dict(model_type="mixtral", seq_len=16, **MOE_SIZES, pretrained=moe_config),
                     strategy={"expert_parallel_size": 2, "zero_stage": 3}),
               # the same from save_pretrained's expert-by-expert files, each rank's experts and tp rows stacked
               _case("from_hf_mixtral_saved_dp2_ep2_tp2_meta", 2, 1, 2, init_from=moe_saved,
                     reference_weights=moe_source_pt,
                     model=dict(model_type="mixtral", seq_len=16, **MOE_SIZES, pretrained=moe_config),
                     strategy={"expert_parallel_size": 2})]
    results = launch(trained, 4, root / "world4")
    exported = root / "exported"
    export_hf(root / "pp2_tp2.ckpt", exported)
    # The round trip: load the export at (2, 1, 1) with no training step, save, export again.
    reloaded = _case("reload_dp2", 2, 1, 1, init_from=str(exported), steps=0,
                     save_checkpoint=str(root / "dp2.ckpt"))
    launch([reloaded], 2, root / "world2")
    export_hf(root / "dp2.ckpt", root / "exported_again")
    return {c.name: c for c in trained}, results, root


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["from_hf_pp2_tp2", "from_hf_tp4", "from_hf_pp2_tp2_meta", "from_hf_dp2_tp2_zero3_meta",
                                  "from_hf_mixtral_dp4_ep2_zero3_meta", "from_hf_mixtral_saved_dp2_ep2_tp2_meta"])
def test_a_run_started_from_a_hugging_face_directory_trains_as_one_process_that_loaded_it(runs, name):
    cases, results, _ = runs
    reference = reference_for(cases[name])
    assert abs(results[name].losses[0] - reference.losses[0]) <= 1e-5  # the first step: the loaded weights
    assert_parity(results[name], reference)


@pytest.mark.multiprocess
def test_the_export_loads_with_from_pretrained_and_holds_the_trained_weights(runs):
    _, results, root = runs
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "exported")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    trained = results["from_hf_pp2_tp2"].params
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[f"model.{name}"]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


@pytest.mark.multiprocess
def test_export_load_at_another_layout_export_gives_identical_files(runs):
    _, _, root = runs
    for name in ("model.safetensors", "config.json"):
        assert (root / "exported" / name).read_bytes() == (root / "exported_again" / name).read_bytes(), name
    assert json.loads((root / "exported" / "config.json").read_text())["model_type"] == "llama"
