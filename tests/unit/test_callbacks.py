"""Callbacks that watch a 3D run. GradNormMonitor's global norm is checked in every parity case
(helpers/harness compares it with the single-process run); here: NaNGuard and the monitors' own logic in one
process (NaNGuard on ranks: faults/test_nan_guard.py)."""

import pytest

from lightning_3d.callbacks import GradNormMonitor, NaNGuard


def test_unknown_nan_guard_actions_are_rejected():
    with pytest.raises(ValueError, match=r"NaNGuard\(action='ignore'\) is not one of \('raise', 'skip', 'rollback'\)"):
        NaNGuard(action="ignore")
    with pytest.raises(ValueError, match=r"rollback_lr_factor=2\) must be in \(0, 1\]"):
        NaNGuard(action="rollback", rollback_lr_factor=2)


def test_a_rank_far_above_its_stage_median_is_flagged_with_its_coordinates():
    from lightning_3d import ParallelDims

    monitor = GradNormMonitor(outlier_factor=10.0)
    dims = ParallelDims(dp=2, pp=2, tp=1)  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    norms = [1.0, 1.1, 0.9, 50.0]
    for stage in range(2):
        monitor._flag_outliers(7, dims, norms, [r for r in range(4) if dims.coords(r).pp == stage])
    assert [(o["step"], o["rank"], o["coords"]) for o in monitor.outliers] == [(7, 3, {"dp": 1, "pp": 1, "tp": 0})]


def test_gradients_no_hook_saw_are_still_checked_and_the_guard_says_so(tmp_path):
    import lightning as L
    import torch

    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    class ManualGradients(GPTLightningModule):
        def backward(self, loss, *args, **kwargs):  # as an unknown wrapper computing gradients elsewhere would
            for param in self.parameters():
                param.grad = torch.zeros_like(param)
            self.model.lm_head.weight.grad[0, 0] = float("nan")

    guard = NaNGuard(action="skip")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[guard], default_root_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=r"at step 0, \d+ parameters have a gradient that no hook saw"):
        trainer.fit(ManualGradients(config=GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)),
                    SyntheticDataModule(seq_len=8, batch_size=2))
    assert guard.skipped_steps == [0, 1]


def test_rollback_without_a_model_checkpoint_is_refused_at_the_start(tmp_path):
    import lightning as L

    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[NaNGuard(action="rollback")])
    with pytest.raises(ValueError, match="has no ModelCheckpoint callback. Add one"):
        trainer.fit(GPTLightningModule(config=GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)),
                    SyntheticDataModule(seq_len=8, batch_size=2))


def test_throughput_monitor_logs_rates_and_mfu_from_the_whole_model(tmp_path):
    import lightning as L

    from lightning_3d.callbacks import ThroughputMonitor
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    config = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)
    monitor = ThroughputMonitor(every_n_steps=2, peak_flops=1e12)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(GPTLightningModule(config=config), SyntheticDataModule(seq_len=16, batch_size=4))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("throughput/")}
    assert monitor.model_parameters == config.num_parameters()
    assert metrics["throughput/tokens_per_sec"] == pytest.approx(16 * metrics["throughput/samples_per_sec"])
    assert metrics["throughput/mfu"] == pytest.approx(6 * config.num_parameters() * metrics["throughput/tokens_per_sec"] / 1e12)
    assert metrics["throughput/step_time_skew"] == 1.0


def test_a_single_process_logs_zero_communication(tmp_path):
    import lightning as L

    from lightning_3d.callbacks import CommTimer
    from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[CommTimer(every_n_steps=1)], default_root_dir=tmp_path)
    trainer.fit(GPTLightningModule(config=GPTConfig(n_layer=1, n_embd=32, block_size=16)),
                SyntheticDataModule(seq_len=16, batch_size=2))
    comm = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}
    assert comm and all(value == 0.0 for value in comm.values()), comm


