import os
import warnings

import pytest

# Tiny models: one thread per process keeps 8 ranks on 2 cores from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _quiet_lightning_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
