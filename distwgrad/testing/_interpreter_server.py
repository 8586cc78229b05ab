"""The interpreter cases' fork server ([Note: interpreter fork server] in ``interpreter.py``).

Started by ``run_interpreted`` with ``TRITON_INTERPRET=1``; imports torch, Triton and distwgrad, then
reads one JSON request per line on stdin and answers on stdout: ``{"pid": ...}`` once the case's child is
forked, ``{"rc": ...}`` when it has exited (its exit code, or minus the signal that ended it). The child
runs the script as ``__main__`` with the request's ``argv``, environment, working directory and import
path, its stdout and stderr in the request's files. At EOF on stdin the server exits.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import runpy
import sys
import traceback

# What a case would import first in a fresh interpreter, the seconds this server is for. Importing does not
# start threads, so forking after it is safe.
_PRELOAD = ("numpy", "torch", "torch.nn.functional", "triton", "triton.language", "pytest", "distwgrad",
            "distwgrad.testing")


def _preload() -> None:
    for name in _PRELOAD:
        importlib.import_module(name)
    import distwgrad
    for info in pkgutil.walk_packages(distwgrad.__path__, "distwgrad."):
        if ".launch" in info.name:  # entry points, not what a kernel case imports
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a case that needs the module reports the error itself
            pass


def _run_case(request: dict) -> None:
    """In the forked child: the case, then ``os._exit`` with its exit code (never returns)."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[:] = [os.path.dirname(script), *request["path"]]  # as ``python script`` would
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:  # what the interpreter does with sys.exit(x)
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # no interpreter teardown: the server's state is not the child's to clean up


def main() -> None:
    _preload()
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        replies.flush()
        pid = os.fork()
        if pid == 0:
            _run_case(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
