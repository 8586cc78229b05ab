"""Running a test script under Triton's interpreter in a child process.

Triton reads ``TRITON_INTERPRET`` when it is imported, so a test process that has imported it cannot
switch to the interpreter: the CPU tests of a kernel re-run their own file as a child with it set (and,
with ``kernels_on_cpu``, ``DISTWGRAD_KERNELS_ON_CPU=1``: the modules route CPU tensors through the
kernels, [Note: fp8 gemm dispatch]).

[Note: interpreter fork server]
A fresh interpreter spends seconds importing torch and Triton before a
case starts, and the CPU suite runs dozens of cases. So each test process starts one server
(``distwgrad.testing._interpreter_server``) with ``TRITON_INTERPRET=1`` that imports torch, Triton and
distwgrad once, and forks a child per case: the child is still a process of its own (whatever a case
patches or leaks ends with it), runs the script as ``__main__`` with the caller's environment, working
directory and import path, and its output and exit status come back as a subprocess's would. Where there
is no ``os.fork``, each case is a plain subprocess.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["run_interpreted"]

_lock = threading.Lock()  # one case at a time per server
_server: subprocess.Popen | None = None
_server_log: str | None = None


def run_interpreted(script: str, *args: object, kernels_on_cpu: bool = False, timeout: float = 600,
                    cwd: str | None = None) -> str:
    """``python script *args`` under ``TRITON_INTERPRET=1`` with this process's import path; its stdout.
    Raises AssertionError, with the child's output, if it exits non-zero or runs past ``timeout`` seconds."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if kernels_on_cpu:
        env["DISTWGRAD_KERNELS_ON_CPU"] = "1"
    what = f"{os.path.basename(script)} {list(args)}"
    argv = [str(a) for a in args]
    if hasattr(os, "fork"):
        rc, out, err = _run_forked(os.path.abspath(script), argv, env, cwd or os.getcwd(), timeout)
    else:
        try:
            proc = subprocess.run([sys.executable, script, *argv], env=env, cwd=cwd, capture_output=True,
                                  text=True, timeout=timeout)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, _text(exc.stdout), _text(exc.stderr)
    if rc is None:
        raise AssertionError(f"{what} timed out after {timeout} s:\n{out}\n{err[-6000:]}")
    assert rc == 0, f"{what} failed (exit code {rc}):\n{out}\n{err[-6000:]}"
    return out


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _run_forked(script: str, argv: list[str], env: dict, cwd: str, timeout: float):
    """(exit code or None on timeout, stdout, stderr) of the case, run by a child of the server."""
    with _lock, tempfile.TemporaryDirectory(prefix="distwgrad-interp-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(script=script, argv=argv, env=env, cwd=cwd, path=list(sys.path), stdout=out_path,
                       stderr=err_path)
        server = _ensure_server()
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = _read_reply(server, time.monotonic() + 60)
        if reply is None or "pid" not in reply:
            return 1, "", _server_died(reply)
        pid, deadline, rc = reply["pid"], time.monotonic() + timeout, None
        reply = _read_reply(server, deadline)
        if reply is None and server.poll() is None:  # the case ran past its timeout: kill it, then collect
            os.kill(pid, signal.SIGKILL)
            reply = _read_reply(server, time.monotonic() + 30)
            if reply is None:
                return 1, "", _server_died(None)
        elif reply is None:
            return 1, "", _server_died(None)
        else:
            rc = reply["rc"]
        return rc, _read(out_path), _read(err_path)


def _ensure_server() -> subprocess.Popen:
    global _server, _server_log
    if _server is not None and _server.poll() is None:
        return _server
    fd, _server_log = tempfile.mkstemp(prefix="distwgrad-interp-server-", suffix=".log")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    _server = subprocess.Popen([sys.executable, "-m", "distwgrad.testing._interpreter_server"], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, text=True, bufsize=1)
    os.close(fd)
    return _server


def _read_reply(server: subprocess.Popen, deadline: float) -> dict | None:
    """The server's next reply line, or None at the deadline or if it exited."""
    assert server.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([server.stdout], [], [], min(left, 1.0))
        if ready:
            line = server.stdout.readline()
            return json.loads(line) if line else None
        if server.poll() is not None:
            return None


def _server_died(reply: dict | None) -> str:
    global _server
    if _server is not None and _server.poll() is None:
        _server.kill()
    _server = None  # the next case starts a new one
    return f"the interpreter server failed (reply {reply!r}); its log:\n{_read(_server_log or '')}"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@atexit.register
def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        assert _server.stdin is not None
        _server.stdin.close()  # the server's loop ends at EOF
        try:
            _server.wait(10)
        except subprocess.TimeoutExpired:
            _server.kill()
    if _server_log:
        try:
            os.unlink(_server_log)
        except OSError:
            pass
