"""What was built for real next to a meta-device model keeps its values when the strategy materializes it.

Before the fix the strategy called ``to_empty()`` on the whole LightningModule: a torchmetrics ``Metric``
made in ``__init__`` (the usual place) had its counts and their defaults replaced by uninitialized memory,
so the reference GPT at pp=2 logged accuracies of 0.0 or 1e-15 (tests/parity/test_pipeline_idioms.py). A
Metric made in ``configure_model()`` has no values on the meta device at all: the build goes exact.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.aggregation import MaxMetric

from lightning_3d.errors import InitError
from lightning_3d.parallel.weight_init import materialize
from lightning_3d.policies.base import Plan
from lightning_3d.strategies.model_build import WatchedBuild


class WithMetrics(L.LightningModule):
    def __init__(self, metrics_in_configure_model: bool = False) -> None:
        super().__init__()
        self.in_configure_model = metrics_in_configure_model
        self.model = None
        if not metrics_in_configure_model:
            self.add_metrics()
        self.scale = nn.Parameter(torch.full((3,), 2.5))  # made for real, next to the model built on meta

    def add_metrics(self) -> None:
        self.acc = MulticlassAccuracy(num_classes=4, average="micro")
        self.peak = MaxMetric()  # its state starts at -inf, not 0

    def configure_model(self) -> None:
        if self.model is None:
            self.model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
            if self.in_configure_model:
                self.add_metrics()


def test_materializing_allocates_the_meta_tensors_and_keeps_the_real_ones():
    module = WithMetrics()
    with torch.device("meta"):
        module.configure_model()
    counts = {k: v.clone() for k, v in module.acc.metric_state.items()}
    materialize(module, torch.device("cpu"))
    assert not any(p.is_meta for p in module.parameters())
    assert torch.equal(module.scale, torch.full((3,), 2.5))
    assert all(torch.equal(module.acc.metric_state[k], v) for k, v in counts.items())
    assert module.peak.metric_state["max_value"] == -float("inf")
    module.acc.reset()  # from its defaults, which stay real too
    module.acc(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 0]))
    assert module.acc.compute() == 0.75


def test_a_module_holding_meta_and_real_tensors_is_refused_naming_them():
    layer = nn.Linear(2, 2, device="meta")
    layer.register_buffer("mask", torch.ones(2))
    with pytest.raises(InitError, match=r"<root> \(Linear\) holds tensors on the meta device and real ones \(mask\)"):
        materialize(layer, torch.device("cpu"))


def test_metrics_made_in_configure_model_send_the_build_to_the_host():
    module = WithMetrics(metrics_in_configure_model=True)
    build = WatchedBuild("auto")
    with build.context(module, Precision()):
        module.configure_model()
    assert module.acc.metric_state["tp"].is_meta  # what the meta build gives a metric: no values
    build.verdict(module, lambda m: Plan(), Precision(), params_loaded=False)
    assert not module.acc.metric_state["tp"].is_meta and module.peak.metric_state["max_value"] == -float("inf")
    assert not any(p.is_meta for p in module.parameters())


def test_metrics_made_in_configure_model_are_refused_under_model_init_meta():
    module = WithMetrics(metrics_in_configure_model=True)
    build = WatchedBuild("meta")
    with build.context(module, Precision()):
        module.configure_model()
    with pytest.raises(InitError, match=r"torchmetrics state of acc \(MulticlassAccuracy\), peak \(MaxMetric\)"):
        build.verdict(module, lambda m: Plan(), Precision(), params_loaded=False)


def test_a_host_build_on_every_rank_is_checked_against_every_rank_on_this_host(monkeypatch):
    # Under Lightning's own launcher LOCAL_WORLD_SIZE is unset (it was read as 1): the strategy passes the
    # ranks on this host, each of which builds the whole model here.
    module = WithMetrics(metrics_in_configure_model=True)
    build = WatchedBuild("auto")
    with build.context(module, Precision()):
        module.configure_model()
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("lightning_3d.strategies.model_build.host_memory_available", lambda: 3 * model_bytes)
    with pytest.raises(InitError, match=r"building the whole model on the host takes .* GiB of host memory"):
        build.verdict(module, lambda m: Plan(), Precision(), params_loaded=False, local_ranks=4)
