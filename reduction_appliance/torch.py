"""``import reduction_appliance.torch`` registers the ``torch.distributed`` backend "reduction"::

    import reduction_appliance.torch  # noqa: F401
    dist.init_process_group("reduction", init_method="tcp://...", rank=r, world_size=n)

For jobs that keep another default backend, the DDP communication hook is here too::

    from reduction_appliance.torch import ApplianceHookState, appliance_allreduce_hook
    model.register_comm_hook(ApplianceHookState(), appliance_allreduce_hook)

and, on the "reduction" backend, buckets sent in 16 bits (averaged in fp32 on the appliance)::

    model.register_comm_hook(torch.bfloat16, compressed_allreduce_hook)

Configuration comes from the REDUCTION_* environment variables (see
``reduction_appliance.plugin.torch_backend``).
"""

from reduction_appliance.plugin.torch_backend import (
    BACKEND_NAME,
    ApplianceProcessGroup,
    config_from_env,
)
from reduction_appliance.plugin.torch_exit import exit_without_finalizing
from reduction_appliance.plugin.torch_hook import (
    ApplianceHookState,
    appliance_allreduce_hook,
    compressed_allreduce_hook,
)

__all__ = [
    "BACKEND_NAME",
    "ApplianceHookState",
    "ApplianceProcessGroup",
    "appliance_allreduce_hook",
    "compressed_allreduce_hook",
    "config_from_env",
    "exit_without_finalizing",
]
