"""Optimizers that know the shard layout: ``shardwise.optim.Muon`` (docs/optimizers.md)."""

from .muon import Muon

__all__ = ["Muon"]
