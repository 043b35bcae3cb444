"""Asynchronous checkpoints (``ThreeDStrategy(async_checkpoint=True)``, lightning_3d/checkpoint/async_save.py):
written while training goes on, with the guarantees of synchronous ones -- exact resume, resharding, a
checkpoint complete or absent -- and at most one save in flight.

Two launches of 2 ranks: one killed in the middle of an asynchronous write, then one that resumes it and
runs the other jobs. Each DCP write there sleeps ``DELAY`` seconds first (in DCP's background thread), so the
steps after a save run while it is written."""

import pytest
import torch

from helpers.harness import Case, reference_for
from helpers.workers.async_ckpt_worker import launch_jobs
from lightning_3d.checkpoint import consolidate

MODEL = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)
TP2 = dict(tensor_parallel_size=2)
DELAY = 1.0  # > the 3 steps between two saves here (~0.1 s each): the save at step 6 finds step 3's in flight


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_ckpt")
    killed_dir, through_dir = root / "killed", root / "through"
    killed = dict(layout=dict(data_parallel_size=2), model=MODEL, steps=6, save_every=2, save_last=True,
                  ckpt_dir=str(killed_dir))
    # Saves: step=2, last (step 2: its shards linked from step=2's, no DCP write), step=4, last (step 4): rank 1
    # dies in the 2nd DCP write, step 4's.
    launch_jobs(2, [dict(killed, name="killed", kill_rank_during_save=1, kill_at_save=2)], root / "one",
                expect_failure=True, timeout=120)
    died_in = killed_dir / "killed_in_thread"  # written by rank 1 just before it kills itself
    after_kill = {"killed_in_thread": died_in.read_text() if died_in.exists() else None,
                  "partial": (killed_dir / ".epoch=0-step=4.ckpt.partial").is_dir(),
                  "step_4": (killed_dir / "epoch=0-step=4.ckpt").exists(), "last_step": _step_of(killed_dir / "last.ckpt")}
    results = launch_jobs(2, [
        dict(name="through", layout=TP2, model=MODEL, steps=6, save_every=3, save_last=True,
             ckpt_dir=str(through_dir), write_delay=DELAY, capture_at=3),
        dict(name="resumed", layout=TP2, model=MODEL, steps=6, resume=str(through_dir / "epoch=0-step=3.ckpt")),
        dict(name="to_2_1_1", layout=dict(data_parallel_size=2, zero_stage=3), model=MODEL, steps=6,
             resume=str(through_dir / "epoch=0-step=3.ckpt")),
        dict(killed, name="resumed_from_last", resume="last", may_fail=True),  # last: the others' results are kept
    ], root / "two", timeout=240)
    return root, {**results, "after_kill": after_kill}


def _step_of(checkpoint):
    meta = checkpoint / "lightning_3d.meta.pt"
    return torch.load(meta, weights_only=False)["global_step"] if meta.exists() else None


@pytest.mark.multiprocess
def test_a_rank_killed_during_an_async_write_leaves_the_previous_checkpoint_whole_and_last_resumes_from_it(runs):
    _, results = runs
    after_kill = results["after_kill"]
    assert after_kill["killed_in_thread"] not in (None, "MainThread")  # rank 1 died in the background write
    assert after_kill["partial"] and not after_kill["step_4"]  # the unfinished save: never committed, never loaded
    assert after_kill["last_step"] == 2  # last.ckpt is still the previous save's, whole
    assert "resumed_from_last" in results, "resuming from last failed (see the launch's output)"
    resumed = results["resumed_from_last"]
    reference = reference_for(Case(name="reference", model=MODEL, steps=6))
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 4  # steps 3..6, from the step-2 checkpoint
    assert max(abs(a - b) for a, b in zip(reference.losses[2:], resumed["losses"])) <= 1e-5


@pytest.mark.multiprocess
def test_an_async_save_holds_the_weights_of_its_step_though_the_next_steps_ran_during_the_write(runs, tmp_path):
    root, results = runs
    through = results["through"]
    assert all(thread != "MainThread" for thread in through["write_threads"]), through["write_threads"]
    # The full weights DCP wrote for step 3, read back as one file, against those captured at step 3 (the
    # optimizer steps 4-6 ran while the write slept): equal bit for bit.
    consolidate(str(root / "through" / "epoch=0-step=3.ckpt"), tmp_path / "step3.pt", strip_prefix="model.")
    written = {f"model.{name}": t for name, t in torch.load(tmp_path / "step3.pt").items()}  # the module's names
    assert sorted(written) == sorted(through["captured"])
    for name, tensor in through["captured"].items():
        assert torch.equal(written[name], tensor), name
    assert any(not torch.equal(t, through["params"][name]) for name, t in written.items())  # it moved on


@pytest.mark.multiprocess
def test_resume_from_an_async_checkpoint_continues_exactly_as_if_never_stopped(runs):
    _, results = runs
    through, resumed = results["through"], results["resumed"]
    assert len(resumed["losses"]) == 3  # steps 4, 5, 6
    assert max(abs(a - b) for a, b in zip(through["losses"][3:], resumed["losses"])) <= 1e-6, (through, resumed)
    for name, tensor in through["params"].items():
        assert torch.allclose(tensor, resumed["params"][name], atol=1e-6, rtol=0), name


@pytest.mark.multiprocess
def test_an_async_checkpoint_of_tp_2_reshards_to_zero_3_and_trains_on_as_one_process(runs):
    _, results = runs
    reference = reference_for(Case(name="reference", model=MODEL, steps=6))
    resumed = results["to_2_1_1"]
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(reference.losses[3:], resumed["losses"])) <= 1e-5
    for name, tensor in reference.params.items():
        assert torch.allclose(resumed["params"][name], tensor, atol=1e-5, rtol=0), name


@pytest.mark.multiprocess
def test_at_most_one_save_is_in_flight_the_next_waits_and_says_how_long_and_fit_ends_with_it_committed(runs):
    _, results = runs
    through = results["through"]
    # Two DCP writes (steps 3 and 6): each step's last.ckpt, saved right after, took its shards from them
    # without waiting (four writes and two more waits without that).
    assert through["max_writes_in_flight"] == 1 and len(through["write_threads"]) == 2
    # The save at step 6 came while step 3's slept in its write: it waited, and rank 0 said for how long; the
    # end of fit waited for step 6's (its last.ckpt the last to commit).
    before_6, at_the_end = through["waits"]
    assert "last.ckpt to finish before saving" in before_6 and "step=6.ckpt" in before_6, before_6
    assert "last.ckpt to finish before the end of the run" in at_the_end, at_the_end
    for wait in through["waits"]:
        assert 0 < float(wait.split("waited ")[1].split(" s")[0]) <= DELAY + 1, wait
    assert through["committed_when_fit_returned"] == 6  # committed by the time fit returned


@pytest.mark.multiprocess
def test_the_last_checkpoint_saved_right_after_a_step_s_top_k_one_holds_the_same_shards(runs):
    root, _ = runs
    through = root / "through"
    assert _step_of(through / "last.ckpt") == _step_of(through / "epoch=0-step=6.ckpt") == 6
    shards = sorted(p.name for p in (through / "epoch=0-step=6.ckpt").iterdir() if p.suffix == ".distcp")
    assert shards and shards == sorted(p.name for p in (through / "last.ckpt").iterdir() if p.suffix == ".distcp")
    for name in shards:  # hard links of the step's files (or byte-equal copies)
        assert (through / "last.ckpt" / name).read_bytes() == (through / "epoch=0-step=6.ckpt" / name).read_bytes()
