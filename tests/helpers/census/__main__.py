"""``python -m helpers.census [OUT_DIR] [MODEL_TYPE ...]`` from tests/: run the census and print its table."""

import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from helpers import warning_filters

# One thread per process, as tests/conftest.py sets for the suite: the ranks read it from the environment;
# this process imported torch with the package, before this line ran.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
os.environ["PYTHONWARNINGS"] = warning_filters.pythonwarnings()  # the ranks' warning rules, as in the suite

if __name__ == "__main__":
    from helpers.census import run_census

    import transformers

    # This process runs the one-process references: their warnings and Lightning's banners are noise here.
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="census-"))
    census = run_census(out_dir, sys.argv[2:] or None)
    print(census.report())
    print(f"\n(every reason in full: {census.file})")
