"""A LightningModule written the ordinary Lightning way (helpers/idioms.py: torchmetrics, reduce_fx, on_epoch,
sync_dist, a dict with extra keys, attribute access on the model, MLM-style masking, a step-interval LR
scheduler, ModelCheckpoint / EarlyStopping / LearningRateMonitor, clipping, accumulation and validation
inside an accumulation window, a last validation batch of another size) ends with one process's
``trainer.callback_metrics`` at pp=2 and dp2 x pp2 on every pipeline route (``idioms.ROUTES``: the reference
GPT and its policy, a user's policy naming ``pipeline_root``, nanoGPT as written, transformers' Llama), and
at tp=2 on the routes with a tensor-parallel plan, at cp=2 and cp2 x pp2 on the routes whose attention context
parallelism takes; its accuracies match one process step by step. Steps the
pipeline cannot run fail at step 1, on every rank, naming the pattern. One launch per world size."""

import json

import pytest

from helpers import WORKERS
from helpers.idioms import ROUTES, run_conformance
from helpers.launchers import forkrun
from helpers.workers.idioms_worker import LAYOUTS, routes_of

pytestmark = pytest.mark.multiprocess

CASES = [(layout, route) for layout in LAYOUTS for route in routes_of(layout)]
LAUNCHES = {2: [f"conformance_{layout}_{route}" for layout in ("pp2", "tp2", "cp2") for route in routes_of(layout)]
            + ["model_called_twice", "collective_in_step"],
            4: [f"conformance_dp2_pp2_{route}" for route in ROUTES]
            + [f"conformance_cp2_pp2_{route}" for route in routes_of("cp2_pp2")]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("idioms")
    for nprocs, names in LAUNCHES.items():
        forkrun(nprocs, str(WORKERS / "idioms_worker.py"), str(out), *names, timeout=600)
    return {name: json.loads((out / f"{name}.json").read_text()) for names in LAUNCHES.values() for name in names}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("idioms_reference")
    rates = {spec["mask_rate"] for spec in LAYOUTS.values()}
    return {(route, rate): run_conformance("auto", 1, 1, out / f"{route}_{rate}", rate, route)
            for route in ROUTES for rate in rates}


def _close(a: float, b: float, rel: float = 1e-4) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(b))


def _ours_and_reference(layout, route, results, references):
    return results[f"conformance_{layout}_{route}"], references[(route, LAYOUTS[layout]["mask_rate"])]


@pytest.mark.parametrize("layout, route", CASES)
def test_callback_metrics_match_one_process(layout, route, results, references):
    ours, reference = _ours_and_reference(layout, route, results, references)
    expected = dict(reference["metrics"])
    if LAYOUTS[layout]["dp"] > 1:
        # A Metric's step value is the rank's own batch under data parallelism, in DDP too (its epoch value is
        # synced): not one process's.
        for step_value in ("train_acc_step", "train_acc_micro_step"):
            expected.pop(step_value)
            ours["metrics"].pop(step_value)
    assert ours["metrics"].keys() == expected.keys()
    differ = {k: (ours["metrics"][k], v) for k, v in expected.items() if not _close(ours["metrics"][k], v)}
    assert not differ, differ
    # What on_train_batch_end got of the step's dict, the learning rate per batch, the checkpoint's best score.
    assert ours["correct"] == reference["correct"] and ours["preds_sum"] == reference["preds_sum"]
    assert ours["lr"] == reference["lr"]
    assert _close(ours["best_val_loss"], reference["best_val_loss"])
    assert ours["global_step"] == reference["global_step"] == 4


@pytest.mark.parametrize("layout, route", [case for case in CASES if LAYOUTS[case[0]]["dp"] == 1])
def test_accuracy_matches_one_process_at_every_step(layout, route, results, references):
    # An accuracy is a ratio of integer counts over the same predictions: equal up to float division, 1e-6.
    # At tp=2 the gpt and llama policies leave the logits sharded over the vocabulary: argmax, torchmetrics
    # and the returned dict see them whole (lightning_3d.parallel.sharded_logits).
    ours, reference = _ours_and_reference(layout, route, results, references)
    assert len(ours["acc"]) == len(reference["acc"]) == 8  # 4 optimizer steps of 2 batches
    differ = [(i, a, b) for i, (a, b) in enumerate(zip(ours["acc"], reference["acc"]))
              if any(abs(x - y) > 1e-6 for x, y in zip(a, b))]
    assert not differ, differ


def test_last_smaller_validation_batch_gives_one_process_val_loss(results, references):
    # 22 samples in batches of 8: 8, 8, 6 at pp=2 (2 micro-batches); 8 and 3 per rank at dp=2 (3: one micro-batch).
    for layout, route in CASES:
        ours, reference = _ours_and_reference(layout, route, results, references)
        for key in ("val_loss", "val_acc"):
            assert _close(ours["metrics"][key], reference["metrics"][key], rel=1e-5), (layout, route, key)


@pytest.mark.parametrize("name, says", [
    ("model_called_twice", "called self.model(...) 2 times in one step"),
    ("collective_in_step", "runs a collective (allgather_) over ranks [0, 1], which include other stages"),
])
def test_unsupported_step_fails_at_the_first_step(name, says, results):
    error = results[name]["error"]
    assert error is not None and error.startswith("StepPatternError") and says in error, error
    assert "pipeline_parallel_size=1" in error  # what to do
    assert results[name]["global_step"] == 0 and results[name]["batch"] == 1
