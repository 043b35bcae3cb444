"""The parity harness: run one training case in one process and under a layout, and compare.

A :class:`Case` is plain data (JSON-able), so one launch of N ranks (``launch``) can run many cases in a row:
process start-up (importing torch and Lightning) is paid once per launch, not per layout -- and not even
once per launch: the ranks are forked from one interpreter per test session that imported it all
(helpers/forkrun.py).
Each run records the global per-step loss (mean over all ranks) and the full parameters after training
(gathered from whatever shards and stages hold them), keyed by their single-device FQNs.

The reference is :func:`run_reference`: plain Lightning on one device, no lightning_3d strategy involved,
with the global batch and the same sample order Lightning's distributed sampler deals out.

cases.py        Case, Result, and the seed, AdamW eps and sweep length every case shares
modules.py      the LightningModules a case names, and its data
training.py     the Trainer a case runs in, and the callback recording its per-step losses
reference.py    the single-process run a case must match (cached per reference)
distributed.py  the case on every rank of a launch, its full state gathered (inside the ranks)
launching.py    cases launched on N ranks, results back by name
compare.py      ``assert_parity`` and its tolerances
"""

from helpers.harness.cases import ADAM_EPS, SEED, SWEEP_STEPS, Case, Result
from helpers.harness.compare import assert_parity
from helpers.harness.distributed import gather_full_state, run_distributed
from helpers.harness.launching import launch, launch_by_world_size
from helpers.harness.modules import module_and_data
from helpers.harness.reference import ReferenceDataModule, reference_for, run_reference
from helpers.harness.training import LossRecorder

__all__ = ["ADAM_EPS", "SEED", "SWEEP_STEPS", "Case", "LossRecorder", "ReferenceDataModule", "Result", "assert_parity",
           "gather_full_state", "launch", "launch_by_world_size", "module_and_data", "reference_for", "run_distributed",
           "run_reference"]
