"""The compile report's one log line after the first optimizer step (lightning_3d.parallel.compile)."""

import torch

from lightning_3d.parallel import compile as compile_module
from lightning_3d.parallel.compile import CompileReport


def test_reports_of_several_set_ups_log_once_each_and_leave_the_optimizer_steps_alone(monkeypatch):
    # A set-up that compiled and never stepped (a test, a dry run) left its hook waiting; the next process-wide
    # optimizer step ran both, and the first one's removal of itself ended the step: "OrderedDict mutated
    # during iteration".
    lines = []
    monkeypatch.setattr(compile_module._log, "info", lines.append)
    reports = [CompileReport(rank=0, blocks=2, codes=1), CompileReport(rank=0, blocks=3, codes=1)]
    for report in reports:
        report.log_after_first_step()
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(3):
        weight.sum().backward()
        optimizer.step()
    assert sorted(lines) == sorted(report.line() for report in reports), lines
