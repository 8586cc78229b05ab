"""Tests for the multi-rank harness: results, rank failures, hangs, dead ranks, case sweeps, isolation.

Rank functions live at module level because the spawn context pickles them by name.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from distwgrad.testing.multiprocess import CaseFailure, DistributedTestError, for_each_case, run_distributed

pytestmark = pytest.mark.distributed


def _record_pid(pid_dir: str, rank: int) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _assert_ranks_dead(pid_dir, world_size: int) -> None:
    for rank in range(world_size):
        pid = int((pid_dir / f"{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):  # killed and reaped: not even a zombie
            os.kill(pid, 0)


def _sleep_forever() -> None:
    while True:
        time.sleep(60)


def _all_reduce_rank(rank: int, world_size: int, scale: float = 1.0) -> tuple:
    t = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(t)
    return rank, t.item(), dist.get_world_size(), torch.get_num_threads()


def _gather_cases_rank(rank: int, world_size: int, cases: list[dict], *, offset: int) -> list:
    def body(case: dict, rank: int) -> list[int]:
        out = [torch.zeros(case["n"], dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(out, torch.full((case["n"],), rank + offset, dtype=torch.int64))
        return [int(t.sum()) for t in out]

    return for_each_case(cases, body, rank)


def _raise_on_rank_1(rank: int, world_size: int, pid_dir: str) -> None:
    _record_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("boom on rank 1")
    _sleep_forever()  # a peer stuck forever must not keep the parent waiting


def _hang_on_rank_0(rank: int, world_size: int, pid_dir: str) -> int:
    _record_pid(pid_dir, rank)
    if rank == 0:
        _sleep_forever()
    return rank


def _exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    _sleep_forever()


def _check_case(case: dict, rank: int) -> None:
    assert not (rank == 1 and case["n"] == 2), "bad n on rank 1"


def _sweep_failing_on_rank_1(rank: int, world_size: int) -> None:
    for_each_case([{"n": 1}, {"n": 2}, {"n": 3}], _check_case, rank)


def test_two_ranks_all_reduce():
    # Each rank sees the sum 1 + 2, a world of 2, and one intra-op thread.
    assert run_distributed(_all_reduce_rank, 2, timeout=60) == [(0, 3.0, 2, 1), (1, 3.0, 2, 1)]


def test_three_ranks_args_kwargs_and_sweep():
    cases = [{"n": 1}, {"n": 4}]
    results = run_distributed(_gather_cases_rank, 3, cases, offset=10, timeout=60)
    expected = [[10 * n, 11 * n, 12 * n] for n in (1, 4)]  # every rank gathers every rank's block
    assert results == [expected, expected, expected]


def test_rank_error_is_raised_in_parent_quickly(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 2, str(tmp_path), timeout=60)
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError: boom on rank 1" in msg
    assert "Traceback (most recent call last)" in msg and "in _raise_on_rank_1" in msg
    assert "ranks [0] had not finished" in msg and "in _sleep_forever" in msg  # rank 0's stack
    assert time.monotonic() - start < 30
    _assert_ranks_dead(tmp_path, 2)


def test_hang_times_out_and_kills_ranks(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_0, 2, str(tmp_path), timeout=10)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "timed out after 10 s" in msg and "ranks [0] had not finished (ranks [1] returned)" in msg
    assert "in _sleep_forever" in msg and "in _hang_on_rank_0" in msg  # where rank 0 was stuck
    assert 10 <= elapsed < 25
    _assert_ranks_dead(tmp_path, 2)


def test_rank_that_dies_silently_reports_exit_code():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 1 ---\nprocess exited with code 3 without"):
        run_distributed(_exit_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_for_each_case_names_failing_case():
    assert for_each_case([1, 2], lambda case, k: case * k, 10) == [10, 20]
    with pytest.raises(CaseFailure, match=r"^case \{'n': 2\}: AssertionError: bad n on rank 1") as info:
        for_each_case([{"n": 1}, {"n": 2}, {"n": 3}], _check_case, 1)
    assert info.value.case == {"n": 2} and isinstance(info.value.__cause__, AssertionError)


def test_for_each_case_failure_in_rank_names_case_and_rank():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sweep_failing_on_rank_1, 2, timeout=60)
    msg = str(info.value)
    assert "--- rank 1 ---" in msg and "CaseFailure: case {'n': 2}: AssertionError: bad n" in msg
    assert "--- rank 0 ---" not in msg  # rank 0 passed every case


def test_parallel_calls_do_not_collide():
    results: dict[float, list] = {}

    def call(scale: float) -> None:
        results[scale] = run_distributed(_all_reduce_rank, 2, scale=scale, timeout=60)

    threads = [threading.Thread(target=call, args=(s,)) for s in (1.0, 10.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {1.0: [(0, 3.0, 2, 1), (1, 3.0, 2, 1)], 10.0: [(0, 30.0, 2, 1), (1, 30.0, 2, 1)]}


def test_invalid_arguments_are_rejected():
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda rank, world_size: None, 2)
    with pytest.raises(ValueError, match="device='tpu'"):
        run_distributed(_all_reduce_rank, 2, device="tpu")


def test_torchrun_mode_runs_in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(pytest.skip.Exception, match="world_size=3, torchrun launched WORLD_SIZE=2"):
        run_distributed(_all_reduce_rank, 3)
    # An existing default group is reused, not re-created: this process plays rank 1 of 2.
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert run_distributed(_hang_on_rank_0, 2, str(tmp_path)) == [None, 1]
        with pytest.raises(DistributedTestError, match="rank 1 failed"):
            run_distributed(_raise_on_rank_1, 2, str(tmp_path))
    finally:
        dist.destroy_process_group()
