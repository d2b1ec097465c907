"""Ending a torch.distributed process without tripping over Gloo's worker threads.

Gloo's worker threads release each finished work object (and the tensors it holds) on their
own time. Releasing a tensor that Python no longer references takes the GIL; once the
interpreter has begun finalizing, taking the GIL ends the thread by force, and the C++ runtime
aborts the process: "terminate called without an active exception", exit status -6, after all
the work was done (pytorch/pytorch#179291; here 8 of 110 two-rank DDP test runs). The
"reduction" backend hands its other collectives to Gloo, so its users can meet it too.

A program whose work is finished and whose process groups are destroyed can skip finalization:
`exit_without_finalizing(status)` flushes stdout and stderr and leaves with `os._exit`.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_without_finalizing"]


def exit_without_finalizing(status: int = 0) -> NoReturn:
    """Flush stdout and stderr, then end the process with `status` at once: no atexit handlers,
    no finalization (call it after `destroy_process_group`, with every file closed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
