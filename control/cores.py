"""A data-plane core as the supervisor (control.supervisor) holds it: its process, mailbox and
counters, and the state machine of its life.

A core's states and what moves them (`CORE_TRANSITIONS`; anything else raises)::

    STARTING   --ready------>  RUNNING
    RUNNING    --died------->  RESTARTING
    RESTARTING --ready------>  RUNNING
    RESTARTING --failed----->  RESTARTING   (the next attempt waits longer)
    any        --stop------->  STOPPED
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.shared_memory import SharedMemory

from reduction_appliance.dataplane.counters import Counters
from reduction_appliance.dataplane.errors import Unavailable
from reduction_appliance.dataplane.spec import CoreConfig, CoreState

__all__ = ["CORE_TRANSITIONS", "CoreEvent", "CoreHandle", "CoreUnavailable", "Disruption"]


class CoreEvent(Enum):
    READY = "ready"
    DIED = "died"
    FAILED = "failed"
    STOP = "stop"


CORE_TRANSITIONS: dict[tuple[CoreState, CoreEvent], CoreState] = {
    (CoreState.STARTING, CoreEvent.READY): CoreState.RUNNING,
    (CoreState.RUNNING, CoreEvent.DIED): CoreState.RESTARTING,
    (CoreState.RESTARTING, CoreEvent.READY): CoreState.RUNNING,
    (CoreState.RESTARTING, CoreEvent.FAILED): CoreState.RESTARTING,
    **{(state, CoreEvent.STOP): CoreState.STOPPED for state in CoreState},
}


class CoreUnavailable(Unavailable):
    """A data-plane core is not running right now (restarting after a crash). Retry shortly."""


@dataclass
class CoreHandle:
    config: CoreConfig
    memory: SharedMemory
    counters: Counters
    lock: threading.Lock = field(default_factory=threading.Lock)
    process: BaseProcess | None = None
    mailbox: Connection | None = None
    state: CoreState = CoreState.STARTING
    restarts: int = 0
    started_at: float = 0.0
    last_exit: str = ""
    stalled: str = ""  # why the supervisor killed it, until the monitor has seen it die
    kernels: str = ""  # the reduce-kernel backend the core chose

    def move(self, event: CoreEvent) -> None:
        target = CORE_TRANSITIONS.get((self.state, event))
        if target is None:
            raise AssertionError(f"core {self.config.index} is {self.state.value}: "
                                 f"{event.value} is not a transition")
        self.state = target


@dataclass(frozen=True)
class Disruption:
    core: int
    at: float  # time.time()
    why: str
