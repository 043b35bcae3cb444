"""What a parity run is -- a :class:`Case`, plain JSON-able data that a launch hands its ranks -- and what it
records, a :class:`Result`; with the seed, AdamW eps and sweep length every case shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    "user_nanogpt" / "user_llama" / "user_llama_style" / "user_story_lm" (models written without lightning_3d in
    mind, built in configure_model, user_models.py),
    "hf" (a Hugging Face causal LM, ``HFCausalLMModule``; ``model`` then holds ``model_type``, ``seq_len`` and
    the HF config's sizes), "hf_padded" (the same, calling the model with a padding mask too), "hf_labels"
    (the same, the loss computed by the model from ``labels=``), "hf_labels_padded" (that with a padding mask),
    "hf_microbatched" (the same, its logits
    computed on the batch in 2 halves)."""
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
    sanity_steps: int = 2
    """Lightning's sanity check before training (its default 2 batches, as a user's run has it); the census
    runs none: it judges training, and the parity suite judges the evaluation steps of every layout."""


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
    tp_sharded_block_share: list[float] = field(default_factory=list)
    """Per global rank: of the parameter elements of the blocks it holds (parameters under a numbered module,
    ``layers.3.``), the share that is sharded over the "tp" mesh dimension."""
    tp_whole_outside_blocks: list[list] = field(default_factory=list)
    """Per global rank: (name, global shape) of each parameter outside the blocks it holds that is whole over
    "tp" (not sharded): the embeddings, head and final norm a policy did not split."""
    replica_spread: dict[str, float] = field(default_factory=dict)
    """Tensor name -> the largest difference between two ranks' whole copies of it (each rank's copy of a
    replicated parameter, or its gathered full tensor), for the names more than one rank holds."""
    expert_elements: list[int] = field(default_factory=list)
    """Per global rank: the elements of the mixture-of-experts weights it holds (its local pieces of the stacked
    experts' weights), counted on the rank."""
    expert_loads: list[dict] = field(default_factory=list)
    """Per training batch: ExpertLoadMonitor's numbers (``expert_load/<layer>/min|max|mean``), as logged."""
    layout: dict | None = None
    """The layout ``layout="auto"`` chose (``planner.Layout`` as a dict: dp, tp, pp, schedule, ...); None for a
    layout given."""
