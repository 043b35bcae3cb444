"""The census' own rules, in one process (helpers/census): which models it takes, how it configures them, how
it judges a run -- a run whose ranks hold different copies of a parameter is wrong, whatever rank 0 holds."""

import pytest
import torch

pytest.importorskip("transformers")


def test_models_are_configured_as_for_training():
    from helpers.census.configs import tiny_config

    llama = tiny_config("llama")
    assert llama["use_cache"] is False and llama["attn_implementation"] == "eager"
    assert (llama["num_hidden_layers"], llama["num_attention_heads"], llama["num_key_value_heads"]) == (4, 4, 2)
    assert llama["attention_dropout"] == 0.0 and llama["vocab_size"] == 64
    assert "tie_word_embeddings" not in llama  # the model's own default
    gpt2 = tiny_config("gpt2")
    assert (gpt2["n_layer"], gpt2["n_head"], gpt2["n_embd"]) == (4, 4, 32)
    assert gpt2["attn_pdrop"] == gpt2["resid_pdrop"] == gpt2["embd_pdrop"] == 0.0
    # multi-head latent attention makes keys and values for every head: no grouping to set
    deepseek = tiny_config("deepseek_v3")
    assert deepseek["num_key_value_heads"] == deepseek["num_attention_heads"] == 4


def test_per_layer_lists_keep_every_kind_of_layer():
    from helpers.census.configs import tiny_config

    gemma3n = tiny_config("gemma3n_text")
    assert len(gemma3n["layer_types"]) == 4 and set(gemma3n["layer_types"]) == {"sliding_attention", "full_attention"}
    assert gemma3n["intermediate_size"] == [64] * 4


def test_only_decoder_only_causal_lms_are_counted():
    from helpers.census.configs import not_decoder_only

    assert not_decoder_only("llama") is None and not_decoder_only("mamba") is None
    assert "encoder" in not_decoder_only("bert")
    assert "encoder-decoder" in not_decoder_only("whisper")
    assert "multimodal" in not_decoder_only("gemma3")
    assert "llama4_text" in not_decoder_only("llama4")


def _result(**changes):
    from helpers.harness import Result

    fields = dict(losses=[4.0, 3.9, 3.8], params={"w": torch.ones(3), "layers.0.norm": torch.ones(2)},
                  tp_sharded_block_share=[0.95, 0.95], replica_spread={"layers.0.norm": 0.0})
    return Result(**{**fields, **changes})


def test_a_run_is_judged_against_one_process():
    from helpers.census.outcomes import judge

    reference = _result()
    assert judge(_result(), reference, "tp2").status == "PASS"
    assert judge(_result(losses=[4.0, 3.9, 3.801]), reference, "pp2").status == "wrong"
    assert judge(_result(params={"w": torch.ones(3) + 1e-3, "layers.0.norm": torch.ones(2)}), reference,
                 "pp2").status == "wrong"
    unsplit = judge(_result(tp_sharded_block_share=[0.5, 0.5]), reference, "tp2")
    assert (unsplit.status, unsplit.detail) == ("unsplit", "50% of block parameters split over tp")
    assert judge(_result(tp_sharded_block_share=[0.0, 0.0]), reference, "pp2").status == "PASS"


def test_a_parameter_is_allowed_what_float32_rounding_alone_moves_one_process():
    from helpers.census.outcomes import judge, rounding_drift

    reference = _result()
    # float64 trains one process's "w" 3e-4 away: float32 rounding alone moves it that far in this model
    exact = _result(params={"w": torch.ones(3, dtype=torch.float64) + 3e-4, "layers.0.norm": torch.ones(2)})
    drift = rounding_drift(reference, exact)
    assert drift["w"] == pytest.approx(3e-4) and drift["layers.0.norm"] == 0.0
    near = _result(params={"w": torch.ones(3) + 2.4e-4, "layers.0.norm": torch.ones(2)})
    assert judge(near, reference, "tp2").status == "wrong"  # beyond the fixed bound of 1e-4
    assert judge(near, reference, "tp2", rounding=drift).status == "PASS"  # within twice the drift
    far = _result(params={"w": torch.ones(3) + 1e-2, "layers.0.norm": torch.ones(2)})  # a wrong gradient's mark
    assert judge(far, reference, "tp2", rounding=drift).status == "wrong"
    norm = _result(params={"w": torch.ones(3), "layers.0.norm": torch.ones(2) + 2.4e-4})  # rounding moved it not
    assert judge(norm, reference, "tp2", rounding=drift).status == "wrong"


def test_a_parameter_whose_copies_differ_between_ranks_is_wrong():
    from helpers.census.outcomes import judge

    # rank 0's copy matches one process; rank 1's drifted (a gradient left partial on one tp rank)
    drifted = judge(_result(replica_spread={"layers.0.norm": 2.4e-2}), _result(), "tp2")
    assert drifted.status == "wrong" and "layers.0.norm" in drifted.detail
    assert judge(_result(replica_spread={"layers.0.norm": 1e-7}), _result(), "tp2").status == "PASS"


def test_a_refusal_and_a_failure_are_told_apart():
    from helpers.census.outcomes import judge
    from helpers.census.running import CaseError

    refused = judge(CaseError("lightning_3d.errors.PolicyError", True, "does not split X\nmore", rank=0), _result(),
                    "tp2")
    assert (refused.status, refused.detail) == ("refused", "does not split X")
    failed = judge(CaseError("builtins.AttributeError", False, "'Shell' object has no attribute 'weight'", rank=1),
                   _result(), "pp2")
    assert failed.status == "failed" and failed.detail.startswith("AttributeError: 'Shell'")


def test_a_launch_that_ends_inside_a_model_is_started_again_for_the_models_after_it(monkeypatch, tmp_path):
    import subprocess

    from helpers.census import running

    # B brings its launch down before any rank records it (a hang, a crash), twice; A and C train.
    launched = []

    def fake_launch(cases, folder):
        folder.mkdir(parents=True)
        launched.append([case.name.split("@")[0] for case in cases])
        for case in cases:
            if case.name.startswith("B@"):
                return subprocess.CompletedProcess([], 17, "", "lightning_3d: rank 1 hangs in ...")
            torch.save(_result(), folder / f"{case.name}.pt")
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(running, "_launch", fake_launch)
    monkeypatch.setattr(running, "case_for", lambda model, layout: running.Case(name=f"{model}@{layout}"))
    outcomes = running.run_layout(["A", "B", "C"], "pp2", tmp_path)
    assert launched == [["A", "B", "C"], ["B", "C"], ["C"]]  # B once more, then the rest
    assert isinstance(outcomes["B"], running.CaseError) and "hangs" in outcomes["B"].message
    assert outcomes["A"].losses == outcomes["C"].losses == [4.0, 3.9, 3.8]


def test_a_refusal_is_one_of_lightning_3ds_own_errors():
    from helpers.workers.census_worker import describe
    from lightning_3d.errors import LayoutError, PolicyError, StepPatternError

    for err in (PolicyError("no blocks"), LayoutError("heads"), StepPatternError("tuple")):
        assert describe(err)["refused"], err
    for err in (TypeError("'Shell' object is not subscriptable"), RuntimeError("input tensor has to be contiguous")):
        assert not describe(err)["refused"], err
    assert describe(PolicyError("no blocks"))["type"] == "lightning_3d.errors.PolicyError"
