"""What a run prints: third-party warnings that say nothing about the user's run are filtered, and lines every
rank would print alike come from rank zero only. Installed by our entry points (the CLI, the strategy), never
at import, so a user's own script that only imports lightning_3d keeps its warnings as they were.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

import lightning
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from packaging.version import Version

# (message start, category, module the warning is attributed to, installed version it is for); each filter
# is applied only where that version is installed, so an upgrade shows the warning again until rechecked.
# Lightning 2.6's pytree helper (lightning.pytorch.utilities._pytree) builds torch's LeafSpec, deprecated in
# torch 2.10: one FutureWarning per rank at the first step, about Lightning's code, not the user's.
# (tests/helpers/warning_filters.py ignores it for the tests, by message.)
THIRD_PARTY_WARNINGS = [
    ("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "lightning.pytorch.utilities._pytree",
     Version(lightning.__version__) < Version("2.7")),
]


def filter_third_party_warnings() -> None:
    """Ignore the warnings in ``THIRD_PARTY_WARNINGS`` (in this process: each rank calls it)."""
    for message, category, module, applies in THIRD_PARTY_WARNINGS:
        if applies:
            warnings.filterwarnings("ignore", message=re.escape(message), category=category,
                                    module=re.escape(module))


class _RankZeroOnly(logging.Filter):
    """Drops, on ranks other than zero, Lightning's lines that every rank prints alike: "Initializing
    distributed: GLOBAL_RANK: r, MEMBER: r+1/N" (rank zero's says N), and "Seed set to S" when S is the seed
    this process already had (the launcher passes rank zero's in PL_GLOBAL_SEED): a seed of its own shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(rank_zero_only, "rank", 0) == 0:
            return True
        message = record.getMessage()
        if "Initializing distributed: GLOBAL_RANK" in message:
            return False
        seed = re.search(r"Seed set to (\d+)$", message)
        return seed is None or seed.group(1) != os.environ.get("PL_GLOBAL_SEED")


_RANK_ZERO_ONLY = _RankZeroOnly()


def quiet_ranks() -> None:
    """Third-party warnings filtered; Lightning's per-rank set-up lines from rank zero only (idempotent)."""
    filter_third_party_warnings()
    for name in ("lightning.fabric.utilities.distributed", "lightning.fabric.utilities.seed"):
        logger = logging.getLogger(name)
        if _RANK_ZERO_ONLY not in logger.filters:
            logger.addFilter(_RANK_ZERO_ONLY)
