"""What the training-job tests (``test_train_job_*.py``) share: the job's module name, a small model's
arguments, ``torchrun`` launching, the report, a token file.

Not a test module: the tests import it (pytest puts tests/ on the path).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from distwgrad.models import MoEGPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--global-batch", "12", "--microbatches", "2", "--seq-len", "32", "--d-model", "32", "--d-ff", "64",
         "--no-progress", "--log-every", "10"]  # 12 sequences: divisible by 1, 2 and 3 ranks x 2 microbatches
CONFIG = MoEGPTConfig(seq_len=32, d_model=32, d_ff=64)  # the model SMALL builds

# ``distwgrad.launch`` exists once installed (``pip install -e .``); a bare checkout on PYTHONPATH has no
# such package (setuptools maps it onto ``launch/`` only at install time), so there the same files run
# as ``launch``.
LAUNCH = "distwgrad.launch" if importlib.util.find_spec("distwgrad.launch") else "launch"
MODULE = f"{LAUNCH}.train"


def _launch(name: str):
    if LAUNCH == "launch" and REPO not in sys.path:
        sys.path.insert(0, REPO)
    return importlib.import_module(f"{LAUNCH}.{name}")


LOSS_ATOL = _launch("train").PARITY_LOSS_ATOL  # see test_train_job_runs.py's docstring


def _run(args: list[str], nproc: int | None = 2, env: dict | None = None, timeout: float = 240):
    """``torchrun --standalone --nproc-per-node N -m <job> ARGS`` (or plain ``python -m`` with None)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + ["-m", MODULE, *args]
    full_env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _run_forked(args: list[str], nproc: int | None = 2, env: dict | None = None, timeout: float = 240,
                target: str = MODULE, cwd: str = REPO):
    """``_run``'s job (or ``target``: another module, or a script), each rank forked from a process that imported
    torch ([Note: forked job ranks] in ``distwgrad/testing/job_ranks.py``): for the tests of what a run computes,
    not of how torchrun runs it."""
    from distwgrad.testing.job_ranks import run_job
    return run_job(target, args, nproc, env=dict(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **(env or {})), cwd=cwd,
                   timeout=timeout)


def _ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def _report(out) -> dict:
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f)


def _token_file(path, n: int = 20_000, vocab: int = 60) -> str:
    """A file in nanoGPT's convention: flat little-endian uint16 tokens."""
    np = pytest.importorskip("numpy")
    np.random.default_rng(0).integers(0, vocab, n).astype("<u2").tofile(path)
    return str(path)


TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ") * 60


def _prepared(folder, text: str = TEXT, **kwargs) -> str:
    """A folder ``prepare_data`` wrote from ``text`` (bytes as tokens unless ``tokenizer=`` says otherwise)."""
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(str(folder), "corpus.txt")
    with open(source, "w") as f:
        f.write(text)
    _launch("prepare_data").prepare([source], str(folder), say=lambda _: None, **kwargs)
    return str(folder)
