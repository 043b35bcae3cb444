"""Set-up never holds the whole model on a rank but one (issue 28): a 252M-parameter transformers Llama built
in ``configure_model()`` -- its init runs in ``post_init``, so it takes the exact route -- at (dp, pp, tp) =
(1, 2, 2) on 4 ranks. Global rank 0 builds it on the host as written and streams it tensor by tensor into
every rank's shards; the other ranks only ever hold their share and one tensor in flight.

Measured (2 cores, 1007 MB of fp32 parameters, 236-270 MB per rank): peak RSS growth in set-up 339-397 MB on
ranks 1-3 (0.34-0.39 of the model) and 1328 MB on rank 0 (the host build plus its share), set-up 9-10 s.
Before (every rank built the whole model, rank 0's weights broadcast, the pipeline split copying the root):
2045-2046 MB on every rank (2.0 of the model), 23 s."""

import json

import pytest
import torch

from helpers import WORKERS
from helpers.launchers import torchrun
from helpers.workers.setup_memory_worker import module_for

pytestmark = pytest.mark.multiprocess
MODEL, RANKS = "llama_1024x15", 4


def _model_bytes() -> int:
    """The whole model's fp32 parameter bytes, from a build on the meta device."""
    with torch.device("meta"):
        module = module_for(MODEL)
        module.configure_model()
    return sum(p.numel() * 4 for p in module.parameters())


def test_no_rank_but_rank_0_holds_more_than_half_the_model_in_set_up(tmp_path):
    # torchrun, not forkrun: a forked rank faults in again the pages its parent had touched (test_meta_init_memory).
    torchrun(RANKS, str(WORKERS / "setup_memory_worker.py"), str(tmp_path), MODEL, timeout=600, rank_files=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    full = _model_bytes()
    mib = 2**20
    for rank, measured in enumerate(ranks):
        print(f"rank {rank}: share {measured['parameter_bytes'] / mib:.0f} MiB, peak RSS growth"
              f" {measured['peak_rss_growth_bytes'] / mib:.0f} MiB of a {full / mib:.0f} MiB model,"
              f" set-up {measured['setup_seconds']} s")
    for measured in ranks[1:]:  # the share, one full tensor in flight, the process's fixed overhead
        assert measured["peak_rss_growth_bytes"] < full / 2, measured
    # Rank 0 also holds the host build it streams from: the one copy of the whole model in the job.
    assert ranks[0]["peak_rss_growth_bytes"] < full + ranks[0]["parameter_bytes"] + full / 4, ranks[0]
