"""The parity harness: run one training case in one process and under a layout, and compare.

A :class:`Case` is plain data (JSON-able), so one launch of N ranks (``launch``) can run many cases in a row:
process start-up (importing torch and Lightning) is paid once per launch, not per layout -- and not even
once per launch: the ranks are forked from one interpreter per test session that imported it all
(helpers/forkrun.py).
Each run records the global per-step loss (mean over all ranks) and the full parameters after training
(gathered from whatever shards and stages hold them), keyed by their single-device FQNs.

The reference is :func:`run_reference`: plain Lightning on one device, no lightning_3d strategy involved,
with the global batch and the same sample order Lightning's distributed sampler deals out.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from helpers import WORKERS
from helpers.launchers import run_forked
from helpers.toy_model import ToyLightningModule
from helpers.user_models import LlamaStyleModule, NanoGPTModule, UserLlamaModule
from lightning_3d.callbacks import GradNormMonitor, ThroughputMonitor
from lightning_3d.models import GPTConfig, GPTLightningModule, HFCausalLMModule, SyntheticDataModule

SEED = 1234
ADAM_EPS = 1e-3
"""AdamW's eps in every parity run. Adam divides a gradient by its own size: at the default 1e-8, a weight
whose gradient is rounding noise (the tiny models have gradients down to 1e-8, fp32 rounding of a sum is
~1e-7 of its terms) moves by a whole learning rate in a direction that the summation order picks, so two
correct layouts end ~lr apart and no tolerance is both tight and machine-independent. Below eps the update
is linear in the gradient: a rounding error dg then moves a weight by lr * dg / eps per step (1e-2 * 1e-9 /
1e-3 = 1e-8), and above it by lr times the gradient's relative error (~1e-6), so 6 steps stay near 1e-7 and
the 1e-5 parameter tolerance holds with a margin of ~100 on any CPU (measured on cases that failed at
eps=1e-8 on another machine: Llama tp2 tied 5.9e-5 -> 1.2e-7, GPT tp2 clipped 1.1e-5 -> 1.2e-7)."""

SWEEP_STEPS = 3
"""Steps of the layout sweeps (test_parity_pipeline, test_parity_zero; 5 until issue 18, which cost them 30%
more): the warm-up step at half the learning rate, then two at the full rate with Adam's moments of the steps
before. What a layout can get wrong -- a gradient, its reduction over dp or tp, a shard's optimizer state, the
schedule's order, accumulation -- shows in the per-step losses and gradient norms or the parameters by then."""


@dataclass(kw_only=True)
class Case:
    """One training run. ``strategy`` is "single", "ddp" or "3d" (then ``strategy_kwargs`` go to ThreeDStrategy)."""

    name: str
    strategy: str = "3d"
    strategy_kwargs: dict = field(default_factory=dict)
    module: str = "gpt"
    """Which LightningModule: "gpt" (built in configure_model), "gpt_eager" (built in __init__), "gpt_self"
    (training_step calls ``self(...)``, i.e. LightningModule.forward), "toy" (a non-GPT model, toy_model.py),
    "user_nanogpt" / "user_llama" / "user_llama_style" (models written without lightning_3d in mind, built in
    configure_model, user_models.py),
    "hf" (a Hugging Face causal LM, ``HFCausalLMModule``; ``model`` then holds ``model_type``, ``seq_len`` and
    the HF config's sizes), "hf_padded" (the same, calling the model with a padding mask too), "hf_labels"
    (the same, the loss computed by the model from ``labels=``)."""
    dp: int = 1
    """Data-parallel size of the run: the global batch is split into dp per-rank batches."""
    global_batch_size: int = 8
    steps: int = 6
    accumulate_grad_batches: int = 1
    learning_rate: float = 1e-2
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    precision: str = "32-true"
    """Lightning's ``Trainer(precision=...)``, for the run and its reference."""
    reference_weights: str | None = None
    """A torch state dict of the inner model that the reference loads with ``load_state_dict(strict=True)``
    before training (what the run gets through ``init_from``)."""
    model: dict = field(default_factory=lambda: dict(n_layer=2, n_embd=32, n_head=4, block_size=16))
    save_checkpoint: str | None = None
    """A path: after training, ``trainer.save_checkpoint`` writes the run's sharded checkpoint there."""


