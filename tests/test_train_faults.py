"""The training job when a rank dies or hangs, and checkpoints whose save is killed part-way.

A rank is killed (SIGKILL) or stopped (SIGSTOP) from the test, by its pid (found in ``/proc``: a child of
the torchrun process whose environment says ``RANK=r``), once a chosen checkpoint is complete; the job
must end within the bound of docs/training.md (Faults), exit non-zero, print its one line, record the
interruption in report.json, and its last complete checkpoint must resume to the uninterrupted run's
losses. Saves are killed with SIGKILL (no ``finally`` runs, as in a real crash) at each point of
[Note: atomic save] in ``distwgrad/checkpoint.py``, in forked children of one spawned process.

Bounds (measured on the shared 2-core CPU box, ``--timeout 10``): a killed rank ends the job 1-2 s after
the kill, a stopped one 15-17 s after (the timeout, then the 5-s probe); the asserts allow the documented
bound plus 5 s for torchrun's own teardown and the box's load.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from train_job_cases import _run_forked as _forked_job

from distwgrad.checkpoint import load_checkpoint, resolve_checkpoint
from distwgrad.models import MoEGPT, MoEGPTConfig
from distwgrad.testing.multiprocess import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = "distwgrad.launch" if importlib.util.find_spec("distwgrad.launch") else "launch"
MODULE = f"{LAUNCH}.train"
if LAUNCH == "launch" and REPO not in sys.path:
    sys.path.insert(0, REPO)
_faults = importlib.import_module(f"{LAUNCH}.faults")
LOSS_ATOL = importlib.import_module(f"{LAUNCH}.train").PARITY_LOSS_ATOL  # as in tests/train_job_cases.py

TIMEOUT = 10  # --timeout of the fault runs
PROBE = _faults.probe_seconds(TIMEOUT)
SLACK = 8.0  # writing report.json, torchrun's teardown, a loaded box: on top of the timeout and the probe
SMALL = ["--global-batch", "8", "--microbatches", "2", "--seq-len", "32", "--d-model", "32", "--d-ff", "64",
         "--no-progress", "--log-every", "1"]
CONFIG = MoEGPTConfig(seq_len=32, d_model=32, d_ff=64)  # the model SMALL builds
LINE = re.compile(r"^distwgrad\.launch\.train: interrupted at step (\d+): rank (\d+) lost \(.+\); last complete "
                  r"checkpoint: (\S+)$", re.MULTILINE)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", MODULE, *args]


def _run_forked(args: list[str], entry: tuple[str, ...] = (MODULE,)) -> subprocess.CompletedProcess:
    """A run that must succeed, its 2 ranks forked ([Note: forked job ranks]): the uninterrupted reference, a
    resume, the job's own waits. The faults themselves run under torchrun (``_interrupt``); ``entry``: the job's
    module, or a script and its arguments."""
    proc = _forked_job([*entry[1:], *args], 2, timeout=180, target=entry[0])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def _report(out) -> dict:
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f)


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of ``rank``: a child of torchrun's process ``agent`` whose environment has ``RANK=rank``."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != agent:
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(name)
        except (OSError, ValueError):
            continue
    return None


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not os.path.isdir(path):
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before {path} existed"
        assert time.monotonic() < end, f"no {path} after {timeout} s"
        time.sleep(0.05)


def test_sigterm_while_a_failed_collective_is_handled_raises_nothing():
    """``catch_sigterm``: torchrun's SIGTERM that lands while a survivor already handles a failed collective
    (its ``except`` clause, or an error raised inside it) raises nothing, so the report comes out; anywhere
    else, including inside the handling of the rank's own error, it raises ``Terminated``. Run in a child
    process (it signals itself)."""
    script = textwrap.dedent(f"""
        import os, signal
        from {LAUNCH} import faults

        def sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10000):  # the handler runs at the next bytecode boundary
                pass

        faults.catch_sigterm()
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Read error: Connection reset by peer")
        except RuntimeError:
            sigterm()
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # and later ones are ignored
        print("in a failure: nothing raised")
        faults.catch_sigterm()
        try:
            try:
                raise RuntimeError("Timed out waiting 10000ms for recv")
            except RuntimeError:
                raise ValueError("raised while handling it")
        except ValueError:
            sigterm()
        print("in an error raised while handling one: nothing raised")
        for case, raising in (("outside", lambda: None), ("in the rank's own error", lambda: 1 / 0)):
            faults.catch_sigterm()
            try:
                try:
                    raising()
                    sigterm()
                except ZeroDivisionError:
                    sigterm()
            except faults.Terminated:
                print(case + ": Terminated")
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["in a failure: nothing raised",
                                        "in an error raised while handling one: nothing raised",
                                        "outside: Terminated", "in the rank's own error: Terminated"], proc.stdout


