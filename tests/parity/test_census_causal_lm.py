"""The census of transformers' causal LMs (issue 52, ``helpers/census``): every decoder-only ``*ForCausalLM``
that builds from a tiny config, configured as for training (``use_cache=False``, no dropout, eager attention,
grouped kv heads), trained with ``policy="auto"`` at tp=2 and at pp=2 and judged against one process.

No model trains to numbers other than one process's, at any layout, listed or not; every model in
``helpers/census/known.py`` still passes; every refusal gives its reason. Each half's table is printed and
written to ``census.md`` in its temporary folder; ``python -m helpers.census`` (from tests/) prints the whole
table alone.
"""

import pytest

pytest.importorskip("transformers")

# A limit for hangs, not for slowness: each half takes ~2.5 minutes alone on 2 idle cores (one launch per layout);
# a hang inside a launch is stopped by the fault watch (helpers/census/running.py WATCH) well before this.
pytestmark = [pytest.mark.multiprocess, pytest.mark.long_launch, pytest.mark.timeout(2400)]


PARTS = 2
"""The census runs in halves (every other model of transformers' mapping), each a group of its own that a
pytest-xdist worker runs whole (helpers/xdist_groups.py), handed to whichever worker is free."""


@pytest.fixture(scope="module", params=range(PARTS), ids=lambda part: f"half{part}")
def census(request, tmp_path_factory):
    from helpers.census import run_census
    from helpers.census.configs import model_types

    return run_census(tmp_path_factory.mktemp(f"census{request.param}"), only=model_types()[request.param::PARTS])


def test_the_census_table_is_printed_and_written(census, capsys):
    assert census.file.read_text().startswith("| model |")
    assert len(census.rows) >= 100 // PARTS, f"only {len(census.rows)} models in the census: {census.not_building}"
    with capsys.disabled():
        print(f"\n{census.report()}\n(written to {census.file})")


def test_no_model_trains_to_other_numbers_than_one_process(census):
    wrong = {f"{model} at {layout}": outcome.detail for model, outcomes in census.rows.items()
             for layout, outcome in outcomes.items() if outcome.status == "wrong"}
    assert not wrong, f"silently wrong results (see {census.file}): {wrong}"


def test_every_model_known_to_pass_still_passes(census):
    from helpers.census.configs import model_types
    from helpers.census.known import KNOWN_TO_PASS

    def regression(model, layout) -> str | None:
        if model not in census.rows:
            return f"not in the census: {census.not_building.get(model) or census.out_of_scope.get(model)}"
        return None if census.rows[model][layout].status == "PASS" else census.rows[model][layout].cell()

    # A model the installed transformers does not have is no regression; one it has and cannot build is.
    installed = set(model_types()) & (set(census.rows) | set(census.not_building) | set(census.out_of_scope))
    regressed = {f"{model} at {layout}": regression(model, layout)
                 for layout, models in KNOWN_TO_PASS.items() for model in sorted(models & installed)
                 if regression(model, layout)}
    assert not regressed, f"models that passed no longer do (see {census.file}): {regressed}"


def test_every_refusal_gives_its_reason(census):
    silent = [f"{model} at {layout}" for model, outcomes in census.rows.items()
              for layout, outcome in outcomes.items() if outcome.status == "refused" and len(outcome.detail) < 20]
    assert not silent, f"refusals without a reason: {silent}"
