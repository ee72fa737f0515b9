"""``pipec tune``'s retime loop under summed prices (tune/search.py): summed rows ranked at the pieces' level (the
median timed / summed step of the candidates retimed), so the loop stops once the best timed candidate is ahead of
every level-corrected summed one; the bounds' list stays in summed terms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipec.tune.search import Scored, _Search
from pipec.tune.space import Candidate


def _row(m: int, step: float) -> Scored:
    c = Candidate(pp=2, dp=1, schedule="1f1b", num_chunks=1, num_microbatches=m, partition_by="flops")
    return Scored(candidate=c, plan=None, step_time=step, peak_memory=100, bubble=0.1, tokens_per_s=1000 / step,
                  mfu=None, scaling_efficiency=0.5 / step)


def _search(timed: list[Scored], ratios: list[float], summed: list[Scored]) -> _Search:
    """A search holding ``timed`` rows (retimed, at these timed / summed ratios) and ``summed`` ones; retiming a row
    records it and times it at 1.5 x its summed step."""
    s = _Search.__new__(_Search)
    s.graphs = SimpleNamespace(pieces=object())
    s.fits = [*timed, *summed]
    s.retimed = {x.candidate for x in timed}
    s._ratios = list(ratios)
    s._times = sorted(map(s._bounded, s.fits))
    s.calls = []

    def retime(row: Scored) -> None:
        s.calls.append(row.candidate.num_microbatches)
        s.retimed.add(row.candidate)
        s.fits.remove(row)
        s._ratios.append(1.5)
        s.fits.append(_row(row.candidate.num_microbatches, row.step_time * 1.5))

    s.retime = retime
    return s


def test_a_summed_row_faster_than_the_best_timed_but_not_at_the_level_ranks_behind_it_and_is_not_retimed():
    best, summed = _row(2, 1.0), _row(4, 0.9)           # 10% faster summed, at a level of 1.3: 1.17
    s = _search([best], [1.3], [summed])
    assert s.level() == pytest.approx(1.3)
    assert [x.candidate.num_microbatches for x in s.ranked()] == [2, 4]
    assert not s.retime_fastest() and s.calls == []
    shown = s.shown(summed)
    assert shown.step_time == pytest.approx(1.17) and shown.summed_step == 0.9
    assert shown.tokens_per_s == pytest.approx(1000 / 1.17) and shown.scaling_efficiency == pytest.approx(0.5 / 1.17)
    assert s.shown(best) is best                        # a timed row as it is
    # the bounds' list in summed terms: the timed row at 1.0 / 1.3, below the summed 0.9 as ranked
    assert s._times[0] == pytest.approx(1 / 1.3) and s._times[1] == 0.9


def test_the_loop_retimes_a_summed_row_ahead_at_the_level_until_a_timed_one_leads():
    best, ahead, behind = _row(2, 1.0), _row(8, 0.7), _row(4, 0.9)   # at 1.3: 0.91 leads, 1.17 does not
    s = _search([best], [1.3], [ahead, behind])
    assert s.retime_fastest()
    assert s.calls == [8]                                # timed at 1.05: level 1.4, the summed 0.9 at 1.26
    assert s.level() == pytest.approx(1.4)
    assert [x.candidate.num_microbatches for x in s.ranked()] == [2, 8, 4]
    assert s.ranked()[0].candidate in s.retimed


def test_without_a_retime_the_level_is_one_and_rows_rank_by_their_sums():
    a, b = _row(2, 1.0), _row(4, 0.9)
    s = _search([], [], [a, b])
    assert s.level() == 1.0 and s.ranked() == [b, a]
    assert s._times == [0.9, 1.0]
