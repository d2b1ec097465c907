"""reduction-appliance: SHARP-style in-network reduction for distributed training.

The one import root of the product. Its subpackages are the repository's top-level folders
(this directory holds symbolic links to them, and an installed wheel holds them as real
packages), so nothing but ``reduction_appliance`` lands on ``sys.path``:

* ``reduction_appliance.torch``: ``import reduction_appliance.torch`` registers the
  ``torch.distributed`` backend ``"reduction"``; it also exports the DDP communication hook.
* ``reduction_appliance.client``: the numpy worker API (``register``, ``ApplianceClient``).
* ``reduction_appliance.dataplane`` / ``.control`` / ``.plugin`` / ``.deploy`` / ``.bench``:
  the appliance's data plane, its control plane (``reductiond``, ``reductionctl``), the worker
  side, the deployment files and emulated labs, and the shipped benchmarks
  (see docs/architecture.md).

Importing this package imports nothing else: ``reductionctl`` must not pay for numpy or torch.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
