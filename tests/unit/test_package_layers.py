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
    from lightning_3d.parallel.weight_init import InitError
    from lightning_3d.parallel.shape_check import ShardedShapeError
    from lightning_3d.pipeline.step_checks import StepPatternError
    from lightning_3d.planner.model import PlannerError
    from lightning_3d.planner.search import NoLayoutFits
    from lightning_3d.policies.base import PolicyError
    from lightning_3d.policies import LayoutError

    for cls in (UnsafeCheckpointError, CheckpointError, ParallelConfigError, InitError, ShardedShapeError,
                StepPatternError, PlannerError, NoLayoutFits, PolicyError, LayoutError):
        assert getattr(errors, cls.__name__) is cls


LAYERS = [
    {"common", "errors", "fused_parts", "device_peaks"},  # fused_parts: the stored order of fused projections of
    # unequal parts; device_peaks: GPUs' dense bf16 peaks
    {"models"},
    {"checkpoint"},  # files: sharded directories, pretrained weights (init_from), safe loading
    {"policies"},  # plans, and the tensor-parallel styles they name
    {"pipeline"},  # stages from the blocks, the micro-batch engine
    {"parallel"},  # the appliers, in order (parallelize.py)
    {"faults", "output", "_private_apis"},
    {"planner", "callbacks"},
    {"strategies"},
    {"__init__", "dry_run"},
    {"cli"},
    {"__main__"},
]
"""The package's parts, lowest first: a part imports only parts of lower layers (and itself)."""


def _part(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _module(path: Path) -> str:
    return ".".join(("lightning_3d", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _is_module(name: str) -> bool:  # `from lightning_3d.checkpoint import atomic` imports a module
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _package_imports(path: Path) -> set[str]:
    """Modules of the package ``path`` imports, anywhere in it: in functions and under TYPE_CHECKING too (a
    circle hidden there is still a circle for the reader)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_3d"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("lightning_3d"))
    return names


def test_each_part_imports_only_the_layers_below_it():
    level = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    upward = []
    for path in _modules():
        part = _part(path)
        assert part in level, f"{part} is in no layer of LAYERS: place it"
        for name in _package_imports(path):
            other = name.split(".")[1] if "." in name else "__init__"
            if other != part and other in level and level[other] >= level[part]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not upward, "\n".join(sorted(upward))


def test_no_module_imports_itself_around_a_circle():
    modules = {_module(path): path for path in _modules()}
    # A module's own parent packages are imported before it anyway: not an edge of a circle.
    graph = {name: {m for m in _package_imports(path) if m in modules and m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(other):], other]))
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_strategy_is_one_class_whose_hooks_are_all_in_three_d():
    """Issue 21 item 2: no mixins sharing private state; every hook Lightning calls is written in three_d.py,
    and the helpers it delegates to override none."""
    from lightning.pytorch.strategies import Strategy

    from lightning_3d.strategies.three_d import ThreeDStrategy

    ours = [cls for cls in ThreeDStrategy.__mro__ if cls.__module__.startswith("lightning_3d")]
    assert ours == [ThreeDStrategy], f"ThreeDStrategy has bases of the package: {ours[1:]}"
    helpers = [p for p in (PACKAGE / "strategies").glob("*.py") if p.name != "three_d.py"]
    overriding = [p.name for p in helpers if "@override" in p.read_text()]
    assert not overriding, f"Lightning hooks outside three_d.py: {overriding}"
    hooks = {name for name in vars(ThreeDStrategy) if hasattr(Strategy, name)}
    assert {"setup_environment", "setup", "training_step", "backward", "save_checkpoint", "load_checkpoint",
            "teardown", "on_exception", "reduce", "barrier", "broadcast"} <= hooks


def test_a_fixed_layout_run_imports_nothing_of_the_launch_time_decision_or_the_planner():
    """layout="auto" (strategies/auto_layout.py, the calibration, the model measurement) and the planner are
    imported when a config asks for the decision, not by ``import lightning_3d`` or a run at a fixed layout."""
    import subprocess
    import sys

    script = (
        "import sys, lightning as L, lightning_3d\n"
        "from lightning_3d.models import GPTConfig, GPTLightningModule, SyntheticDataModule\n"
        "config = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)\n"
        "L.Trainer(strategy='3d', devices=1, accelerator='cpu', max_steps=1, logger=False, enable_checkpointing=False,"
        " enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(\n"
        "    GPTLightningModule(config=config), SyntheticDataModule(vocab_size=64, seq_len=16, batch_size=2))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('lightning_3d.planner', 'lightning_3d.strategies.auto_layout',"
        " 'lightning_3d.strategies.calibrat', 'lightning_3d.strategies.measure'))))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
