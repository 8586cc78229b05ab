"""Distributed weights: sharded (dim-0 shards, all-gather / reduce-scatter) and replicated (all-reduce), each with
its lifecycle ([Note: weight lifecycle] in ``weights/lifecycle.py``)."""

from distwgrad.weights.base import DistributedParameter, MissingContributionError, ReducePolicy, compute_dtype
from distwgrad.weights.lifecycle import UnfinalizedStepError, WeightState
from distwgrad.weights.replicated import ReplicatedWeight
from distwgrad.weights.sharded import ShardedWeight, shard_rows

__all__ = ["DistributedParameter", "MissingContributionError", "ReducePolicy", "ReplicatedWeight",
           "ShardedWeight", "UnfinalizedStepError", "WeightState", "compute_dtype", "shard_rows"]
