"""``python -m helpers.census [OUT_DIR] [MODEL_TYPE ...]`` from tests/: run the census and print its table."""

import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

from helpers import warning_filters

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py: one thread per rank on a shared machine
os.environ["PYTHONWARNINGS"] = warning_filters.pythonwarnings()  # the ranks' warning rules, as in the suite

if __name__ == "__main__":
    from helpers.census import run_census

    warnings.filterwarnings("ignore")  # this process runs the one-process references: their chatter is noise
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="census-"))
    census = run_census(out_dir, sys.argv[2:] or None)
    print(census.report())
    print(f"\n(every reason in full: {census.file})")
