"""The list of private torch and Lightning names (lightning_3d/_private_apis.py) stays true: every private
name the source uses is in it, every name in it is used, and the imported ones exist in the installed torch
and Lightning (the versions pyproject.toml bounds)."""

import importlib
import sys
from pathlib import Path

import pytest

from helpers.private_api_scan import scan
from lightning_3d._private_apis import PRIVATE_NAMES

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_3d"


@pytest.fixture(scope="module")
def found() -> dict[str, set[str]]:
    return scan(PACKAGE)


def _covers(key: str, finding: str) -> bool:
    if finding.startswith("."):  # an attribute of an object: its owner is not in the source
        return PRIVATE_NAMES[key].attribute and key.endswith(finding)
    return not PRIVATE_NAMES[key].attribute and (finding == key or finding.startswith(key + "."))


def test_every_private_name_the_source_uses_is_listed_with_why(found):
    unlisted = {f: sorted(files) for f, files in found.items() if not any(_covers(k, f) for k in PRIVATE_NAMES)}
    assert not unlisted, (
        f"{len(unlisted)} private torch/Lightning name(s) used but not in lightning_3d/_private_apis.py: {unlisted}."
        " Use a public API, or add the name there with why it is needed and what would replace it.")


def test_every_listed_name_is_still_used(found):
    unused = [k for k in PRIVATE_NAMES if not any(_covers(k, f) for f in found)]
    assert not unused, (f"listed in lightning_3d/_private_apis.py but no longer used: {unused}; remove them"
                        " (the list says what an upgrade of torch or Lightning must check)")


def test_every_imported_private_name_exists_in_the_installed_versions():
    missing = []
    for key, entry in PRIVATE_NAMES.items():
        if entry.attribute or key.split(".")[0] not in ("torch", "lightning"):
            continue
        parts = key.split(".")
        for split in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:split]))
                break
            except ImportError:
                continue
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
        except AttributeError:
            missing.append(key)
    assert not missing, f"private names gone from torch {sys.modules['torch'].__version__}: {missing}"


def test_a_new_private_use_fails_the_scan(tmp_path):
    package = tmp_path / "lightning_3d"
    package.mkdir()
    (package / "uses.py").write_text(
        "import torch.distributed as dist\n"
        "from torch.distributed._tools import mod_tracker\n"
        "def f(stage, trainer):\n"
        "    dist.distributed_c10d._world\n"
        "    trainer._checkpoint_connector\n"
        "    return getattr(stage, '_stage_initialized')\n")
    assert set(scan(package)) == {"torch.distributed._tools.mod_tracker", "torch.distributed.distributed_c10d._world",
                                  "._checkpoint_connector", "._stage_initialized"}
