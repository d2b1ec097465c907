"""One rank of examples/train_ddp.py trained twice in one process (torch is imported once: tens
of seconds in the emulated guest), over UDP then over RoCE; each run prints its JSON line.

    python -m tests.roce.ddp_twice RANK API ARGS...     (ARGS: train_ddp's options)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def main() -> int:
    rank, api, options = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = example  # its dataclasses look their module up
    spec.loader.exec_module(example)
    for transport, port in (("udp", 29511), ("roce", 29512)):
        example.main([*options, "--rank", str(rank), "--world", "2", "--init-method",
                      f"tcp://10.77.0.2:{port}", "--appliance", api, "--local-address",
                      f"10.77.0.{2 + rank}", "--transport", transport])
    return 0


if __name__ == "__main__":
    from reduction_appliance.plugin.torch_exit import exit_without_finalizing

    exit_without_finalizing(main())
