"""Where NaNGuard looks at gradients: on the tensors the modules computed with, before any data-parallel reduction."""

from __future__ import annotations

import warnings
import weakref
from functools import partial

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_3d.common import local
from lightning_3d.pipeline.grad_sync import gradients_held_apart
from lightning_3d.pipeline.reduction_checks import before_reduction


class GradientChecks:
    """Records, for every gradient backward produces on this rank, whether it is finite -- before DDP or FSDP2
    reduces it over dp, so that the rank where a NaN/Inf first appears is the one that reports it.

    DDP computes gradients on the registered parameters, but FSDP2 (``fully_shard`` for ZeRO, ``replicate``
    for dp with tp or pp) swaps unsharded tensors into the modules before their forward and reduces the
    gradients of those into the registered (sharded) parameters: a hook on a registered parameter never fires
    there. So a forward pre-hook on every module that holds parameters hooks the tensors the module holds at
    that moment -- the ones autograd will differentiate -- each tensor once; the registered parameters are
    hooked too (DDP, and parameters used outside their module's forward).

    Whatever no hook saw is still checked, from ``param.grad`` after the reduction (:meth:`collect_reduced`),
    with a warning: there a NaN shows on every dp rank alike, so it is reported as found after the reduction,
    its rank of origin unknown, never as any rank's own. The checks cannot switch themselves off silently.

    Per gradient, one reduction as backward produces it (its float32 sum: finite unless an element is not, or
    the sum overflows past 3e38); the step's sums are checked together (:meth:`collect`), and only a step
    that was not finite reads them on the host to name the parameter (:func:`first_not_finite`).

    Under a pipeline (``at_reduction=True``) no hook runs per micro-batch: the stage's gradients accumulate
    unreduced over the step's micro-batches, and they are looked at once per step, right before the stage
    reduces them (``pipeline/reduction_checks.py``): one multi-tensor reduction per (device, dtype) over the
    gradients its modules then hold, and the running sums FSDP2 keeps apart from them under a reduce dtype
    other than the parameters' (``bf16-mixed``: ``pipeline.grad_sync.gradients_held_apart``)
    (:func:`_sums_of`).
    """

    def __init__(self, root: nn.Module, at_reduction: bool = False) -> None:
        self.active = False  # this step is checked
        self._sums: list[tuple[str, torch.Tensor]] = []  # (parameter, its gradient's float32 sum), backward order
        self._hooked = WeakIdKeyDictionary()  # tensor -> its hook's handle
        self._warned = False
        self._unseen: list[str] = []  # this step's gradients no check saw before the reduction
        # Under the name root.named_parameters() gives it (the first path to it, for a tied one).
        first_name: dict[int, str] = {}
        self._names: dict[tuple[int, str], str] = {}  # (id(module), parameter's name in it) -> name
        self._held: dict[int, list[weakref.ref]] = {}  # id(module) -> the tensors it held at its last forward
        self._module_hooks = []
        for module_name, module in root.named_modules():
            held = list(module.named_parameters(recurse=False))
            for short, param in held:
                name = first_name.setdefault(id(param), f"{module_name}.{short}" if module_name else short)
                self._names[(id(module), short)] = name
                if not at_reduction:
                    self._hook(param, name)
            if held and not at_reduction:
                # prepend=False: runs after FSDP2's own pre-forward hook (prepended), which swaps its tensors in.
                self._module_hooks.append(module.register_forward_pre_hook(self._hook_module_tensors))
        self._unregister = before_reduction(self._check_stage) if at_reduction else None

    def _hook_module_tensors(self, module: nn.Module, args) -> None:
        # _parameters (private): named_parameters(recurse=False) builds a generator and a memo set per call,
        # which cost more than this whole check. Once a module's tensors are all hooked, the same ones come back
        # at every forward (in every layout but FSDP2's swaps), so that is looked at first.
        held = [(short, tensor) for short, tensor in module._parameters.items() if tensor is not None]
        last = self._held.get(id(module))
        if last is not None and len(last) == len(held) and all(ref() is t for ref, (_, t) in zip(last, held)):
            return
        all_hooked = True
        for short, tensor in held:
            name = self._names.get((id(module), short))
            if name is None:  # a copy of the module (pipeline shape inference), or a parameter added later
                all_hooked = False
                continue
            self._hook(tensor, name)
            all_hooked = all_hooked and tensor.requires_grad  # a frozen one may be unfrozen later: look again
        if all_hooked:
            self._held[id(module)] = [weakref.ref(tensor) for _, tensor in held]

    def _hook(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.requires_grad and tensor not in self._hooked:
            self._hooked[tensor] = tensor.register_hook(partial(self._record, name))

    def _record(self, name: str, grad: torch.Tensor) -> None:
        if self.active:  # no host sync here: the sums are looked at once, before the optimizer step
            self._sums.append((name, _sum(grad)))

    def _check_stage(self, stage: nn.Module) -> None:
        """Before ``stage``'s gradients are reduced: the sum of each, as its modules hold it then (the tensors
        the micro-batches' backwards accumulated into), and of the running sums FSDP2 holds apart."""
        if not self.active:
            return
        held = [(self._names.get((id(module), short)), tensor.grad) for module in stage.modules()
                for short, tensor in module._parameters.items() if tensor is not None and tensor.grad is not None]
        held += [(self._names.get((id(module), short)), running)
                 for module, short, running in gradients_held_apart(stage)]
        held = [(name, grad) for name, grad in held if name is not None]  # not a copy of a module (shape inference)
        self._sums.extend(_sums_of(held))

    def collect(self, root: nn.Module, step: int) -> tuple[list[str], torch.Tensor | None]:
        """The gradients this step's checks saw before the reduction, in the order seen, and whether each was
        finite (a bool device tensor; None without any); forgets their sums. Those of ``root``'s gradients that
        none saw are left for :meth:`collect_reduced` (with a warning, once)."""
        sums, self._sums = self._sums, []
        seen = {name for name, _ in sums}
        self._unseen = [name for name, p in root.named_parameters() if p.grad is not None and name not in seen]
        if self._unseen:
            self._warn_unseen(self._unseen, len(seen), step)
        if not sums:
            return [], None
        return [name for name, _ in sums], torch.stack([value for _, value in sums]).isfinite()  # (gradients,)

    def collect_reduced(self, root: nn.Module) -> tuple[list[str], torch.Tensor | None]:
        """After :meth:`collect`: the gradients no check saw before the reduction, as the reduction left them,
        and whether each is finite (None without any). A NaN/Inf here shows on every dp rank alike: where it
        came from is not known."""
        unseen, self._unseen = set(self._unseen), []
        named = [(name, p.grad) for name, p in root.named_parameters() if name in unseen and p.grad is not None]
        if not named:
            return [], None
        return [name for name, _ in named], torch.stack([value for _, value in _sums_of(named)]).isfinite()

    def _warn_unseen(self, unseen: list[str], seen: int, step: int) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"NaNGuard: at step {step}, {len(unseen)} parameters have a gradient that no hook saw as backward"
            f" produced it ({seen} others were seen), first {unseen[0]!r}. Their gradients are checked after the"
            " data-parallel reduction instead, where a NaN/Inf shows on every dp rank alike, so the rank it came"
            " from cannot be told for them. Parameters used outside their module's forward are not seen (use"
            " the module); otherwise this layout computes gradients on tensors the guard does not know: please"
            " report it with the layout.", RuntimeWarning, stacklevel=2)

    def remove(self) -> None:
        for handle in [*self._module_hooks, *self._hooked.values()]:
            handle.remove()
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        self._module_hooks = []
        self._hooked = WeakIdKeyDictionary()


