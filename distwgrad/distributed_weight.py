"""TransformerEngine's module name for the DistributedWeight protocol and its dispatchers.

Tests and code written against TE's ``distributed_weight`` module run against distwgrad by swapping the
import; the implementation and the written contract live in ``distwgrad/protocol.py``
(``docs/protocol.md``).
"""

from distwgrad.protocol import (
    DistributedWeight,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
    weight_grad_buffers,
    weight_grad_dtype,
)

__all__ = ["DistributedWeight", "is_distributed_weight", "materialize_weight_for_forward",
           "materialize_weight_for_backward", "finalize_weight_grads", "weight_grad_buffers", "weight_grad_dtype"]
