"""The pipeline simulator ([Note: the pipeline simulator] in ``distwgrad/parallel/simulate.py``) against what
is known in closed form: 1F1B's and GPipe's bubble is (p - 1) / m with F = I = W (integer times: exact),
the zero-bubble schedules stay under ZB-H1's (p - 1) / (3 m), and every schedule's action lists run each
microbatch's F and its backward (B, or I and W) exactly once on every stage."""

from __future__ import annotations

from collections import Counter

import pytest

from distwgrad.parallel import SCHEDULES
from distwgrad.parallel.simulate import StageTimes, action_lists, analytic_bubble, simulate, table

UNIT = StageTimes(1.0, 1.0, 1.0)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_1f1b_and_gpipe_bubbles_are_the_closed_form(pp, m):
    for name in ("1F1B", "GPipe"):
        pred = simulate(name, pp, m, UNIT)
        assert pred.bubble == analytic_bubble(pp, m)["1F1B"], (name, pred)
        assert pred.step_ms == 3 * (m + pp - 1)  # m microbatches of F + B, and p - 1 of fill and drain


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_schedules_stay_under_zb_h1(pp, m):
    half = StageTimes(0.5, 0.5, 0.5)  # two stages per rank: the same work per rank as UNIT on one
    bound = analytic_bubble(pp, m)["ZB-H1"]
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        if name == "DualPipeV" and m < 2 * pp:
            continue
        assert simulate(name, pp, m, half).bubble <= bound + 1e-12, name
    assert simulate("Interleaved1F1B", pp, m, half).bubble < analytic_bubble(pp, m)["1F1B"]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_microbatch_runs_once_on_every_stage(name):
    pp, m = 4, 8
    acts = [a for per_rank in action_lists(name, pp, m).values() for a in per_rank]
    n_stages = pp * (1 if SCHEDULES[name] == "single" else 2)
    count = Counter(acts)
    assert all(v == 1 for v in count.values())
    for s in range(n_stages):
        for mb in range(m):
            assert ("F", s, mb) in count
            assert ("B", s, mb) in count or {("I", s, mb), ("W", s, mb)} <= set(count)
    assert len({mb for _, _, mb in acts}) == m  # torch's 1F1B last-rank list, read as its runtime runs it


def test_transfers_cost_time_and_bad_times_are_refused():
    assert simulate("1F1B", 2, 4, UNIT, comm_ms=0.5).step_ms > simulate("1F1B", 2, 4, UNIT).step_ms
    with pytest.raises(ValueError, match=r"times must cover stages 0..3"):
        simulate("ZBVZeroBubble", 2, 4, {0: UNIT})
    with pytest.raises(ValueError, match="stage times must be >= 0"):
        StageTimes(1.0, -1.0, 1.0)
    assert table(UNIT, 16, 0.0, pps=(2,), micro=(4,)).count("\n") == 2
