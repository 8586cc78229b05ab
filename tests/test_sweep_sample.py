"""``distwgrad.testing.sweep.sample``: the same fixed-seed subset on every run, the edges always in it, and
every case under ``--full`` (``DISTWGRAD_FULL_SWEEPS=1``)."""

from __future__ import annotations

import pytest

from distwgrad.testing import sweep


def test_sample_is_fixed_and_keeps_the_edges(monkeypatch):
    monkeypatch.delenv(sweep.FULL_ENV, raising=False)
    cases = list(range(20))
    got = sweep.sample(cases, 5, seed=3)
    assert got == sweep.sample(cases, 5, seed=3) and len(got) == 5
    assert got[0] == 0 and got[-1] == 19 and got == sorted(set(got))
    assert sweep.sample(cases[:4], 5) == cases[:4]
    with pytest.raises(ValueError, match="at least 2"):
        sweep.sample(cases, 1)


def test_full_takes_every_case(monkeypatch):
    monkeypatch.setenv(sweep.FULL_ENV, "1")
    assert sweep.sample(range(20), 3) == list(range(20))
