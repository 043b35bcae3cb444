"""The census of transformers' causal LMs (issue 52): every decoder-only ``*ForCausalLM`` of transformers'
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that builds from a tiny config, configured as for training, run with
``policy="auto"`` at tp=2 and at pp=2 on 2 gloo ranks and judged against one process.

configs.py   which models are in it and the tiny config of each
running.py   one launch per layout for all its models, going on past the ones that raise
outcomes.py  PASS / refused / failed / wrong / unsplit, the tolerances, the table
known.py     the models that must keep passing

``python -m helpers.census [OUT_DIR]`` (from tests/) runs it and prints the table;
``tests/parity/test_census_causal_lm.py`` runs it in the suite.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from helpers.census.configs import model_types, not_decoder_only, too_large, why_not_built
from helpers.census.outcomes import Outcome, judge, rounding_drift, table
from helpers.harness import Result
from helpers.census.running import LAYOUTS, case_for, run_layout


@dataclass
class Census:
    """Every model's outcome at every layout, and the models left out with the reason."""

    rows: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    """Model type -> layout -> outcome, for every model in the census."""
    not_building: dict[str, str] = field(default_factory=dict)
    """Model type -> why its tiny model does not build or train in one process (not counted)."""
    out_of_scope: dict[str, str] = field(default_factory=dict)
    """Model type -> why it is not a decoder-only causal LM (not counted)."""
    seconds: float = 0.0
    file: Path | None = None
    """Where the report is written, with every reason in full."""

    def report(self, width: int | None = 110) -> str:
        """The table (cells cut to ``width`` characters; None: whole), the models that pass and are not yet in
        known.py, the models left out and why, and the time taken."""
        from helpers.census.known import KNOWN_TO_PASS

        lines = [table(self.rows, list(LAYOUTS), width), ""]
        for layout in LAYOUTS:
            new = sorted(model for model, outcomes in self.rows.items()
                         if outcomes[layout].status == "PASS" and model not in KNOWN_TO_PASS[layout])
            if new:
                lines.append(f"Pass at {layout}, not yet in helpers/census/known.py: {', '.join(new)}")
        lines += ["", f"Does not build ({len(self.not_building)}):"]
        lines += [f"- {model}: {why}" for model, why in self.not_building.items()]
        lines += ["", f"Not decoder-only causal LMs ({len(self.out_of_scope)}):"]
        lines += [f"- {model}: {why}" for model, why in self.out_of_scope.items()]
        lines += ["", f"Census of {len(self.rows)} models in {self.seconds:.0f} s."]
        return "\n".join(lines)


def run_census(out_dir: Path, only: list[str] | None = None) -> Census:
    """The census (of the model types ``only``, if given): its launches' files and its report, ``census.md``,
    under ``out_dir``."""
    started = time.perf_counter()
    census = Census()
    references = {}
    for model_type in only or model_types():
        reason = not_decoder_only(model_type)
        if reason is not None:
            census.out_of_scope[model_type] = reason
            continue
        # The one-process run comes first: a model that does not build or train there is not launched.
        built = _one_process(model_type)
        if isinstance(built, str):
            census.not_building[model_type] = built
        else:
            references[model_type] = built
    runs = {layout: run_layout(list(references), layout, Path(out_dir) / layout) for layout in LAYOUTS}
    census.rows = {model_type: {layout: _judged(model_type, layout, runs[layout][model_type], reference)
                                for layout in LAYOUTS}
                   for model_type, reference in references.items()}
    census.seconds = time.perf_counter() - started
    census.file = Path(out_dir) / "census.md"
    census.file.write_text(census.report(width=None) + "\n")
    return census


def _judged(model_type: str, layout: str, run, reference) -> Outcome:
    """``run`` judged against one process; a pipeline that differs from one process on the whole batch but
    matches one process on the pipeline's micro-batches computes what the model computes on them: the model's
    output depends on the batch (a router's near-tie decided by rounding), the layout is not at fault."""
    from helpers.harness import reference_for

    outcome = judge(run, reference, layout)
    if outcome.status == "wrong" and LAYOUTS[layout]["pipeline_parallel_size"] > 1:
        microbatched = reference_for(replace(case_for(model_type, layout), module="hf_microbatched"))
        if judge(run, microbatched, layout).status == "PASS":
            return Outcome("PASS", f"as one process on the 2 micro-batches (on the whole batch: {outcome.detail})")
    if outcome.status == "wrong" and isinstance(run, Result):
        exact = reference_for(replace(case_for(model_type, layout), precision="64-true"))
        if judge(run, reference, layout, rounding=rounding_drift(reference, exact)).status == "PASS":
            return Outcome("PASS", f"within one process's own float32 rounding (as float64 trains it: {outcome.detail})")
    return outcome


def _one_process(model_type: str):
    """The one-process run every layout of ``model_type`` is judged against (the same for all: it depends on
    the model, data and steps only), or why the model does not build or train in one process."""
    import math

    from helpers.harness import reference_for

    try:
        reason = too_large(model_type)
        if reason is not None:
            return reason
        reference = reference_for(case_for(model_type, next(iter(LAYOUTS))))
    except Exception as err:  # any failure to build or train is the reason
        return why_not_built(model_type, err)
    if not all(map(math.isfinite, reference.losses)):
        return f"losses {reference.losses} in one process"
    return reference
