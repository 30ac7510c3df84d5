"""Errors of the cluster pieces (bus, directory, the cross-replica job path)."""

from __future__ import annotations


class ClusterError(Exception):
    """Base class of the cluster's errors."""


class BusUnavailable(ClusterError):
    """The bus could not be reached (Redis down, or the bus closed)."""


class ReplicaUnavailable(ClusterError):
    """No replica listens on the channel a job was sent to: it is gone, or not started yet.
    Nothing was sent to any worker, so the job may go elsewhere at once."""
