"""What the tests share: the launchers of ranks, the parity harness, the workers the ranks run, the test models.

``tests/`` is on the path of the tests and of every process they start (``tests/conftest.py``), so each
imports this package by the same name: ``from helpers.launchers import forkrun``. To run a worker by hand, put
it there too: ``PYTHONPATH=tests torchrun --nproc-per-node 2 tests/helpers/workers/mesh_worker.py OUT 2,1,1``.
"""

from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
"""The folder of the worker scripts, which tests launch by path (torchrun, or ``launchers.forkrun``)."""
