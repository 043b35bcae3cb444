"""policy="auto" on a model with several lists of blocks (issue 52): an encoder's layers and a decoder's, or two
stacks run in turns (transformers' git, hrm_text). Tensor parallelism splits every list, the share left whole
counts them all, and the pipeline still cuts one list. Here: the plan only, in one process, at tp=2."""

import pytest
import torch
from torch import nn

from lightning_3d.policies import PlanOptions, PolicyError
from lightning_3d.policies.auto import AutoPolicy, block_lists
from lightning_3d.policies.auto_tp import sharded_share
from lightning_3d.policies.projections import ColumnSplit, RowSplit


class Block(nn.Module):
    """A pre-norm MLP block: the smallest thing auto splits (up columns, down rows)."""

    def __init__(self, n_embd: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n_embd)
        self.up = nn.Linear(n_embd, width)
        self.down = nn.Linear(width, n_embd)

    def forward(self, x):  # (B, T, C)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class EncoderDecoderLM(nn.Module):
    """Two lists of blocks of different widths, both run on every call: the encoder's, then the decoder's."""

    def __init__(self, vocab: int = 64, n_embd: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n_embd)
        self.encoder = nn.ModuleList(Block(n_embd, 64) for _ in range(2))
        self.decoder = nn.ModuleList(Block(n_embd, 128) for _ in range(3))
        self.altup = nn.ModuleList(nn.Linear(n_embd, n_embd) for _ in range(2))  # bare projections: no blocks
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, ids):  # (B, T)
        x = self.embed(ids)
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return self.head(x + self.altup[0](x))


class TwoStacksLM(nn.Module):
    """Two lists of blocks of one class and the same length, run in turns (as hrm_text's L and H modules)."""

    def __init__(self, vocab: int = 64, n_embd: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, n_embd)
        self.low = nn.ModuleList(Block(n_embd, 64) for _ in range(2))
        self.high = nn.ModuleList(Block(n_embd, 64) for _ in range(2))
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, ids):  # (B, T)
        x = self.embed(ids)
        high = torch.zeros_like(x)
        for _ in range(2):
            for block in self.low:
                x = block(x + high)
            for block in self.high:
                high = block(high + x)
        return self.head(high)


def lightning_root(model: nn.Module) -> nn.ModuleDict:
    with torch.device("meta"):
        return nn.ModuleDict({"model": model})


def plan(root, **options):
    return AutoPolicy().plan(root, PlanOptions(tp=2, **options))


@pytest.mark.parametrize("model_class, lists", [(EncoderDecoderLM, dict(encoder=2, decoder=3)),
                                                 (TwoStacksLM, dict(low=2, high=2))])
def test_every_list_of_blocks_is_split_over_tp(model_class, lists):
    with torch.device("meta"):
        root = lightning_root(model_class())
    every_block = [f"model.{name}.{i}" for name, length in lists.items() for i in range(length)]
    found = plan(root)
    for block in every_block:
        assert isinstance(found.tp_plan.get(f"{block}.up"), ColumnSplit), (block, sorted(found.tp_plan))
        assert isinstance(found.tp_plan.get(f"{block}.down"), RowSplit), block
    sharded, total = sharded_share(root, every_block, found.tp_plan)
    assert sharded / total >= 0.9, (sharded, total)


def test_the_pipeline_cuts_one_list_the_longest():
    with torch.device("meta"):
        root = lightning_root(EncoderDecoderLM())
    assert plan(root).blocks == [f"model.decoder.{i}" for i in range(3)]
    assert AutoPolicy().plan(root, PlanOptions(tp=1)).blocks == [f"model.decoder.{i}" for i in range(3)]


def test_a_list_of_bare_projections_is_no_list_of_blocks():
    with torch.device("meta"):
        root = lightning_root(EncoderDecoderLM())
    assert all("altup" not in block for blocks in block_lists(root) for block in blocks)
    assert not any(fqn.startswith("model.altup") for fqn in plan(root).tp_plan)


def test_a_list_left_whole_counts_against_the_replicated_limit():
    # The encoder's blocks mix with an nn.Bilinear, which auto does not split, so it stays whole on every rank
    # (its input projection is split, its output gathered): 2 x 32,800 of the 92,896 block parameters plus the
    # norms (71%), over the 10% "auto" leaves whole without being told. The refusal names the Bilinear.
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Bilinear(32, 32, 32)
            self.proj = nn.Linear(32, 32, bias=False)

        def forward(self, x):
            return x + self.mix(x, self.proj(x))

    model = EncoderDecoderLM()
    model.encoder = nn.ModuleList(Mixer() for _ in range(2))
    with torch.device("meta"):
        root = lightning_root(model)
    with pytest.raises(PolicyError, match=r"leave 71% .* In model.encoder.0 \(every block of its kind\), not split:"
                                          r"\n  mix \(Bilinear, 32,800 weights\)"):
        plan(root)


def test_sequence_parallel_with_several_lists_is_refused_before_any_split():
    with torch.device("meta"):
        root = lightning_root(TwoStacksLM())
    with pytest.raises(PolicyError, match=r"2 lists of blocks \(model.low \(2\), model.high \(2\)\).*sequence_parallel=False"):
        plan(root, sequence_parallel=True)