@dataclass
class Result:
    losses: list[float]
    params: dict[str, torch.Tensor]
    logged: list[float] = field(default_factory=list)
    """``train_loss`` as ``self.log`` recorded it on global rank 0 (what the logger sees), per step."""
    grad_norms: list[float] = field(default_factory=list)
    """``grad_norm/global`` as GradNormMonitor logged it, per step."""
    model_parameters: int = 0
    """The whole model's parameter count as ThroughputMonitor saw it (for its MFU)."""
    rank_parameter_bytes: list[int] = field(default_factory=list)
    """Bytes of parameters each global rank holds after training (its shards, of its stages)."""


# ---------------------------------------------------------------------------------------------- modules


class EagerGPTModule(GPTLightningModule):
    """The reference module with its model built in ``__init__`` (the "exact" init path)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.configure_model()


class SelfCallingGPTModule(GPTLightningModule):
    """training_step goes through ``self(...)`` (LightningModule.forward), as many modules do."""

    def _loss(self, batch):
        tokens, targets = batch
        logits = self(tokens)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ExplicitPipelineGPTModule(GPTLightningModule):
    """Uses the engine's explicit hook; its training_step calls the model twice (as no interception could
    follow), which the explicit hook never runs under a pipeline."""

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        logits = self.model(tokens)
        logits = logits + 0.0 * self.model(tokens)  # a second call, same value
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def pipeline_inputs(self, batch):
        return (batch[0],)

    def pipeline_loss(self, logits, batch):
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss


class PaddedHFModule(HFCausalLMModule):
    """Passes a padding mask with the tokens: every other sequence ends in 3 padding positions."""

    def logits(self, tokens):
        mask = torch.ones_like(tokens)
        mask[::2, -3:] = 0
        return self.model(input_ids=tokens, attention_mask=mask).logits


class LabelsHFModule(HFCausalLMModule):
    """Lets the model compute its own loss, the Hugging Face way: ``self.model(input_ids=..., labels=...)``."""

    def _loss(self, batch):
        tokens, _ = batch
        return self.model(input_ids=tokens, labels=tokens).loss


MODULES = {"gpt": GPTLightningModule, "gpt_explicit_pipeline": ExplicitPipelineGPTModule, "gpt_eager": EagerGPTModule, "gpt_self": SelfCallingGPTModule,
           "toy": ToyLightningModule, "user_nanogpt": NanoGPTModule, "user_llama": UserLlamaModule,
           "user_llama_style": LlamaStyleModule}


class ReferenceDataModule(SyntheticDataModule):
    """One process, whole global batches, in the order Lightning's (shuffling) distributed sampler uses."""

    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=SEED)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=True)


