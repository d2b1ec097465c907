"""Errors, split by whose fault they are.

The peer's fault (a malformed or stale datagram, a wrong cookie) is never raised out of the data
plane: it is counted under a `Drop` reason and the datagram is dropped. What *is* raised derives
from `ReductionError`: our own misuse (bad configuration, a job that does not fit) or a
collective the caller must hear about (a deadline passed).
"""

from __future__ import annotations

__all__ = ["AdmissionError", "AllreduceTimeout", "ConfigError", "JobAborted", "ReductionError"]


class ReductionError(Exception):
    """Base of every error this project raises."""


class ConfigError(ReductionError):
    """A configuration value is unusable; the message names the key and why. Fix the config."""


class AdmissionError(ReductionError):
    """A job does not fit the appliance (slot memory, cores); the message says which budget."""


class AllreduceTimeout(ReductionError):
    """An allreduce missed its deadline. The message names the appliance endpoints that did not
    answer and, when the appliance told us, the ranks it was still waiting for. The job's other
    workers are usually the cause (crashed, stalled, or partitioned); retrying is safe."""


class JobAborted(ReductionError):
    """The appliance removed the job (an operator's abort, idle eviction, or its shutdown) and
    said so. Register the job again to continue."""
