"""Auto's plan outside the blocks: the token embedding and the output head split over the vocabulary.

The head is the ``nn.Linear`` outside the blocks whose outputs are as many as an ``nn.Embedding`` outside them
has rows (the vocabulary); that embedding is the token embedding, tied to the head or not. Each rank holds
``V / tp`` rows of each: the embedding looks up its rows and the lookups are summed (an all-reduce), the head
computes its share of the logits. A parameter tied to the head's elsewhere (BERT's ``cls.predictions.bias``,
the decoder's bias by another name) is split the same way (:class:`TiedRows`), so the pair stays one tensor.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_3d.common import parent_fqn
from lightning_3d.policies.auto_pipeline import tied_parameters


class VocabRows(RowwiseParallel):
    """The token embedding's rows split over tp, its lookups summed; the result is a tensor of its own, which
    the model may change in place (CTRL scales it: ``x *= sqrt(d_model)``). The local view of the summed
    DTensor would refuse that (autograd forbids changing a custom function's view in place); the copy costs
    one activation of the embedding's size per forward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(_own_copy)  # after the style's own hook, which made the output local
        return module

    def __repr__(self) -> str:
        return "VocabRows()"


def _own_copy(module: nn.Module, args, output):
    return output.clone() if isinstance(output, Tensor) and not isinstance(output, DTensor) else output


class TiedRows(ParallelStyle):
    """The module's own parameters ``names`` split on dim 0 over tp, as the head's parameter each is tied to."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"TiedRows({self.names})"


def vocab_parallel_styles(root: nn.Module, blocks: list[str], tp: int,
                          sharded_logits: bool) -> tuple[dict[str, ParallelStyle], str]:
    """The styles that split the embedding and head of ``root`` over the vocabulary, and what was done, in
    words. With ``sharded_logits`` (``vocab_parallel_loss``) the logits stay sharded, as the registered policies
    leave them: the step's cross-entropy runs on the shards and anything else sees them whole
    (``parallel.sharded_logits``); else they are gathered at the head."""
    outside = [(fqn, m) for fqn, m in root.named_modules()
               if fqn and not any(fqn == b or fqn.startswith(b + ".") for b in blocks)]
    rows = {m.num_embeddings for _, m in outside if isinstance(m, nn.Embedding)}
    heads = [(fqn, m) for fqn, m in outside if isinstance(m, nn.Linear) and m.out_features in rows]
    if len(heads) != 1:
        return {}, "the embeddings and the head stay whole (no one output head whose width is an embedding's rows)"
    head, linear = heads[0]
    vocab = linear.out_features
    if vocab % tp:
        return {}, (f"the embedding and head stay whole: the vocabulary ({vocab}) does not divide by"
                    f" tensor_parallel_size={tp} (pad it to {-(-vocab // tp) * tp})")
    embeddings = [fqn for fqn, m in outside if isinstance(m, nn.Embedding) and m.num_embeddings == vocab]
    normed = next((fqn for fqn in embeddings if _holds_weighted_modules(root.get_submodule(fqn))), None)
    if normed is not None:
        return {}, (f"the embedding and head stay whole: {normed} ({type(root.get_submodule(normed)).__name__}) runs"
                    " a module with weights of its own (a norm) on the rows it looks up, which a split over the"
                    " vocabulary would run on each rank's partial lookups")
    styles: dict[str, ParallelStyle] = {fqn: VocabRows(input_layouts=Replicate(), output_layouts=Replicate())
                                        for fqn in embeddings}
    logits = dict(output_layouts=Shard(-1), use_local_output=False) if sharded_logits else dict(
        output_layouts=Replicate())
    styles[head] = ColwiseParallel(input_layouts=Replicate(), **logits)
    styles.update(_tied_partners(root, head, set(styles)))
    gathered = "the logits sharded for the loss" if sharded_logits else "the logits gathered"
    return styles, f"{', '.join([*embeddings, head])} split over the vocabulary ({vocab}; {gathered})"


def _holds_weighted_modules(embedding: nn.Embedding) -> bool:
    """Whether an embedding holds modules with weights (a norm on the rows it looks up: not linear in them, as a
    scale is)."""
    return any(True for child in embedding.children() for _ in child.parameters())


def _tied_partners(root: nn.Module, head: str, styled: set[str]) -> dict[str, TiedRows]:
    """A TiedRows style for each module outside ``styled`` that holds a parameter tied to one of the head's."""
    names: dict[str, list[str]] = {}
    for first, second in tied_parameters(root):
        for mine, other in ((first, second), (second, first)):
            owner, _, name = other.rpartition(".")
            if parent_fqn(mine) == head and owner not in styled:
                names.setdefault(owner, []).append(name)
    return {owner: TiedRows(params) for owner, params in names.items()}
