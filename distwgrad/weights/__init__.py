"""Distributed weights: sharded (dim-0 shards, all-gather / reduce-scatter) and replicated (all-reduce)."""

from distwgrad.weights.base import DistributedParameter, MissingContributionError, ReducePolicy, compute_dtype
from distwgrad.weights.replicated import ReplicatedWeight
from distwgrad.weights.sharded import ShardedWeight, shard_rows

__all__ = ["DistributedParameter", "MissingContributionError", "ReducePolicy", "ReplicatedWeight",
           "ShardedWeight", "compute_dtype", "shard_rows"]
