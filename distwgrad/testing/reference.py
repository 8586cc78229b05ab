"""The oracle that tests and benchmarks share: the production references of ``distwgrad.ops.reference``.

Production code imports ``distwgrad.ops.reference``; this module re-exports it so the oracle and the CPU
path stay one implementation, and production never imports ``distwgrad.testing``
(``tests/test_import_direction.py``).
"""

from __future__ import annotations

from distwgrad.ops.reference import group_ranges, grouped_bias_grad, grouped_dgrad, grouped_fprop, grouped_wgrad

__all__ = ["group_ranges", "grouped_fprop", "grouped_dgrad", "grouped_wgrad", "grouped_bias_grad"]
