"""The mutation score (issue 44, item 7): the suite run on a reference-based port carrying one
plausible defect at a time (`attnres_conformance.mutants`).  Fails when the honest port fails a
case, when fewer than 95 % of the mutants are killed, when a survivor is not in `ACCEPTED` with
its reason, or when a mutant meant for a category (`Mutant.first` with `must_kill`) is killed by
another case than that category's (which would prove nothing about the category).

The score and the survivors are printed in pytest's terminal summary (`conftest.py`), so CI's
log shows them whether the test passes or fails; `python -m attnres_conformance.mutants -v`
prints the same table with each killer's message."""

import pytest
from attnres_conformance import mutants


@pytest.fixture(scope="module")
def score():
    return mutants.run_mutants()  # also kept as mutants.last_score for the terminal summary


def test_honest_control_passes_every_case(score):
    assert score.control is None, f"the honest reference port fails {score.control}: a false alarm"


def test_score_and_survivors(score):
    unaccepted = [s for s in score.survivors if s not in mutants.ACCEPTED]
    assert not unaccepted, f"surviving mutants not in ACCEPTED: {unaccepted}\n{score.text(True)}"
    assert score.fraction >= mutants.REQUIRED_SCORE, score.text(True)


def test_category_mutants_are_killed_by_their_category(score):
    wrong = [(r.mutant.name, r.killed_by) for r in score.results
             if r.mutant.must_kill and r.killed and not r.killed_by.startswith(r.mutant.first)]
    assert not wrong, wrong


def test_accepted_survivors_still_exist_and_have_reasons(score):
    names = {m.name for m in mutants.MUTANTS}
    assert set(mutants.ACCEPTED) <= names, set(mutants.ACCEPTED) - names
    assert all(reason.strip() for reason in mutants.ACCEPTED.values())
    killed = [r.mutant.name for r in score.results if r.killed and r.mutant.name in mutants.ACCEPTED]
    assert not killed, f"accepted survivors now killed: remove them from ACCEPTED: {killed}"


def test_at_least_40_mutants_each_with_a_rule():
    assert len(mutants.MUTANTS) >= 40
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
    assert all(m.rule and m.what and m.category for m in mutants.MUTANTS)
