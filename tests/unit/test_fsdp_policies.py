"""Precision and offload settings: FSDP2 policies from Lightning's flag, and clear errors before training."""

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

from lightning_3d import ThreeDStrategy
from lightning_3d.parallel.config import ParallelConfig, ParallelConfigError
from lightning_3d.parallel.dims import ParallelDims
from lightning_3d.parallel.precision import (
    check_precision, mixed_precision_policy, offload_policy, warn_about_no_ops)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
DP2 = ParallelDims(dp=2, pp=1, tp=1)


@pytest.mark.parametrize("plugin", [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true")])
def test_supported_precisions_pass(plugin):
    check_precision(plugin, CPU, ParallelDims(dp=2, pp=2, tp=2), ParallelConfig(zero_stage=3))


def test_fp16_mixed_on_cpu_is_refused_with_the_alternative():
    with pytest.raises(ParallelConfigError, match="'16-mixed' needs CUDA.*'bf16-mixed'"):
        check_precision(MixedPrecision("16-mixed", "cpu"), CPU, DP2, ParallelConfig())


def test_fp16_mixed_on_cuda_needs_replicated_gradients():
    check_precision(MixedPrecision("16-mixed", "cpu"), CUDA, DP2, ParallelConfig())
    with pytest.raises(ParallelConfigError, match="tp=2, pp=1, zero_stage=0 ranks hold different gradients"):
        check_precision(MixedPrecision("16-mixed", "cpu"), CUDA, ParallelDims(dp=1, pp=1, tp=2), ParallelConfig())


def test_unsupported_precision_names_the_choices():
    with pytest.raises(ParallelConfigError, match="got '64-true'.*bf16-mixed"):
        check_precision(DoublePrecision(), CPU, DP2, ParallelConfig())


def test_bf16_mixed_shards_gather_in_bf16_and_reduce_in_fp32():
    policy = mixed_precision_policy(MixedPrecision("bf16-mixed", "cpu"))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(Precision()).param_dtype is None


def test_offload_needs_sharding():
    with pytest.raises(ParallelConfigError, match="offload=True .* zero_stage=0 .* Set zero_stage=1, 2 or 3"):
        ThreeDStrategy(offload=True)


def test_offload_is_a_no_op_on_cpu_and_says_so():
    config = ParallelConfig(zero_stage=3, offload=True)
    with pytest.warns(UserWarning, match="offload=True does nothing on 'cpu'"):
        warn_about_no_ops(config, DP2, CPU)
    assert type(offload_policy(config, CPU)).__name__ == "OffloadPolicy"
    assert type(offload_policy(config, CUDA)).__name__ == "CPUOffloadPolicy"


def test_zero_without_data_parallel_says_it_shards_nothing():
    with pytest.warns(UserWarning, match="zero_stage=2 shards over the data-parallel ranks, but dp=1"):
        warn_about_no_ops(ParallelConfig(zero_stage=2), ParallelDims(dp=1, pp=2, tp=2), CPU)


@pytest.mark.parametrize("stage", [-1, 4, "3", 2.0, True])
def test_zero_stage_outside_0_to_3_is_refused(stage):
    with pytest.raises(ParallelConfigError, match="zero_stage=.* is not supported; choose one of \\(0, 1, 2, 3\\)"):
        ThreeDStrategy(zero_stage=stage)


def test_offload_on_one_rank_still_runs_fsdp2_and_trains_as_without_it(tmp_path):
    # ZeRO-Offload on one GPU: dp=1 shards nothing, but offload must not switch itself off (on CUDA the
    # FSDP2 wrapper is what keeps the state in host memory; on CPU the same wrapper runs with no offload).
    import lightning as L
    from torch.distributed.fsdp import FSDPModule

    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    def fit(**strategy):
        L.seed_everything(0, verbose=False)
        module = GPTLightningModule(config=GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64))
        losses = []
        record = type("Record", (L.Callback,), {"on_train_batch_end": lambda self, t, m, out, b, i:
                                                 losses.append(float(out["loss"]))})()
        L.Trainer(accelerator="cpu", devices=1, strategy=ThreeDStrategy(**strategy), max_steps=3, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
                  callbacks=[record]).fit(module, SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=4))
        return module, losses

    with pytest.warns(UserWarning, match="nothing is sharded. offload=True still keeps"):
        offloaded, losses = fit(zero_stage=3, offload=True)
    assert any(isinstance(m, FSDPModule) for m in offloaded.modules())
    plain, expected = fit()
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    assert losses == pytest.approx(expected, rel=1e-6)
