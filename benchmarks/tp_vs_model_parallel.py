"""Step time of ThreeDStrategy(tp) vs Lightning's ModelParallelStrategy with the same plan written by hand.

    python benchmarks/tp_vs_model_parallel.py [--tp 2] [--rounds 3] [--steps 30] [--n-layer 4] [--n-embd 128]

The hand-written side is what a Lightning user writes today: ``configure_model`` builds the GPT and calls
PyTorch's ``parallelize_module`` with a Megatron-style plan. Both sides gather the logits (the hand-written
one has no vocabulary-parallel loss), so they do the same work. One torchrun launch alternates them and
prints the median step times and their ratio (< 1 means ThreeDStrategy is faster).
"""

from __future__ import annotations

import argparse

from timing import compare, ensure_torchrun, step_times


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (= processes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    return parser.parse_args()


def hand_written_module(config, tp_mesh_name: str = "tensor_parallel"):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_3d.models import GPT, GPTLightningModule

    class HandParallelGPT(GPTLightningModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = GPT(self.config)
            region = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
            plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
                    "lm_head": ColwiseParallel(output_layouts=Replicate()),
                    "blocks.*.attn": region, "blocks.*.mlp": region,
                    "blocks.*.attn.q_proj": ColwiseParallel(), "blocks.*.attn.k_proj": ColwiseParallel(),
                    "blocks.*.attn.v_proj": ColwiseParallel(), "blocks.*.attn.o_proj": RowwiseParallel(),
                    "blocks.*.mlp.up_proj": ColwiseParallel(), "blocks.*.mlp.down_proj": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh[tp_mesh_name], plan)

    return HandParallelGPT(config=config)


def main() -> None:
    args = parse_args()
    ensure_torchrun(args.tp)
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, block_size=args.seq_len, vocab_size=256)

    def run(strategy, module) -> list[float]:
        L.seed_everything(0, verbose=False)
        data = SyntheticDataModule(vocab_size=256, seq_len=args.seq_len, batch_size=args.batch_size,
                                   num_train_samples=args.batch_size * (args.steps + 10))
        return step_times(strategy, module, data, args.steps, args.tp)

    compare({
        "ThreeDStrategy": lambda: run(ThreeDStrategy(tensor_parallel_size=args.tp, vocab_parallel_loss=False),
                                      GPTLightningModule(config=config)),
        "ModelParallel": lambda: run(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=args.tp),
                                     hand_written_module(config)),
    }, args.rounds, f"GPT n_layer={args.n_layer} n_embd={args.n_embd} seq={args.seq_len} batch={args.batch_size},"
                    f" tp={args.tp}, {args.steps} timed steps per run")


if __name__ == "__main__":
    main()