def test_nan_guard_agrees_across_ranks_on_the_ranks_own_device(monkeypatch):
    """Found on an H200 (benchmarks/gpu_collectives.py, NCCL-only group): the guard's one all-reduce per step
    took a host tensor whenever the backend's name was not exactly "nccl" ("cuda:nccl" alone: "No backend type
    associated with device type cpu"). It must take the strategy's device, whatever the backend is called."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    class Reached(Exception):
        pass

    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Reached

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *args: "cuda:nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    guard = NaNGuard()
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(root_device=torch.device("meta")))
    module = torch.nn.Linear(2, 2)  # its parameters on the host, as an offloaded or CPU-built module's are
    with pytest.raises(Reached):
        guard.on_before_optimizer_step(trainer, module, optimizer=None)
    assert seen == [torch.device("meta")]


class _HostReads:
    """Counts the host's reads of tensor values during a step (``.item()``, ``bool()``, ``float()``: the
    dispatcher's ``_local_scalar_dense``; ``.tolist()``, ``.cpu()``: patched), split into reads of values the
    step itself computed -- a host sync on a GPU -- and of values computed before it."""

    def __init__(self, monkeypatch):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.of_this_step = self.of_earlier_steps = 0
        self._made: dict[int, object] = {}  # id -> a tensor made in this step (kept, so no id is reused)
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counter._count(args[0])
                out = func(*args, **(kwargs or {}))
                for tensor in (out if isinstance(out, (tuple, list)) else [out]):
                    if isinstance(tensor, torch.Tensor):
                        counter._made[id(tensor)] = tensor
                return out

        self._mode = Mode()
        for name in ("tolist", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                counter._count(tensor)
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def _count(self, tensor) -> None:
        if id(tensor) in self._made:
            self.of_this_step += 1
        else:
            self.of_earlier_steps += 1

    def __enter__(self):
        self.of_this_step = self.of_earlier_steps = 0
        self._made = {}
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _guarded_steps(guard):
    """A tiny model with ``guard`` started on it, and a step function: two micro-batches, then the guard's check
    before the optimizer step; the step count advances as the Trainer's does."""
    from types import SimpleNamespace

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    trainer = SimpleNamespace(global_step=0, training=True, world_size=1,
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    guard.on_train_start(trainer, model)

    def step() -> None:
        guard.on_train_batch_start(trainer, model, None, 0)
        for _ in range(2):  # micro-batches
            model(torch.randn(3, 4)).sum().backward()
        guard.on_before_optimizer_step(trainer, model, optimizer=None)
        trainer.global_step += 1

    return model, step


def test_by_default_no_step_waits_for_its_own_check_and_a_nan_is_named_at_the_next_step(monkeypatch):
    """Issue 53: NaNGuard's default ("raise") computes its verdict on the device and reads it on the host only
    at the next step (then long computed: on a GPU no wait), instead of syncing before every optimizer step.
    Every step reads at most the previous step's flag, never a value of its own; a NaN/Inf is raised one step
    later, still naming the step, the parameter and the module where it was born."""
    import torch

    model, step = _guarded_steps(NaNGuard(check_activations=True))
    reads = _HostReads(monkeypatch)
    for _ in range(2):
        with reads:
            step()
        assert reads.of_this_step == 0 and reads.of_earlier_steps <= 1
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # born in layer 0's output; layer 2's weight gradient is made of it
    step()  # step 2: its flag is not read yet
    named = r"at step 2 on .*first at 2\.weight, first non-finite activation in 0$"
    with pytest.raises(FloatingPointError, match=named):
        step()


def test_skip_reads_its_own_check_once_before_the_optimizer_step_and_names_the_nan(monkeypatch):
    """``action="skip"`` must know before the optimizer step whether to drop the gradients: one host read (on a
    GPU, a wait for the device) per checked step, however many gradients and activations it checked; the names
    are read only in a step that holds a NaN."""
    import torch

    guard = NaNGuard(action="skip", check_activations=True)
    model, step = _guarded_steps(guard)
    reads = _HostReads(monkeypatch)
    with reads:
        step()
    assert reads.of_this_step == 1
    printed = []
    model.print = printed.append  # (a LightningModule's print)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    step()
    assert guard.skipped_steps == [1] and all(p.grad is None for p in model.parameters())
    assert printed[0].startswith("NaNGuard skipped step 1") and printed[0].endswith(
        "first at 2.weight, first non-finite activation in 0")


def test_a_parameter_unfrozen_during_training_is_checked_as_backward_produces_it():
    # As BackboneFinetuning unfreezes a backbone: the forward hooks skip modules whose tensors they already
    # hooked, so a frozen one must not count as hooked.
    import warnings

    import torch

    from lightning_3d.callbacks.grad_checks import GradientChecks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    checks = GradientChecks(model)
    checks.active = True
    model(torch.ones(1, 2)).sum().backward()
    model[0].requires_grad_(True)
    model(torch.ones(1, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "... a gradient that no hook saw ..."
        names, finite = checks.collect(model, step=1)
    assert {"0.weight", "0.bias"} <= set(names) and bool(finite.all())


def test_comm_recorder_times_a_collective_whose_work_unboxes_to_none():
    """Found on an H200 (torch 2.11, NCCL): the boxed Work of an NCCL collective unboxed to None, and CommTimer
    failed the step with "'NoneType' object has no attribute 'get_future'"."""
    from lightning_3d.callbacks.comm_recorder import Clock, Collective, _when_done

    record = Collective(op="allreduce_", group_ranks=(0,), bytes=4, start=Clock().now())
    _when_done(None, record, Clock())
    assert record.end >= record.start


def test_gradient_checks_look_once_per_step_at_what_a_stage_accumulated_over_its_micro_batches(monkeypatch):
    """Issue 30: under a pipeline NaNGuard runs no hook per gradient per micro-batch; it looks once per step, right
    before the stage reduces its gradients, at what the micro-batches accumulated (one foreach reduction), and
    a NaN from the first micro-batch is still found there, named, before any reduction -- also where FSDP2
    holds the running sum apart from the module's tensors (its fp32 buffer under bf16-mixed)."""
    import torch

    from lightning_3d.callbacks import grad_checks
    from lightning_3d.callbacks.grad_checks import GradientChecks
    from lightning_3d.pipeline.reduction_checks import run_before_reduction

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    apart: list = []  # (module, parameter name, running sum), as pipeline.grad_sync.gradients_held_apart gives
    monkeypatch.setattr(grad_checks, "gradients_held_apart", lambda stage: apart)

    def micro_batches(poisoned: int, moved_away: bool = False) -> None:
        for index in range(4):
            x = torch.ones(1, 2) * (float("nan") if index == poisoned else 1.0)
            model(x).sum().backward()
            if moved_away:  # as FSDP2 does with sync off under a reduce dtype: into its buffer, grad None
                for module in (model[0], model[1]):
                    for short, param in module.named_parameters():
                        if index == 0:
                            apart.append((module, short, torch.zeros_like(param, dtype=torch.float64)))
                        sums = {(id(m), n): t for m, n, t in apart}
                        sums[(id(module), short)] += param.grad
                        param.grad = None
        run_before_reduction(model)  # as GradSyncStage does, before it reduces

    checks = GradientChecks(model, at_reduction=True)
    checks.active = True
    assert not checks._hooked and not checks._module_hooks  # nothing runs per micro-batch
    micro_batches(poisoned=-1)
    names, finite = checks.collect(model, step=0)
    assert sorted(names) == ["0.bias", "0.weight", "1.bias", "1.weight"] and bool(finite.all())  # once each
    assert checks.collect_reduced(model) == ([], None)  # nothing was left unseen
    model.zero_grad()

    micro_batches(poisoned=0)  # only the first micro-batch's weight gradients are not finite
    names, finite = checks.collect(model, step=1)
    assert sorted(n for n, ok in zip(names, finite.tolist()) if not ok) == ["0.weight", "1.weight"]
    model.zero_grad()

    micro_batches(poisoned=0, moved_away=True)
    names, finite = checks.collect(model, step=2)  # before the reduction, in FSDP2's buffer
    assert sorted(n for n, ok in zip(names, finite.tolist()) if not ok) == ["0.weight", "1.weight"]
    checks.remove()
    run_before_reduction(model)  # removed: no longer looks
    assert checks._sums == []


def test_a_gradient_no_check_saw_is_reported_as_found_after_the_reduction_not_as_this_ranks_own():
    """A gradient the checks did not see as backward made it (one written outside autograd, or on tensors the
    guard does not know) is looked at after the data-parallel reduction, where a NaN shows on every replica
    alike: NaNGuard then reports it with its rank of origin unknown (collect_reduced), never as found here
    before the reduction (collect), which would name every replica's ranks as its origin."""
    import torch

    from lightning_3d.callbacks.grad_checks import GradientChecks

    class Outside(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(2, 1)
            self.scale = torch.nn.Parameter(torch.ones(1))

    model = Outside()
    checks = GradientChecks(model)
    checks.active = True
    (model.inner(torch.ones(1, 2)) * float("nan")).sum().backward()
    model.scale.grad = torch.full((1,), float("nan"))  # no hook sees it
    with pytest.warns(RuntimeWarning, match="no hook saw"):
        names, finite = checks.collect(model, step=0)
    assert sorted(names) == ["inner.bias", "inner.weight"] and not bool(finite.any())  # seen, before reduction
    late_names, late_finite = checks.collect_reduced(model)
    assert late_names == ["scale"] and not bool(late_finite.any())
    assert checks.collect_reduced(model) == ([], None)  # forgotten once collected
    checks.remove()


def test_a_stages_gradients_are_checked_with_one_multi_tensor_reduction_per_device_and_dtype():
    """Issue 30: before the reduction a stage's gradients are looked at together, one torch._foreach_norm (L1, in
    float32) per (device, dtype) group rather than a kernel per gradient; a NaN in a half-precision gradient is
    found, and large finite half-precision values (whose sum in float16 would overflow) are not taken for one."""
    import torch

    from lightning_3d.callbacks.grad_checks import GradientChecks
    from lightning_3d.pipeline.reduction_checks import run_before_reduction

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).half(), torch.nn.Linear(2, 1).half())
    checks = GradientChecks(model, at_reduction=True)
    checks.active = True
    calls = []
    original = torch._foreach_norm
    torch._foreach_norm = lambda tensors, *a, **k: calls.append(len(tensors)) or original(tensors, *a, **k)
    try:
        for p in model.parameters():
            p.grad = torch.full_like(p, 60000.0)  # finite; the float16 sum of two would be inf
        run_before_reduction(model)
        names, finite = checks.collect(model, step=0)
        assert calls == [2, 4] and bool(finite.all()) and len(names) == 6
        model[2].weight.grad[0, 0] = float("nan")
        run_before_reduction(model)
        names, finite = checks.collect(model, step=1)
        assert [n for n, ok in zip(names, finite.tolist()) if not ok] == ["2.weight"]
    finally:
        torch._foreach_norm = original
        checks.remove()