class LossRecorder(L.Callback):
    """The loss of each optimizer step, averaged over every rank (so over dp) and over accumulation."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.logged: list[float] = []
        self.grad_norms: list[float] = []
        self._pending: list[torch.Tensor] = []
        self._pending_logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._pending.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean"))
        self._pending_logged.append(float(trainer.callback_metrics["train_loss"]))
        if len(self._pending) == trainer.accumulate_grad_batches:
            self.grad_norms.append(float(trainer.callback_metrics["grad_norm/global"]))
            self.losses.append(torch.stack(self._pending).mean().item())
            self.logged.append(sum(self._pending_logged) / len(self._pending_logged))
            self._pending, self._pending_logged = [], []


# ---------------------------------------------------------------------------------------------- runs


def _model_parameters(trainer: L.Trainer) -> int:
    return next(c.model_parameters for c in trainer.callbacks if isinstance(c, ThroughputMonitor))


def _trainer(case: Case, strategy, devices: int, recorder: LossRecorder) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=case.steps,
        accumulate_grad_batches=case.accumulate_grad_batches,
        gradient_clip_val=case.gradient_clip_val,
        gradient_clip_algorithm=case.gradient_clip_algorithm,
        precision=case.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # Lightning's sanity check (its default 2 batches) before training, as a user's run has it: an evaluation
        # step that changes what the next training step computes (FSDP2 left its gathered parameters registered
        # after a forward-only pipeline step, and dp x pp lost the first step's update) shows in every case.
        num_sanity_val_steps=2,
        limit_val_batches=2,
        callbacks=[GradNormMonitor(every_n_steps=1), ThroughputMonitor(every_n_steps=2), recorder],
    )


def _module_and_data(case: Case, per_rank_batch: int, data_cls=SyntheticDataModule):
    L.seed_everything(SEED, verbose=False)
    if case.module.startswith("hf"):  # case.model: {"model_type": ..., "seq_len": ..., the HF config's sizes}
        sizes = dict(case.model)
        model_type, seq_len = sizes.pop("model_type"), sizes.pop("seq_len")
        cls = {"hf": HFCausalLMModule, "hf_padded": PaddedHFModule, "hf_labels": LabelsHFModule}[case.module]
        pretrained = sizes.pop("pretrained", None)  # a config.json directory: built in configure_model
        module = cls(model_type, sizes, pretrained=pretrained, learning_rate=case.learning_rate, warmup_steps=2,
                     adam_eps=ADAM_EPS)
        vocab_size = sizes["vocab_size"]
    else:
        config = GPTConfig(**case.model)
        module = MODULES[case.module](config=config, learning_rate=case.learning_rate, warmup_steps=2,
                                      adam_eps=ADAM_EPS)
        vocab_size, seq_len = config.vocab_size, config.block_size
    data = data_cls(vocab_size=vocab_size, seq_len=seq_len, batch_size=per_rank_batch, seed=SEED)
    return module, data


def run_reference(case: Case) -> Result:
    """The case in this process on one device with plain Lightning (no lightning_3d strategy)."""
    module, data = _module_and_data(case, case.global_batch_size, ReferenceDataModule)
    recorder = LossRecorder()
    trainer = _trainer(case, "auto", 1, recorder)
    if case.reference_weights:
        trainer.callbacks.append(LoadWeights(case.reference_weights))
    trainer.fit(module, data)
    return Result(recorder.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}, recorder.logged,
                  recorder.grad_norms, _model_parameters(trainer))


class LoadWeights(L.Callback):
    """The plain single-device way to start from a state dict: ``load_state_dict(strict=True)``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.model.load_state_dict(torch.load(self.path), strict=True)


_REFERENCES: dict[tuple, Result] = {}


def reference_for(case: Case) -> Result:
    """The one-process run that ``case`` must match: same module, global batch, accumulation, steps (cached)."""
    key = (case.module, case.global_batch_size, case.accumulate_grad_batches, case.steps, repr(case.model),
           case.learning_rate,
           case.gradient_clip_val, case.gradient_clip_algorithm, case.reference_weights, case.precision)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_reference(case)
    return _REFERENCES[key]


def run_distributed(case: Case) -> Result | None:
    """The case on every rank of the current launch; the result on global rank 0, None elsewhere."""
    from lightning_3d import ThreeDStrategy

    world = int(os.environ["WORLD_SIZE"])
    module, data = _module_and_data(case, case.global_batch_size // case.dp)
    strategy = ThreeDStrategy(**case.strategy_kwargs) if case.strategy == "3d" else case.strategy
    recorder = LossRecorder()
    trainer = _trainer(case, strategy, world, recorder)
    trainer.fit(module, data)
    if case.save_checkpoint:
        trainer.save_checkpoint(case.save_checkpoint)
    params = gather_full_state(module)
    result = Result(recorder.losses, params, recorder.logged, recorder.grad_norms, _model_parameters(trainer),
                    _parameter_bytes_per_rank(module))
    return result if dist.get_rank() == 0 else None


def _parameter_bytes_per_rank(module: torch.nn.Module) -> list[int]:
    from torch.distributed.tensor import DTensor

    local = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in module.parameters())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, local)
    return per_rank


