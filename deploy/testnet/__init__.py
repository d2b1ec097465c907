"""An emulated rack on Linux network namespaces, for integration tests, the demo and benchmarks.

A :class:`Topology` is plain data; a :class:`Lab` builds it (pyroute2) inside a context manager
and always tears it down again.
"""

from reduction_appliance.deploy.testnet.lab import Lab, LabError, clean, leftovers, teardown
from reduction_appliance.deploy.testnet.topology import (
    DEFAULT_PREFIX_ROOT,
    Host,
    Link,
    Topology,
    unique_prefix,
)

__all__ = [
    "DEFAULT_PREFIX_ROOT",
    "Host",
    "Lab",
    "LabError",
    "Link",
    "Topology",
    "clean",
    "leftovers",
    "teardown",
    "unique_prefix",
]
