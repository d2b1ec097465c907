"""Ranks of examples/train_ddp.py for tests/roce/test_torch.py, each trained twice in one process
(over UDP, then over RoCE; each run prints its JSON line), forked from a zygote that has already
paid torch's start-up.

In the emulated guest `import torch` takes about 90 s, and a process's first
`DistributedDataParallel` about 110 s more: its constructor imports torch._dynamo, and with it
sympy and mpmath (816 modules; 2.5 s on the host). Two ranks paying that side by side made the
test take 300 s. The zygote pays it once, started with the session (tests/roce/conftest.py) at a
low priority, so that it mostly takes the guest's idle CPU while the other tests run.

    python -m tests.roce.ddp_twice

The zygote reads one JSON line per rank on stdin, {"argv": [RANK, API, *train_ddp options],
"stdout": PATH, "stderr": PATH}, and forks that rank at once; at the end of stdin it waits for
every rank and prints their exit statuses, in the order asked, as one JSON list.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import IO

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
# Below the tests' own processes: the zygote's imports should fill idle CPU, not delay them.
ZYGOTE_NICENESS = 19


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules["train_ddp"] = example  # its dataclasses look their module up
    spec.loader.exec_module(example)
    return example


def _rank(example: ModuleType, argv: list[str]) -> int:
    rank, api, options = int(argv[0]), argv[1], argv[2:]
    for transport, port in (("udp", 29511), ("roce", 29512)):
        example.main([*options, "--rank", str(rank), "--world", "2", "--init-method",
                      f"tcp://10.77.0.2:{port}", "--appliance", api, "--local-address",
                      f"10.77.0.{2 + rank}", "--transport", transport])
    return 0


def _fork(example: ModuleType, request: dict[str, object]) -> int:
    argv, out, err = request["argv"], request["stdout"], request["stderr"]
    assert isinstance(argv, list) and isinstance(out, str) and isinstance(err, str), request
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        with contextlib.suppress(PermissionError):  # a rank runs at the tests' priority
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        status = _rank(example, [str(a) for a in argv])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # never back into the zygote's loop; Gloo's threads: plugin.torch_exit


def zygote(requests: IO[str], report: IO[str]) -> int:
    os.nice(ZYGOTE_NICENESS)
    import torch._dynamo  # noqa: F401 - what DistributedDataParallel's constructor imports

    example = _example()
    pids = [_fork(example, json.loads(line)) for line in requests if line.strip()]
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    report.write(json.dumps(statuses) + "\n")
    return 0


class Zygote:
    """The zygote process, from the start of the session until `close`."""

    def __init__(self) -> None:
        # A session of its own: `close` kills its group, ranks that a failed test left included.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.roce.ddp_twice"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[2], start_new_session=True)

    def run(self, argvs: list[list[str]], folder: Path, timeout: float
            ) -> list[tuple[int, str, str]]:
        """Fork one rank per argv, wait for them all; (exit status, stdout, stderr) of each."""
        files = [(folder / f"ddp-{i}.out", folder / f"ddp-{i}.err") for i in range(len(argvs))]
        requests = "".join(json.dumps({"argv": argv, "stdout": str(out), "stderr": str(err)})
                           + "\n" for argv, (out, err) in zip(argvs, files, strict=True))
        # (communicate: a zygote that died on its imports is reported below, not a broken pipe)
        report, zygote_err = self._process.communicate(requests, timeout=timeout)
        if self._process.returncode != 0 or not report.strip():
            raise RuntimeError(f"the DDP zygote failed ({self._process.returncode}): "
                               f"{zygote_err[-3000:]}")
        statuses: list[int] = json.loads(report)
        return [(status, out.read_text() if out.exists() else "",
                 err.read_text(errors="replace") if err.exists() else "")
                for status, (out, err) in zip(statuses, files, strict=True)]

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.communicate()


if __name__ == "__main__":
    sys.exit(zygote(sys.stdin, sys.stdout))
