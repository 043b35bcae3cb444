"""Which warnings the tests turn into errors, and which third-party ones they ignore (and why).

A warning attributed to lightning_3d code -- our own, or torch's / Lightning's deprecation of something we
call (a deprecation warns at its caller) -- fails the test: it is drift we want to see. A warning
lightning_3d gives on purpose is expected where a test provokes it (``pytest.warns``). Everything else is
shown as usual, except the third-party warnings in ``IGNORED`` below, each ignored for the reason given.

The same rules reach every process a test starts (torchrun ranks, Lightning's launcher, the CLI) through
``PYTHONWARNINGS`` (``conftest.py`` sets it), where a module must be named exactly: hence one entry per module
of lightning_3d.
"""

from __future__ import annotations

import pkgutil
import re

import lightning_3d

IGNORED: list[tuple[str, str, str]] = [
    # (message prefix, category, module the warning is attributed to), each with its reason. No commas or
    # colons in a message: they separate PYTHONWARNINGS entries and fields.
    # Lightning 2.6's own pytree helper (lightning.pytorch.utilities._pytree) builds torch's deprecated LeafSpec
    # on every step: not a call of ours; a Lightning upgrade removes it. Matched by its message alone, as
    # pytest.warns re-emits the warnings it did not expect under the module name "warnings".
    ("`isinstance(treespec", "FutureWarning", ""),
    # Lightning's CLI calls jsonargparse functions deprecated in jsonargparse 4.49 (add_instantiator,
    # instantiate_classes, skip_none) whatever config it is given: Lightning's to change.
    ("", "DeprecationWarning", "lightning.pytorch.cli"),
    # test_cli calls lightning_3d.cli.main(args) inside pytest, whose sys.argv holds pytest's own arguments;
    # the console script itself passes no args.
    ("LightningCLI's args parameter is intended", "UserWarning", "lightning.pytorch.cli"),
]
"""Third-party warnings that say nothing about our code."""


def _our_modules() -> list[str]:
    return ["lightning_3d", *(m.name for m in pkgutil.walk_packages(lightning_3d.__path__, "lightning_3d."))]


def pytest_filters() -> list[str]:
    """Lines for pytest's ``filterwarnings`` (module is a regular expression there, matched at the start)."""
    ignored = [f"ignore:{re.escape(message)}:{category}:{re.escape(module)}" for message, category, module in IGNORED]
    return [*ignored, r"error::Warning:lightning_3d(\.|$)"]  # later lines take precedence


def pythonwarnings() -> str:
    """The ``PYTHONWARNINGS`` value for processes the tests start (later entries take precedence)."""
    ignored = [f"ignore:{message}:{category}:{module}" for message, category, module in IGNORED]
    return ",".join([*ignored, *(f"error::Warning:{name}" for name in _our_modules())])