def gather_full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full CPU tensor under its single-device FQN, on global rank 0 (other
    ranks: empty). Collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    local = {}
    persistent = module.state_dict().keys()  # not, e.g., a rotary embedding's frequencies (as the reference)
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:  # tied parameters under each of their names, as in a state dict
        if name not in persistent:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        local[name] = full.detach().cpu().clone()
    # To rank 0 only: an all-gather had every rank unpickle every rank's copy (8 x 8 at world 8), ~10% of a
    # one-step case's CPU time.
    per_rank = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, per_rank, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for state in per_rank or []:
        merged.update(state)
    return merged


# ---------------------------------------------------------------------------------------------- launch


def launch(cases: list[Case], nprocs: int, out_dir: Path, timeout: float = 600) -> dict[str, Result]:
    """Run ``cases`` one after another in one launch of ``nprocs`` ranks (gloo; forked, :func:`forkrun`);
    results by name.

    A hang or a crash fails within ``timeout`` seconds with the ranks' output, never silently. A non-zero exit
    after every case has saved its result (once seen: a rank dying at interpreter exit, after the last case)
    is reported as a warning with the output, not as a failure of the cases."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps([asdict(c) for c in cases]))
    args = [str(WORKERS / "parity_worker.py"), str(cases_file), str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = run_forked(nprocs, args, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-4000:] if isinstance(err.stdout, bytes) else (err.stdout or "")[-4000:]
        raise AssertionError(f"launch of {nprocs} ranks did not finish within {timeout}s:\n{tail}") from err
    missing = [c.name for c in cases if not (out_dir / f"{c.name}.pt").exists()]
    if proc.returncode != 0 and missing:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        raise AssertionError(f"launch of {nprocs} ranks failed ({proc.returncode}) before {missing}:\n"
                             f"{proc.stdout[-2000:]}\n" + "\n".join(errors[-40:]) + "\n" + proc.stderr[-4000:])
    if proc.returncode != 0:  # every case finished and was saved; a rank then died on its way out
        warnings.warn(f"launch of {nprocs} ranks exited with {proc.returncode} after saving every result:"
                      f" {proc.stderr[-1500:]}")
    return {c.name: torch.load(out_dir / f"{c.name}.pt", weights_only=False) for c in cases}


def launch_by_world_size(cases: list[Case], out_dir: Path, timeout: float = 900) -> dict[str, Result]:
    """Every ``3d`` case, in one launch per world size (dp * pp * tp), smallest first; results by name."""

    def world(case: Case) -> int:
        k = case.strategy_kwargs
        return k["data_parallel_size"] * k["pipeline_parallel_size"] * k["tensor_parallel_size"]

    found: dict[str, Result] = {}
    for size in sorted({world(c) for c in cases}):
        found.update(launch([c for c in cases if world(c) == size], size, out_dir / f"world{size}", timeout))
    return found


def assert_parity(result: Result, reference: Result, *, loss_atol: float = 1e-5, param_atol: float = 1e-5) -> None:
    """Same per-step losses, global gradient norms (GradNormMonitor) and final parameters (by FQN) as the
    reference.

    Where the sizes come from: a loss (~4, a mean over the batch's tokens summed in another order across dp
    ranks, micro-batches and vocabulary shards) differs by fp32 rounding, a few 1e-7 (seen: <= 1e-6), so
    1e-5 is ten times that; a global gradient norm is a square root of a sum of squares whose order depends
    on the layout: 1e-5 relative is ~100 times fp32's 6e-8; parameters: see ``ADAM_EPS``."""
    assert len(result.losses) == len(reference.losses) > 0, (result.losses, reference.losses)
    assert result.model_parameters == reference.model_parameters > 0
    assert len(result.grad_norms) == len(reference.grad_norms) == len(result.losses)
    for ours, theirs in zip(result.grad_norms, reference.grad_norms):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, theirs), (result.grad_norms, reference.grad_norms)
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    assert loss_diff <= loss_atol, f"losses differ by {loss_diff:.3g}:\n{result.losses}\n{reference.losses}"
    assert result.params.keys() == reference.params.keys(), (
        sorted(set(result.params) ^ set(reference.params))
    )
    worst = max(result.params, key=lambda k: (result.params[k] - reference.params[k]).abs().max().item())
    param_diff = (result.params[worst] - reference.params[worst]).abs().max().item()
    assert param_diff <= param_atol, f"parameter {worst} differs by {param_diff:.3g} after training"
