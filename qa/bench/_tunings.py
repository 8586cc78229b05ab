"""Kernel tunings on the command line: ``family.knob=value,...`` as ``distwgrad.kernels.tuning``'s arguments
(``layer_step.py --tunings``)."""

from __future__ import annotations

import ast

import distwgrad.kernels


def parse_assignments(text: str, what: str = "--a") -> dict[str, dict[str, object]]:
    """``"family.knob=value,..."`` as ``tuning``'s keyword arguments ``{family: {knob: value}}``."""
    out: dict[str, dict[str, object]] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        family, dot, knob = name.strip().partition(".")
        if not sep or not dot or not family or not knob:
            raise ValueError(f"{what}: {item!r} is not family.knob=value (e.g. quantize.per_tensor_block=8192)")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{what}: the value of {name.strip()} must be a Python literal (8192, True, None), "
                             f"got {value.strip()!r}") from None
        out.setdefault(family, {})[knob] = parsed
    distwgrad.kernels.tuning(**out)  # unknown families and knobs, and refused values, fail here
    return out


def label(text: str) -> str:
    """A tuning's name in printed tables and result rows: its assignments without spaces, or "defaults"."""
    return ",".join(t.strip().replace(" ", "") for t in text.split(",") if t.strip()) or "defaults"
