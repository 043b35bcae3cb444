"""Hugging Face Llama (and GQA) under any layout matches the single-process Hugging Face model step by step
(losses, global gradient norms, parameters). Tiny random configs; nothing is downloaded."""

import pytest

pytest.importorskip("transformers")

from helpers.harness import assert_parity, reference_for  # noqa: E402
from helpers.hf_cases import LLAMA_CASES  # noqa: E402


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_llama_trains_as_the_single_process_model(shared_runs, name):
    case = LLAMA_CASES[name]
    # The harness's tolerances: well-conditioned by its Adam eps (harness.ADAM_EPS says why and how much).
    assert_parity(shared_runs[name], reference_for(case))