def _late_rank0(rank: int, world: int) -> tuple[float, list[int] | None, float]:
    """One rank of :func:`test_each_monitored_wait_holds_every_rank_to_its_own_timeout`."""
    _faults.publish_pid()
    _, rank0_wait = _faults.monitor_groups(3, rank0_works=True)
    probe, _ = _faults.monitor_groups(10, rank0_works=False)
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(4)  # solo work longer than a --timeout of 3 s
    _faults.wait_for_rank0(rank0_wait, 3)
    waited = time.monotonic() - t0
    if rank == 0:
        time.sleep(8)  # hung past the probe of a --timeout of 10 s, alive until the others are done
        return waited, None, 0.0
    t0 = time.monotonic()
    lost = _faults.lost_ranks(probe, _faults.probe_seconds(10))
    return waited, lost, time.monotonic() - t0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_each_monitored_wait_holds_every_rank_to_its_own_timeout():
    """gloo's monitored barrier holds ranks other than 0 to its group's timeout, not its argument ([Note:
    monitored barrier timeouts]). With ``--timeout 3``, rank 1 waits out rank 0's 4 s of solo work (up to
    twice the timeout); with ``--timeout 10``, a hung rank 0 is named at the probe's 5 s, not the timeout's 10."""
    waited, lost, probed = run_distributed(_late_rank0, 2, timeout=45)[1]
    assert 3 < waited <= 6, waited
    assert lost == [0] and 4.9 <= probed <= 7, (lost, probed)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    _run_forked(["--steps", "16", "--out", out, *SMALL])
    return _report(out)


def _interrupt(tmp_path, sig: signal.Signals, victim: int, save_at: int = 6):
    """Runs the job, sends ``sig`` to rank ``victim`` once ``step_{save_at}`` is complete; returns the seconds
    from the signal to the job's end, its stderr, and the run folder."""
    out = str(tmp_path / "run")
    args = ["--steps", "200", "--save-every", "3", "--timeout", str(TIMEOUT), "--out", out, *SMALL]
    log = open(tmp_path / "job.log", "w+")
    proc = subprocess.Popen(_torchrun(args), env=_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        _wait_for(os.path.join(out, "checkpoints", f"step_{save_at}"), proc)
        pid = _rank_pid(proc.pid, victim)
        assert pid is not None
        os.kill(pid, sig)
        t0 = time.monotonic()
        proc.wait(timeout=TIMEOUT + PROBE + 60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None and sig == signal.SIGSTOP:
            assert _rank_pid(proc.pid, victim) is None  # the survivor ended the stopped rank
    log.seek(0)
    text = log.read()
    log.close()
    assert proc.returncode != 0, text[-4000:]
    return elapsed, text, out


def _check_interrupted(text: str, out: str, victim: int, after: int) -> dict:
    lines = LINE.findall(text)
    assert len(lines) == 1, text[-4000:]
    step, lost, ckpt = lines[0]
    # ``after``'s checkpoint exists when the signal goes, so the job is at step ``after`` (still in its save:
    # the barrier after the rename) or later
    assert int(lost) == victim and int(step) >= after
    assert ckpt == resolve_checkpoint(os.path.join(out, "checkpoints"))  # what --resume DIR picks
    r = _report(out)
    i = r["interrupted"]
    assert i == r["summary"]["interrupted"] and i["lost_ranks"] == [victim] and i["lost_rank"] == victim
    assert i["step"] == int(step) and i["last_checkpoint"] == ckpt and i["reported_by"] == 1 - victim
    assert r["steps"] == list(range(1, i["last_step_done"] + 1)) and r["segments"][-1]["last_step"] == r["steps"][-1]
    assert "exitcode  : 3" in text  # the survivor's code; torchrun's own is 1
    return r


def _check_resumes(r: dict, tmp_path, uninterrupted: dict) -> None:
    """The last complete checkpoint resumes and gives the uninterrupted run's losses."""
    ckpt = r["interrupted"]["last_checkpoint"]
    at = int(ckpt.rsplit("_", 1)[1])
    to = min(at + 3, uninterrupted["steps"][-1])
    assert to > at
    out = str(tmp_path / "resumed")
    _run_forked(["--steps", str(to), "--resume", os.path.dirname(ckpt), "--out", out, *SMALL])
    resumed = _report(out)
    assert resumed["start_step"] == at and resumed["steps"] == list(range(at + 1, to + 1))
    want = uninterrupted["loss"][at:to]
    assert max(abs(a - b) for a, b in zip(resumed["loss"], want)) <= LOSS_ATOL, (resumed["loss"], want)
    done = r["loss"][: min(len(r["loss"]), 16)]  # the interrupted run's own steps match too
    assert max(abs(a - b) for a, b in zip(done, uninterrupted["loss"])) <= LOSS_ATOL


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.full), 0])  # CI: rank 0 lost; --full: both
def test_a_killed_rank_ends_the_job_and_its_checkpoint_resumes(victim, tmp_path, uninterrupted):
    elapsed, text, out = _interrupt(tmp_path, signal.SIGKILL, victim)
    assert elapsed <= PROBE + SLACK, (elapsed, text[-3000:])
    r = _check_interrupted(text, out, victim, after=6)
    if victim == 1:
        _check_resumes(r, tmp_path, uninterrupted)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.full)])  # CI: rank 1 hangs; --full: both
