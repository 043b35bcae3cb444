"""The pipeline's step results (pipeline/shared_results.py) on 2 ranks: what arrives is what was sent, across a
change of structure, and a receive posted ahead lets the sender go on without waiting for the receiver."""

import json

import pytest

from helpers import WORKERS
from helpers.launchers import forkrun

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("results_channel")
    forkrun(2, str(WORKERS / "results_channel_worker.py"), str(out), timeout=120)
    return json.loads((out / "rank0.json").read_text())


def test_what_arrives_is_what_was_sent_the_structure_only_when_it_changed(result):
    assert result["received"] == result["expected"]
    assert result["structure_sends"] == 2  # step 1, and step 3 where a logged value was added


def test_a_receive_posted_ahead_lets_the_sender_go_on_while_the_receiver_is_busy(result):
    """The receiver is busy for a second after posting (as a first stage with its last backward); the sender's
    share returns without waiting for it. Posted only when the share comes (before: ResultsChannel.share did
    all the receiving), the send waited for the receiver's handshake: the whole second. At step 3 the structure
    changed, and the new one travels when the receiver asks for it: that send waits."""
    seconds = result["send_seconds"]
    assert seconds[1] < 0.5 and seconds[3] < 0.5, seconds
    assert seconds[2] > 0.5, seconds


def test_in_a_pipelined_fit_the_first_stage_posts_its_receive_before_each_steps_work(result):
    """The engine calls ResultsChannel.expect before the step's work, from the second step on (the first one
    brings the structure)."""
    assert result["posted_in_fit"] == [False, True, True, True]
