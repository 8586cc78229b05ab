"""The interpreter cases' fork server ([Note: interpreter fork server] in ``interpreter.py``).

Reads one JSON request per line on stdin and answers on stdout ``{"pid": ...}`` once the case's child is forked,
``{"rc": ...}`` when it exits (its exit code, or minus the signal). The child runs the script as ``__main__`` with
the request's argv, environment, working directory, import path and output files. Exits at EOF.
"""

from __future__ import annotations

import dataclasses
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
    _skip_discarded_overflow_checks()
    _reduce_nan_max_in_numpy()
    _list_builtins_once()
    _patch_helpers_once_per_launch()
    import distwgrad
    for info in pkgutil.walk_packages(distwgrad.__path__, "distwgrad."):
        if ".launch" in info.name:  # entry points, not what a kernel case imports
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a case that needs the module reports the error itself
            pass


def _skip_discarded_overflow_checks() -> None:
    """Skips the interpreter's discarded integer overflow checks.

    [Note: interpreter overflow checks]
    Triton wraps every integer add, sub and mul in an overflow check (``sanitize_overflow``) that
    ``device_assert`` drops unless ``debug`` is set, which it never is in the interpreter; yet the interpreter
    computes each check in numpy, about a quarter of an FP8 grouped-GEMM case. Turning the option off where
    ``debug`` is off checks nothing less; ``tests/test_interpreter_server.py`` holds Triton to that premise."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if (dataclasses.is_dataclass(options) and not isinstance(options, type)
            and getattr(options, "sanitize_overflow", False) and not getattr(options, "debug", True)):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _reduce_nan_max_in_numpy() -> None:
    """Reduces ``_max_nan`` in numpy.

    [Note: interpreter NaN-max reductions]
    The interpreter runs a ``tl.reduce`` with a custom combine function, such as the quantizers' NaN-propagating
    ``_max_nan``, element by element in Python: most of a quantize case's time. ``numpy.max`` propagates NaN the
    same way and a max is order-independent, except for -0.0 next to +0.0: such inputs keep the generic path.
    ``tests/test_interpreter_server.py`` checks the bits, NaN, infinities and signed zeros included."""
    import numpy as np
    from triton.runtime import interpreter

    from distwgrad.kernels import _quantize_kernels

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    if reduce_ops is None or not hasattr(reduce_ops, "min_max") or hasattr(reduce_ops, "_distwgrad_generic"):
        return
    generic = reduce_ops.apply_impl
    max_nan = _quantize_kernels._max_nan

    def apply_impl(self, input):
        if self.combine_fn is max_nan and len(input) == 1:
            data = input[0].handle.data
            if not bool(np.any((data == 0) & np.signbit(data))):
                return self.min_max(input[0], val_reduce_op=np.max)
        return reduce_ops._distwgrad_generic(self, input)  # looked up per call: the test counts them

    reduce_ops._distwgrad_generic = generic
    reduce_ops.apply_impl = apply_impl


def _list_builtins_once() -> None:
    """Lists the language's builtins once, at start-up, for the interpreter's patch of them.

    [Note: interpreter builtin lists]
    The interpreter patches each builtin of ``tl``, ``tl.core``, ``tl.tensor``, ``tl.math`` and the tensor
    descriptor (``_patch_builtin``) at every launch and at every call of a ``@triton.jit`` helper (``tl.zeros``,
    ``tl.sum`` and the kernels' own), in every program and loop iteration, and finds them by listing and sorting
    every member (``inspect.getmembers``): about a third of an FP8 grouped-GEMM case. Builtins are defined at
    import, and a patch replaces them under the same names; so the names are listed here, before anything is
    patched, and each patch checks only those, in the same order, patching those still builtin, as Triton
    does. Any other object gets Triton's own listing. ``tests/test_interpreter_server.py`` checks that both
    patch the same names, before, during and after a launch's patch."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if patch_builtin is None or patch_attr is None or hasattr(interpreter, "_distwgrad_patch_builtin"):
        return
    holders = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    names = {id(h): (h, [n for n, m in inspect.getmembers(h) if tl.core.is_builtin(m)]) for h in holders}

    def _patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None or listed[0] is not pkg:
            return patch_builtin(pkg, builder, scope)
        for name in listed[1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._distwgrad_patch_builtin = patch_builtin  # Triton's, for the test
    interpreter._patch_builtin = _patch_builtin


def _patch_helpers_once_per_launch() -> None:
    """Skips a helper call's language patch where an earlier patch of the same launch did all it would do.

    [Note: interpreter helper patches]
    Each call of a ``@triton.jit`` helper inside a kernel patches the language again (``_patch_lang``: the
    builtins of the modules the helper's globals name, ``tl`` or ``tl.core``, and a few attributes of theirs)
    and never restores that patch; only the launch's own patch is restored, when the grid is done. Once a
    patch of the launch has covered a module, a later helper patch of it wraps no builtin (none is left) and
    sets the same attributes to the same code, in every program and loop iteration: a quarter to a third of a
    grouped-GEMM case after [Note: interpreter builtin lists]. So inside a launch a helper's patch runs only
    where it names a module that no patch of this launch has covered yet; outside a launch Triton's always
    runs. ``tests/test_interpreter_server.py`` holds Triton to that premise on a kernel run."""
    import triton.language as tl
    from triton.runtime import interpreter

    if (not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor"))
            or hasattr(interpreter, "_distwgrad_patch_lang")):
        return
    launch = interpreter.GridExecutor.__call__
    launches: list[tuple] = []  # per running launch: (its kernel, the ids of the modules its patches covered)

    def _patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if launches and fn is not launches[-1][0] and langs and langs <= launches[-1][1]:
            return interpreter._LangPatchScope()  # nothing set, nothing to restore
        scope = interpreter._distwgrad_patch_lang(fn)  # Triton's, looked up per call: the test records it
        if launches:
            launches[-1][1].update(langs)
        return scope

    def __call__(self, *args, **kwargs):
        launches.append((self.fn, set()))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._distwgrad_patch_lang = interpreter._patch_lang
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__


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
