"""`lightning-3d --help` names every command, also the two that main() dispatches before LightningCLI."""

import pytest

from lightning_3d.cli import build_cli


def test_top_level_help_names_plan_and_convert(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_cli(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "lightning-3d plan --help", "lightning-3d convert --help"):
        assert command in text, f"{command!r} is not in lightning-3d --help"
