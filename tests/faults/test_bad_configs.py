"""Bad configurations fail on every rank, each with a message that says what to change, before any collective
(so no rank can hang waiting for another); those only the model or the data reveal, on every rank alike. A
catalogue run in one launch, Lightning's own launcher ending every process, and a shape error inside a
pipeline stage that ends the other stage's ranks within seconds."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun, run_forked

EXPECTED = {
    "dp_times_tp_pp_is_not_world": ("ParallelConfigError", ["data_parallel_size (3)", "= 3", "world size is 2"]),
    "tp_pp_does_not_divide_world": ("ParallelConfigError", ["pipeline_parallel_size (3)", "world size 2", "[1, 2]"]),
    "unknown_policy": ("PolicyError", ["'no_such_policy'", "'gpt'", "register_policy"]),
    "no_model_at_all": ("TypeError", ["NoModel has no parameters", "configure_model()"]),
    "meta_init_of_an_eager_model": ("ParallelConfigError", ["model_init='meta'", "EagerModel", "model_init='auto'"]),
    "init_from_a_missing_file": ("FileNotFoundError", ["init_from='weights.pt': no such file or directory"]),
    "offload_without_sharding": ("ParallelConfigError", ["offload=True", "zero_stage=0", "Set zero_stage=1, 2 or 3"]),
    "non_positive_size": ("ParallelConfigError", ["tensor_parallel_size must be a positive integer, got 0"]),
    "too_few_microbatches_for_1f1b": ("ParallelConfigError", ["num_microbatches=1 < pipeline_parallel_size=2"]),
    "virtual_stages_without_interleaved_schedule": ("ParallelConfigError", ["virtual_pipeline_size=2",
                                                                            "pipeline_schedule='1f1b'"]),
    "unknown_schedule": ("ParallelConfigError", ["pipeline_schedule='pipedream'", "'interleaved_1f1b'"]),
    "zero_stage_out_of_range": ("ParallelConfigError", ["zero_stage=4", "(0, 1, 2, 3)"]),
    "unknown_activation_checkpointing": ("ParallelConfigError", ["activation_checkpointing='some'", "'selective'"]),
    "data_parallel_size_not_a_number": ("ParallelConfigError", ["data_parallel_size", "got 'two'"]),
    "zero_microbatches": ("ParallelConfigError", ["num_microbatches must be a positive integer, got 0"]),
    "sequence_parallel_without_tp": ("ParallelConfigError", ["sequence_parallel=True", "tensor_parallel_size=1"]),
    "unknown_pipeline_split": ("ParallelConfigError", ["pipeline_split='layers'", "'params'"]),
    "unknown_model_init": ("ParallelConfigError", ["model_init='lazy'", "'meta'"]),
    "non_positive_hang_timeout": ("ValueError", ["hang_timeout (-1)", "None turns the hang watchdog off"]),
    "nccl_on_cpu": ("ParallelConfigError", ["process_group_backend='nccl' needs CUDA", "'gloo'"]),
    "unsupported_precision": ("ParallelConfigError", ["got '64-true'", "precision='bf16-mixed'"]),
    "manual_optimization_under_pipeline": ("ParallelConfigError", ["manual optimization", "pp=1"]),
}


# Errors that need the model or the data, so they come after the process group exists -- but on every rank
# alike, before any rank sends anything to another, so none can hang.
EXPECTED_AFTER_SETUP = {
    "too_few_blocks_for_the_stages": ("LayoutError", ["2 blocks but the pipeline has", "= 4 stages"]),
    "batch_not_divisible_into_microbatches": ("ParallelConfigError", ["6 samples per data-parallel rank",
                                                                      "num_microbatches=4"]),
    "batch_shape_changes_between_steps": ("ValueError", ["shapes of the first one", "drop_last=True"]),
    # nanoGPT re-draws its weights in self.apply(self._init_weights): replay would give other weights.
    "meta_init_of_a_model_that_inits_in_its_parent": ("InitError", [
        "model_init='meta'", "outside any reset_parameters()", "user_models.py", "in _init_weights",
        "model_init='auto'"]),
    "heads_not_divisible_by_tp": ("LayoutError", ["n_head (3) is not divisible by tensor_parallel_size (2)"]),
    "vocab_not_divisible_by_tp": ("LayoutError", ["vocab_size (63)", "set vocab_size=64"]),
    "explicit_split_names_a_missing_block": ("LayoutError", ["not blocks of the model: ['model.blocks.7']",
                                                             "missing: ['model.blocks.1']"]),
    # Found by a fake-tensor forward of each block before its first real call (lightning_3d.parallel.shape_check).
    "tp_shapes_a_head_count_the_policy_did_not_divide": ("ShardedShapeError", [
        "model.layers.0.attention (HeadsAttention)", "(dp, pp, tp) = (1, 1, 2)", "shape '[2, 16, 4, 8]' is invalid",
        "wq 32 -> 16 (of 32 -> 32)", "heads=4", "attribute_fixes",
        "bad_config_worker.py:", "w(x).view(B, T, self.heads, C // self.heads)"]),
    # Found by tracing one block on the meta device (lightning_3d.policies.auto_tp): a refusal, not a no-op.
    "auto_cannot_split_most_of_a_block": ("PolicyError", [
        "policy='auto' would leave", "of the block parameters of HeadsLM whole on every tp rank",
        "attention.q_down, attention.q_up, attention.k, attention.v, attention.out: split over tp it does not"
        " compute what one process does", "the integer attributes tried: {'attention.heads': 4}",
        "ColumnSplit(parts=", "allow_replicated=True"]),
    "float_token_ids": ("RuntimeError", ["Expected tensor for argument #1 'indices'", "Long, Int"]),
    "cp_sequence_not_divisible": ("ParallelConfigError", ["context_parallel_size=2 cuts each sequence into 2 x 2 = 4",
                                                          "the sequence length is 14", "divisible by 4"]),
    "cp_hand_written_attention": ("ValueError", ["block 'model.layers.0' (HeadsBlock) ran without calling"
                                                 " torch.nn.functional.scaled_dot_product_attention",
                                                 "attn_implementation='sdpa'"]),
    "auto_with_a_fixed_tp_that_cannot_fit": ("NoLayoutFits", [
        "No layout of 2 ranks fits 0.0 MiB per rank", "tensor_parallel_size=2", "The smallest need is",
        "max_memory_per_device"]),
    "resume_from_a_missing_checkpoint": ("FileNotFoundError", ["No checkpoint at no/such/last.ckpt"]),
    "resume_from_an_incomplete_checkpoint": ("CheckpointError", ["not a complete lightning_3d checkpoint",
                                                                 ".metadata missing"]),
}


def test_the_catalogue_has_at_least_25_bad_configurations():
    assert len(EXPECTED) + len(EXPECTED_AFTER_SETUP) >= 25


@pytest.mark.multiprocess
def test_bad_configurations_fail_on_every_rank_before_any_collective(tmp_path):
    cases = {**EXPECTED, **EXPECTED_AFTER_SETUP}
    proc = forkrun(2, str(WORKERS / "bad_config_worker.py"), str(tmp_path), *cases, rank_files=tmp_path)
    results = [r for rank in range(2) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert len(results) == 2 * len(cases), proc.stdout[-4000:]
    for result in results:
        error_type, fragments = cases[result["case"]]
        assert result["error"] is not None, f"{result['case']} did not fail"
        assert result["error"]["type"] == error_type, result
        for fragment in fragments:
            assert fragment in result["error"]["message"], (fragment, result)
        if result["case"] in EXPECTED:
            assert not result["process_group"], f"{result['case']} failed after the process group was created"


@pytest.mark.multiprocess
def test_an_uncaught_config_error_ends_every_process(tmp_path):
    """Lightning's own launcher (devices=2 from a plain script): both ranks exit non-zero with the message,
    in seconds, and no process is left behind."""
    script = tmp_path / "bad_job.py"
    script.write_text(textwrap.dedent("""
        import lightning as L
        from lightning_3d import ThreeDStrategy
        from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ThreeDStrategy(data_parallel_size=4),
                            max_steps=1, logger=False, enable_checkpointing=False)
        trainer.fit(GPTLightningModule(config=GPTConfig(n_layer=1)), SyntheticDataModule())
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "data_parallel_size (4) * pipeline_parallel_size (1) * tensor_parallel_size (1) = 4" in proc.stderr
    assert "world size is 2" in proc.stderr
    leftover = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"processes left behind: {leftover.stdout}"


@pytest.mark.multiprocess
def test_inside_a_pipeline_stage_the_error_ends_every_rank_within_seconds_naming_it(tmp_path):
    """Stage 0's blocks fail their check at the first call; stage 1's ranks, waiting for its activations, stop
    naming the failing rank (the fault watch) instead of hanging."""
    proc = run_forked(4, [str(WORKERS / "bad_config_worker.py"), str(tmp_path), "tp_shapes_inside_a_pipeline_stage"],
                      env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert proc.returncode != 0, proc.stderr[-3000:]
    for rank in (0, 1):  # stage 0: caught by the worker, which reports it
        [result] = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["error"]["type"] == "ShardedShapeError", result
        for fragment in ["model.layers.0.attention (HeadsAttention)", "(dp, pp, tp) = (1, 2, 2)",
                         f"(dp=0, pp=0, tp={rank})", "heads=4"]:
            assert fragment in result["error"]["message"], (fragment, result)
    for rank in (2, 3):  # stage 1: never reached its own blocks
        assert f"rank {rank} (dp=0, pp=1, tp={rank - 2}) stops: rank" in proc.stderr, proc.stderr[-3000:]
    assert "failed: ShardedShapeError: model.layers.0.attention" in proc.stderr