def first_not_finite(names: list[str], finite: torch.Tensor) -> str | None:
    """The first of ``names`` whose ``finite`` flag is False, or None. It reads the flags on the host: for a step
    already known to hold a NaN/Inf."""
    bad = finite.logical_not().nonzero()
    return names[int(bad[0])] if len(bad) else None


def _sum(grad: torch.Tensor) -> torch.Tensor:
    return local(grad).sum(dtype=torch.float32)


def _sums_of(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """For gradients looked at together (a stage's before its reduction, or after it), each one's float32 sum of
    absolute values -- finite unless an element is not, or the sum passes 3e38, as :func:`_sum` -- from one
    ``torch._foreach_norm`` (L1) per (device, dtype) group: one multi-tensor kernel per group on a GPU, not one
    per gradient. In the order given."""
    groups: dict[tuple, list[int]] = {}
    pieces = [local(grad) for _, grad in named]
    for index, piece in enumerate(pieces):
        groups.setdefault((piece.device, piece.dtype), []).append(index)
    values: list[torch.Tensor | None] = [None] * len(named)
    for (_, dtype), indices in groups.items():
        at_least_float32 = torch.promote_types(dtype, torch.float32)  # float64 stays float64
        for index, value in zip(indices, torch._foreach_norm([pieces[i] for i in indices], 1, dtype=at_least_float32)):
            values[index] = value
    return [(name, value) for (name, _), value in zip(named, values)]