def test_a_stopped_rank_ends_the_job_within_the_timeout(victim, tmp_path, uninterrupted):
    elapsed, text, out = _interrupt(tmp_path, signal.SIGSTOP, victim)
    assert TIMEOUT <= elapsed <= TIMEOUT + PROBE + SLACK, (elapsed, text[-3000:])
    r = _check_interrupted(text, out, victim, after=6)
    assert re.search(r"timed out|timeout", r["interrupted"]["reason"], re.I), r["interrupted"]
    if victim == 1:
        _check_resumes(r, tmp_path, uninterrupted)


# The job (argv[1]) with rank 0's reference work slowed, as a large model's would be, at no CPU cost: its
# second lockstep reference step sleeps argv[2] seconds after its work, and the free-running reference argv[3].
_SLOW_REFERENCE = textwrap.dedent("""
    import importlib, runpy, sys, time
    module, lockstep_s, free_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    del sys.argv[1:4]
    parity = importlib.import_module(module.rsplit(".", 1)[0] + ".parity")
    check, free_running = parity.Lockstep.check, parity._free_running

    def slow_check(self, model, tokens_BS, loss, step):
        check(self, model, tokens_BS, loss, step)
        if self.ref is not None and step == 2:  # rank 0's reference step, once
            time.sleep(lockstep_s)

    def slow_free_running(*args):
        losses = free_running(*args)
        time.sleep(free_s)
        return losses

    parity.Lockstep.check, parity._free_running = slow_check, slow_free_running
    runpy.run_module(module, run_name="__main__", alter_sys=True)
""")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_parity_reference_may_outlast_the_timeout(tmp_path):
    """Rank 0's lockstep reference step is bracketed by a monitored barrier of twice the timeout, and its
    free-running reference runs after the last collective (no rank waits on it): a run whose lockstep reference
    step takes longer than ``--timeout`` (under twice it) and whose free-running reference alone takes longer
    than ``--timeout`` passes. The reference's time is slept (``_SLOW_REFERENCE``), so the bounds are exact."""
    timeout, lockstep_s, free_s = 3, 4.0, 4.0
    script, out = tmp_path / "slow_reference.py", str(tmp_path / "run")
    script.write_text(_SLOW_REFERENCE)
    proc = _run_forked(["--steps", "3", "--check-parity", "--timeout", str(timeout), "--out", out, *SMALL],
                       entry=(str(script), MODULE, str(lockstep_s), str(free_s)))
    r = _report(out)
    assert r["parity"]["passed"] and r["config"]["timeout"] == timeout
    assert r["interrupted"] is None and r["summary"]["interrupted"] is None
    assert "interrupted" not in proc.stderr
    keys = ("step 1/3", "step 2/3", "step 3/3", r"parity \(lockstep")
    stamps = {key: time.mktime(time.strptime(re.search(rf"^\[(\d\d:\d\d:\d\d)\] {key}", proc.stderr, re.M)[1],
                                             "%H:%M:%S")) for key in keys}
    # whole-second stamps: a gap of 4 s shows as at least 4, and one shown as 4 was over 3 (the timeout)
    assert stamps["step 2/3"] - stamps["step 1/3"] >= timeout + 1, "the lockstep reference step took under --timeout"
    assert stamps[r"parity \(lockstep"] - stamps["step 3/3"] >= timeout + 1, \
        "the free-running reference took under --timeout"


# --- saves killed part-way ([Note: atomic save]) --------------------------------------------------------

# Each point: (what is patched, on which call the process SIGKILLs itself). The child saves step 6 over a
# root holding step_2 and step_4 (saved with keep_last=2) and dies there; "resave" saves step 4 again.
POINTS = {
    "before_any_file": "torch.distributed.checkpoint.save",
    "mid_write": "torch.distributed.checkpoint.filesystem._write_item",  # after two items are written
    "before_meta": "distwgrad.checkpoint._write_json",
    "before_rename": "distwgrad.checkpoint._replace_dir",
    "between_renames": "os.rename",  # re-saving step_4: step_4 moved to step_4.old, step_4.tmp not renamed yet
    "mid_prune": "shutil.rmtree",  # keep_last=1: step_6 complete, step_2 renamed to step_2.deleting, not deleted
}

