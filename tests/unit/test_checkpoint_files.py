"""What loading says of a checkpoint path that holds no whole checkpoint (lightning_3d.checkpoint.sharded)."""

import pytest

from lightning_3d.checkpoint.sharded import check_complete


def test_a_last_link_to_a_save_that_never_completed_says_so_and_where_the_unfinished_save_is(tmp_path):
    # ModelCheckpoint(save_last="link") under async_checkpoint: last.ckpt links to the step's checkpoint as
    # soon as its save returns, before the commit; a crash in between leaves the link dangling.
    (tmp_path / ".epoch=0-step=4.ckpt.partial").mkdir()
    (tmp_path / "last.ckpt").symlink_to("epoch=0-step=4.ckpt")
    with pytest.raises(FileNotFoundError) as raised:
        check_complete(tmp_path / "last.ckpt")
    message = str(raised.value)
    assert "a link to " in message and "epoch=0-step=4.ckpt, which does not exist" in message, message
    assert ".epoch=0-step=4.ckpt.partial: it was never completed" in message, message


def test_a_missing_path_with_an_unfinished_save_beside_it_names_that_save(tmp_path):
    (tmp_path / ".last.ckpt.partial").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*last\.ckpt; an unfinished save is at .*"
                                                r"\.last\.ckpt\.partial"):
        check_complete(tmp_path / "last.ckpt")
