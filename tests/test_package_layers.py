"""The bottom of the package stays the bottom, and what it holds is written once (issue 21 items 3-4).

lightning_3d/common.py (schedule names, the positive-integer test, divisors, FQN helpers, a DTensor's local
piece) and lightning_3d/errors.py (every error class) import no other module of the package, so any layer
may use them without importing upward; the copies they replaced must not grow back."""

import ast
import re
from pathlib import Path

import lightning_3d

PACKAGE = Path(lightning_3d.__file__).parent
BOTTOM = ["common.py", "errors.py"]
# What common.py and errors.py hold, as it was written in several modules before.
COPIES = {
    "a DTensor's local piece": r"\.to_local\(\) if isinstance\(\w+, DTensor\) else",
    "the positive-integer test": r"isinstance\(\w+, bool\) or not isinstance\(\w+, int\) or \w+ < 1",
    "divisors": r"def _?divisors\(",
    "the parent of an FQN": r"\.rpartition\(\"\.\"\)\[0\]",
    "the multi-stage schedule names": r"\(\"interleaved_1f1b\", \"zero_bubble\"\)",
    "an error class": r"^class \w+Error\(",
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_bottom_modules_import_nothing_of_the_package():
    for name in BOTTOM:
        upward = {m for m in _imported(PACKAGE / name) if m.split(".")[0] == "lightning_3d"}
        assert not upward, f"lightning_3d/{name} imports {sorted(upward)}"


def test_what_the_bottom_holds_is_written_nowhere_else():
    found = []
    for path in _modules():
        if path.name in BOTTOM and path.parent == PACKAGE:
            continue
        text = path.read_text()
        found += [f"{path.relative_to(PACKAGE)}: {what}" for what, pattern in COPIES.items()
                  if re.search(pattern, text, re.MULTILINE)]
    assert not found, "\n".join(found)


def test_every_error_class_is_still_importable_from_the_module_that_raises_it():
    from lightning_3d import errors
    from lightning_3d.checkpoint.safe_load import UnsafeCheckpointError
    from lightning_3d.checkpoint.sharded import CheckpointError
    from lightning_3d.parallel.config import ParallelConfigError
    from lightning_3d.parallel.init import InitError
    from lightning_3d.parallel.shape_check import ShardedShapeError
    from lightning_3d.pipeline.step_checks import StepPatternError
    from lightning_3d.planner.model import PlannerError
    from lightning_3d.planner.search import NoLayoutFits
    from lightning_3d.policies.base import PolicyError

    for cls in (UnsafeCheckpointError, CheckpointError, ParallelConfigError, InitError, ShardedShapeError,
                StepPatternError, PlannerError, NoLayoutFits, PolicyError):
        assert getattr(errors, cls.__name__) is cls