_SAVER = textwrap.dedent("""
    import dataclasses, importlib, os, shutil, signal, sys
    import torch
    import distwgrad
    import distwgrad.checkpoint as ck
    from distwgrad.models import MoEGPT, MoEGPTConfig
    torch.set_num_threads(1)
    base, points = sys.argv[1], sys.argv[2:]
    config = MoEGPTConfig(seq_len=32, d_model=32, d_ff=64)
    model = MoEGPT(config)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, config.vocab_size, (4, 33))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    distwgrad.drain_deferred_wgrads(model)
    distwgrad.finalize_model_grads(model)
    opt.step()
    meta = {"model_config": dataclasses.asdict(config)}

    def die_at(target, after=0, suffix=""):  # SIGKILL on the call after `after` whose path ends in suffix
        mod, name = target.rsplit(".", 1)
        module = importlib.import_module(mod)
        real, calls = getattr(module, name), [0]
        def hook(*args, **kwargs):
            calls[0] += 1
            if calls[0] > after and str(args[0] if args else "").endswith(suffix):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        setattr(module, name, hook)

    for point in points:
        root = os.path.join(base, point)
        for step in (2, 4):
            ck.save_checkpoint(root, step, model, opt, meta=meta, keep_last=2)
        child = os.fork()
        if child == 0:
            die_at(POINTS[point], **{"mid_write": {"after": 2}, "between_renames": {"suffix": "step_4.tmp"},
                                     "mid_prune": {"suffix": ".deleting"}}.get(point, {}))
            step = 4 if point == "between_renames" else 6
            ck.save_checkpoint(root, step, model, opt, meta=meta, keep_last=1 if point == "mid_prune" else 2)
            os._exit(0)  # not reached: the hook kills the process
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (point, status)
""")


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("killed_saves"))
    code = f"POINTS = {POINTS!r}\n" + _SAVER
    proc = subprocess.run([sys.executable, "-c", code, base, *POINTS], env=_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base


def _load(path: str) -> int:
    model = MoEGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters())
    with torch.random.fork_rng():
        return load_checkpoint(path, model, opt, expect={"model_config": dataclasses.asdict(CONFIG)})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", list(POINTS))
def test_a_killed_save_never_leaves_a_checkpoint_that_resume_picks_and_fails_on(point, killed_saves):
    root = os.path.join(killed_saves, point)
    left = sorted(os.listdir(root))
    if point == "mid_prune":  # step_6 was complete before step_2 went; step_4 is past keep_last=1
        newest, expected_left = 6, {"step_4", "step_6"}
    elif point == "between_renames":  # the re-saved step is lost, the older one resumes
        newest, expected_left = 2, {"step_2", "step_4.old", "step_4.tmp"}
    else:  # nothing older was pruned before the new one was complete
        newest, expected_left = 4, {"step_2", "step_4", "step_6.tmp"}
    assert set(left) - {f"step_{s}.deleting" for s in (2, 4)} == expected_left, left
    if point == "before_any_file":
        assert os.listdir(os.path.join(root, "step_6.tmp")) == []
    if point == "mid_write":  # data written, DCP's metadata not
        files = os.listdir(os.path.join(root, "step_6.tmp"))
        assert any(f.endswith(".distcp") for f in files) and ".metadata" not in files, files
    if point == "before_rename":  # everything but the rename
        assert {"meta.json", ".metadata"} <= set(os.listdir(os.path.join(root, "step_6.tmp")))
    picked = resolve_checkpoint(root)  # what --resume ROOT picks
    assert picked == os.path.join(root, f"step_{newest}")
    assert _load(root) == newest


@pytest.mark.timeout(300)
def test_the_next_save_clears_leftovers_and_keep_last_prunes_after_completion(killed_saves, tmp_path):
    """After a killed save of step 6, saving step 6 again with keep_last=1 completes, removes the older
    checkpoints and the leftovers, and loads."""
    import shutil

    root = str(tmp_path / "root")
    shutil.copytree(os.path.join(killed_saves, "before_rename"), root)
    from distwgrad.checkpoint import save_checkpoint

    model = MoEGPT(CONFIG)
    save_checkpoint(root, 6, model, torch.optim.AdamW(model.parameters()),
                    meta={"model_config": dataclasses.asdict(CONFIG)}, keep_last=1)
    assert sorted(os.listdir(root)) == ["step_6"]
    assert _load(root) == 6
    with pytest.raises(ValueError, match=r"keep_last=-1 must be an int >= 0"):
        save_checkpoint(root, 8, model, keep_last=-1)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_keep_last_in_the_job(tmp_path):
    out = str(tmp_path / "run")
    _run_forked(["--steps", "8", "--save-every", "2", "--keep-last", "2", "--out", out, *SMALL])
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_6", "step_8"]
    assert [os.path.basename(p) for p in _report(out)["checkpoints"]] == ["step_2", "step_4", "step_6", "step_8"]
