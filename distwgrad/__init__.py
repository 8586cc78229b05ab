"""distwgrad: distributed weights whose weight gradients may be deferred.

Every gradient contribution, from every tied use, every microbatch and every deferred wgrad, lands
exactly once, in fp32, in the right shard. See ``docs/architecture.md`` for the map.
"""

from distwgrad.graphs import make_graphed_callables
from distwgrad.protocol import (
    DistributedWeight,
    finalize_weight_grads,
    is_distributed_weight,
    materialize_weight_for_backward,
    materialize_weight_for_forward,
)
from distwgrad.weights import (
    DistributedParameter,
    MissingContributionError,
    ReducePolicy,
    ReplicatedWeight,
    ShardedWeight,
    UnfinalizedStepError,
    WeightState,
    compute_dtype,
)
from distwgrad.weights.units import Units, coalesce
from distwgrad.wgrad import (
    DeferredWgradError,
    deferred_wgrad_scope,
    drain_deferred_wgrads,
    finalize_model_grads,
)

__version__ = "0.1.0"

__all__ = [
    "DistributedWeight", "is_distributed_weight", "materialize_weight_for_forward",
    "materialize_weight_for_backward", "finalize_weight_grads",
    "DistributedParameter", "ShardedWeight", "ReplicatedWeight", "ReducePolicy", "compute_dtype",
    "MissingContributionError", "UnfinalizedStepError", "WeightState", "DeferredWgradError",
    "drain_deferred_wgrads", "deferred_wgrad_scope", "finalize_model_grads", "make_graphed_callables",
    "coalesce", "Units",
]
