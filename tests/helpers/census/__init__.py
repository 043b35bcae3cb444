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
from dataclasses import dataclass, field
from pathlib import Path

from helpers.census.configs import does_not_build, model_types, not_decoder_only
from helpers.census.outcomes import Outcome, judge, table
from helpers.census.running import LAYOUTS, case_for, run_layout


@dataclass
class Census:
    rows: dict[str, dict[str, Outcome]] = field(default_factory=dict)
    """Model type -> layout -> outcome, for every model in the census."""
    not_building: dict[str, str] = field(default_factory=dict)
    """Model type -> why its tiny model does not build or train in one process (not counted)."""
    out_of_scope: dict[str, str] = field(default_factory=dict)
    """Model type -> why it is not a decoder-only causal LM (not counted)."""
    seconds: float = 0.0

    def report(self, width: int | None = 110) -> str:
        """The table, then the models left out and why, then the time taken."""
        lines = [table(self.rows, list(LAYOUTS), width), "", f"Does not build ({len(self.not_building)}):"]
        lines += [f"- {model}: {why}" for model, why in self.not_building.items()]
        lines += ["", f"Not decoder-only causal LMs ({len(self.out_of_scope)}):"]
        lines += [f"- {model}: {why}" for model, why in self.out_of_scope.items()]
        lines += ["", f"Census of {len(self.rows)} models in {self.seconds:.0f} s."]
        return "\n".join(lines)


def run_census(out_dir: Path, only: list[str] | None = None) -> Census:
    """The census (of the model types ``only``, if given), its launches' files under ``out_dir``."""
    from helpers.harness import reference_for

    started = time.perf_counter()
    census = Census()
    models = []
    for model_type in only or model_types():
        reason = not_decoder_only(model_type)
        if reason is None:
            reason = does_not_build(model_type)
            if reason is None:
                models.append(model_type)
            else:
                census.not_building[model_type] = reason
        else:
            census.out_of_scope[model_type] = reason
    runs = {layout: run_layout(models, layout, Path(out_dir) / layout) for layout in LAYOUTS}
    for model_type in models:
        try:
            reference = reference_for(case_for(model_type, next(iter(LAYOUTS))))  # one reference for all layouts
        except Exception as err:  # the model trains in one process (does_not_build), but not under Lightning
            failed = Outcome("failed", f"the one-process run: {type(err).__name__}: {err}".splitlines()[0])
            census.rows[model_type] = {layout: failed for layout in LAYOUTS}
            continue
        census.rows[model_type] = {layout: judge(runs[layout][model_type], reference, layout) for layout in LAYOUTS}
    census.seconds = time.perf_counter() - started
    return census
