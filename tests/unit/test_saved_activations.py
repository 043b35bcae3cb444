"""``SavedActivations`` counts what autograd holds and holds nothing itself: a graph kept by a backward with
``retain_graph=True`` (zero bubble's input gradient, before its weight gradient) is freed with its last reference
while measured, as it is when not measured."""

import gc
import weakref

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_3d.models.gpt import Block, GPTConfig
from lightning_3d.parallel.memory import SavedActivations


def two_blocks() -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(n_embd=32, n_head=4, block_size=16)
    return nn.Sequential(Block(config), Block(config))


def measured_forward():
    """Two blocks' forward, measured: the blocks, their input, the measurement, the output."""
    stage = two_blocks()
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved = SavedActivations(stage)
    with saved:
        y = stage(x)
    return stage, x, saved, y


def test_a_graph_kept_for_a_second_backward_is_freed_with_its_output():
    stage, x, saved, y = measured_forward()
    held = saved.current
    torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
    assert saved.current == held  # kept for the second backward
    # Outputs that an op saves for its own backward (softmax, gelu's input, attention's output) are the ones a
    # handle holding the tensor -- and with it the tensor's grad_fn -- would keep alive in a cycle.
    probes = [weakref.ref(t) for t in _saved_tensors(y.grad_fn)]
    assert probes  # the graph's saved tensors were found, so the check below is not empty
    del y
    gc.collect()
    assert saved.current == 0, f"{saved.current} of {held} bytes still counted after the graph was dropped"
    assert all(probe() is None for probe in probes)


def test_zero_bubble_weight_gradient_frees_what_the_input_gradient_kept():
    """torch's split backward, as ``ScheduleInterleavedZeroBubble`` runs it on every stage but the first."""
    stage, x, saved, y = measured_forward()
    held = saved.current
    grads_in, param_groups = stage_backward_input([y], [torch.ones_like(y)], [x], stage.parameters())
    assert saved.current == held
    stage_backward_weight(stage.parameters(), param_groups)
    del param_groups, y
    gc.collect()
    assert saved.current == 0, f"{saved.current} of {held} bytes still counted after the weight gradient"
    assert saved.peak == held


def test_measuring_changes_no_gradient():
    grads = []
    for measure in (False, True):
        stage = two_blocks()
        x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        saved = SavedActivations(stage)
        if measure:
            with saved:
                y = stage(x)
        else:
            y = stage(x)
        y.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in stage.parameters()])
    for plain, measured in zip(*grads):
        torch.testing.assert_close(measured, plain, rtol=0, atol=0)


def _saved_tensors(root) -> list[torch.Tensor]:
    """The tensors each node of ``root``'s graph saved, as the unpack hook gives them back."""
    found, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                found += [v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, torch.Tensor)]
        stack += [next_node for next_node, _ in node.next_functions]
    return found
