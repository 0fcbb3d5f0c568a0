"""Parallel layers built from fpar.shard-level pieces (tensor, sequence and data parallel)."""
