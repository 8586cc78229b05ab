"""``distwgrad.testing.job_ranks.run_job``: a job's ranks forked as torchrun would start them ([Note: forked job
ranks]). Each rank sees torchrun's variables, the caller's environment, directory and arguments; a failing rank's
exit code comes back and its peers are killed; a hang becomes ``TimeoutExpired`` with no rank left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest

from distwgrad.testing import job_ranks
from distwgrad.testing.job_ranks import run_job

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

_REPORT = textwrap.dedent("""
    import sys
    forked = "torch" in sys.modules  # a fork of the server has imported it; a fresh interpreter has not
    import json, os
    import torch.distributed as dist
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "CALLER_SAYS")
    env = {k: os.environ.get(k) for k in keys}
    if "RANK" in os.environ:  # rendezvous as the job does: env://, rank 0 hosting the store
        dist.init_process_group("gloo")
        env["peers"] = dist.get_world_size()
        dist.barrier()  # no rank tears down while a peer still builds its connections
        dist.destroy_process_group()
    print(json.dumps({"env": env, "cwd": os.getcwd(), "argv": sys.argv[1:], "main": __name__, "forked": forked}))
    print("to stderr", os.environ.get("RANK"), file=sys.stderr)
""")


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize("env, forked", [({}, True), ({"CALLER_SAYS": "hi"}, False)])
def test_each_rank_sees_what_torchrun_gives_it(tmp_path, env, forked):
    """Forked from the server; and a fresh interpreter per rank where the caller adds a variable the server's
    environment lacks (one read at start would not reach a fork)."""
    work = tmp_path / "work"
    work.mkdir()
    proc = run_job(_script(tmp_path, _REPORT), ["--steps", "3"], 3, env=env, cwd=str(work))
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1", "2"]  # stdout in rank order
    for rank, r in enumerate(ranks):
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                            "MASTER_ADDR": "127.0.0.1", "CALLER_SAYS": env.get("CALLER_SAYS"), "peers": 3}, r
        assert r["cwd"] == str(work) and r["argv"] == ["--steps", "3"] and r["main"] == "__main__", r
        assert r["forked"] is forked, r
    assert proc.stderr.splitlines() == ["to stderr 0", "to stderr 1", "to stderr 2"]


def test_without_nproc_one_plain_process(tmp_path):
    proc = run_job(_script(tmp_path, _REPORT), [], None)
    assert proc.returncode == 0, proc.stderr
    (only,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert only["env"]["RANK"] is None and only["env"]["WORLD_SIZE"] is None and "peers" not in only["env"]


def test_a_module_runs_as_python_m_would(tmp_path):
    (tmp_path / "jobpkg").mkdir()
    (tmp_path / "jobpkg" / "__init__.py").write_text("")
    (tmp_path / "jobpkg" / "main.py").write_text(_REPORT)
    proc = run_job("jobpkg.main", ["a"], 2, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["argv"] for line in proc.stdout.splitlines()] == [["a"], ["a"]]


def test_a_failing_rank_returns_its_code_and_its_peers_are_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(job_ranks, "_GRACE_S", 1.0)
    body = textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("rank 1 gives up", file=sys.stderr)
            sys.exit(3)
        time.sleep(60)  # a peer blocked, as in a collective whose partner died
    """)
    start = time.monotonic()
    proc = run_job(_script(tmp_path, body), [], 2, timeout=60)
    assert time.monotonic() - start < 20, "the blocked peer was not killed after the grace period"
    assert proc.returncode == 3 and "rank 1 gives up" in proc.stderr, proc


def test_an_exception_exits_1_with_its_traceback(tmp_path):
    proc = run_job(_script(tmp_path, "raise RuntimeError('boom from the job')\n"), [], None)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "RuntimeError: boom from the job" in proc.stderr, proc.stderr


def test_a_hang_times_out_and_leaves_no_rank(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    body = f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\ntime.sleep(60)\n"
    with pytest.raises(subprocess.TimeoutExpired):
        run_job(_script(tmp_path, body), [], 2, timeout=5)
    started = [int(p) for p in os.listdir(pids)]
    assert len(started) == 2
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 0}, "nproc must be None or a positive int, got 0"),
    ({"nproc": 2.0}, "nproc must be None or a positive int, got 2.0"),
    ({"timeout": 0}, "timeout must be positive, got 0"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_job("distwgrad.launch.train", [], **kwargs)
