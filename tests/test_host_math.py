"""``kernels/_host.py``'s ``cdiv`` and ``next_pow2``: the launchers' host-side grid arithmetic, the same
values as Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` (which recent Triton releases make
``constexpr_function`` objects, slow to call from Python)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

triton = pytest.importorskip("triton")


@given(st.integers(0, 2**40), st.integers(1, 2**20))
def test_cdiv_is_tritons(a, b):
    from distwgrad.kernels._host import cdiv
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(0, 2**40))
def test_next_pow2_is_tritons(n):
    from distwgrad.kernels._host import next_pow2
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_edges():
    from distwgrad.kernels._host import cdiv, next_pow2
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert [cdiv(a, 128) for a in (0, 1, 127, 128, 129)] == [0, 1, 1, 1, 2]
