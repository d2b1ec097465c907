"""Train a small classifier with DistributedDataParallel, its gradients averaged one of three ways.

    python examples/train_ddp.py --comm reduction --rank 0 --world 4 \\
        --init-method tcp://198.18.0.101:29500 --appliance 198.18.0.1:7070 \\
        --local-address 198.18.0.101 --steps 300 --json

``--comm`` picks how DDP's gradient buckets are averaged:

``gloo``
    plain ``init_process_group("gloo")``: Gloo's ring allreduce, the baseline.
``reduction``
    ``init_process_group("reduction")`` (registered by ``import plugin.torch_backend``): every
    allreduce (DDP's buckets, barriers) goes through the appliance, the rest through Gloo.
``hook``
    Gloo stays the default backend; ``DDP.register_comm_hook`` sends only the gradient buckets
    through the appliance (`plugin.torch_hook`).

``--compress bf16`` (or ``fp16``) sends the buckets in that dtype, half the bytes: through
``compressed_allreduce_hook`` on ``gloo`` and ``reduction`` (torch's ``fp16_compress_hook`` for
any 16-bit dtype: its ``bf16_compress_hook`` refuses all but NCCL; on ``reduction`` the appliance
averages in fp32), and the appliance hook's ``compress=`` on ``hook``.

The task is deterministic: a fixed random "teacher" MLP labels Gaussian inputs, each rank trains
on its own shard (seeded by --seed and its rank), and a held-out set, the same on every rank,
measures the result. Parameters are identical on every rank after each step, so the held-out
loss and the parameters' sha256 are too: both are printed with ``--json``, together with the
training loss curve and step times (median and mean over the steps after --warmup).

Rank, world size and rendezvous default to torchrun's variables (RANK, WORLD_SIZE, and
MASTER_ADDR/MASTER_PORT through ``env://``), so ``torchrun --nproc-per-node 4
examples/train_ddp.py ...`` works on one host too. See examples/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import json
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # `python examples/train_ddp.py` from a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reduction_appliance.torch  # noqa: F401 - registers the "reduction" backend
from reduction_appliance.plugin.torch_exit import exit_without_finalizing
from reduction_appliance.plugin.torch_hook import (
    ApplianceHookState,
    appliance_allreduce_hook,
    compressed_allreduce_hook,
)

__all__ = ["build_model", "main"]

COMMS = ("gloo", "reduction", "hook")
COMPRESSED: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}
CLASSES = 10
_TEACHER_HIDDEN = 64
_EVAL_SAMPLES = 2048
# Seed offsets: the teacher, the held-out set and each rank's shard draw from separate streams.
_EVAL_STREAM = 1_000_003
_SHARD_STREAM = 7_919
_SIOCGIFADDR = 0x8915  # linux/sockios.h


def build_model(inputs: int, hidden: int, layers: int) -> nn.Sequential:
    """An MLP classifier: `layers` hidden layers of `hidden` units. With the defaults its
    gradient is 3.3 MiB in 4 DDP buckets of 1 MiB, so that communication shows in the step time.

    Tanh, not ReLU: runs that differ only in the order fp32 gradients were summed (a ring
    against the appliance) then stay within a few ulps of each other, so they can be compared
    closely. A ReLU's kinks amplify such differences: one flipped activation and the runs part.
    """
    mods: list[nn.Module] = []
    width = inputs
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    mods.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*mods)


@dataclass(frozen=True)
class Task:
    """Labelled data from a fixed teacher: a learnable, seeded, infinite supply."""

    teacher: nn.Sequential
    inputs: int

    @classmethod
    def make(cls, seed: int, inputs: int) -> Task:
        gen = torch.Generator().manual_seed(seed)
        teacher = nn.Sequential(nn.Linear(inputs, _TEACHER_HIDDEN), nn.Tanh(),
                                nn.Linear(_TEACHER_HIDDEN, CLASSES))
        with torch.no_grad():
            for p in teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        return cls(teacher, inputs)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.inputs, generator=gen)
        with torch.no_grad():
            y = self.teacher(x).argmax(dim=1)
        return x, y


def batches(task: Task, shard: int, batch: int, gen: torch.Generator
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Epochs over this rank's fixed shard of `shard` samples, reshuffled each epoch."""
    x, y = task.sample(shard, gen)
    while True:
        order = torch.randperm(shard, generator=gen)
        for start in range(0, shard - batch + 1, batch):
            idx = order[start:start + batch]
            yield x[idx], y[idx]


def params_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 `address`, or None: Gloo must bind to the data network's
    interface (GLOO_SOCKET_IFNAME), and in a network namespace the hostname may resolve to an
    address the peers cannot reach."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comm", choices=COMMS, default="gloo")
    p.add_argument("--compress", choices=tuple(COMPRESSED), default="none",
                   help="the dtype buckets travel in (none: fp32)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step times")
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--inputs", type=int, default=128, help="input features")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="hidden layers")
    p.add_argument("--shard", type=int, default=8192, help="training samples per rank")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket_cap_mb")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--device", default="cpu",
                   help="where the model and its gradients live: cpu, cuda (the GPU numbered "
                        "LOCAL_RANK, else the rank, modulo the GPUs) or cuda:N; the appliance "
                        "stages CUDA buckets through pinned host memory")
    p.add_argument("--log-every", type=int, default=10, help="loss curve: every N steps")
    p.add_argument("--rank", type=int, default=_env_int("RANK"))
    p.add_argument("--world", type=int, default=_env_int("WORLD_SIZE"))
    p.add_argument("--init-method", default=None,
                   help="c10d rendezvous, e.g. tcp://HOST:PORT (default: env:// when "
                        "MASTER_ADDR is set)")
    p.add_argument("--appliance", default=None,
                   help="appliance API host:port[,...] (sets REDUCTION_APPLIANCE)")
    p.add_argument("--local-address", default=None,
                   help="this worker's data address (sets REDUCTION_LOCAL_ADDRESS, and picks "
                        "Gloo's interface unless --ifname or GLOO_SOCKET_IFNAME says)")
    p.add_argument("--ifname", default=None, help="Gloo's interface (sets GLOO_SOCKET_IFNAME)")
    p.add_argument("--lanes", type=int, default=None,
                   help="appliance rounds on the wire at once (sets REDUCTION_LANES)")
    p.add_argument("--deterministic", action="store_true",
                   help="appliance sums in rank order (sets REDUCTION_DETERMINISTIC=1)")
    p.add_argument("--transport", choices=("udp", "roce", "auto"), default=None,
                   help="appliance transport (sets REDUCTION_TRANSPORT; see docs/roce.md)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    p.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = p.parse_args(argv)
    if args.init_method is None and os.environ.get("MASTER_ADDR"):
        args.init_method = "env://"
    missing = [flag for flag, value in (("--rank", args.rank), ("--world", args.world),
                                        ("--init-method", args.init_method)) if value is None]
    if missing:
        p.error(f"{', '.join(missing)} not given and not in the environment "
                "(RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT)")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        p.error(f"--device {args.device!r}: {exc}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device!r}: cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no GPU (torch {torch.__version__}, "
                "torch.cuda.is_available() is False)")
    return args


def pick_device(name: str, rank: int) -> torch.device:
    """The device `--device` names; bare "cuda" is this rank's GPU, as torchrun numbers them."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        local = _env_int("LOCAL_RANK")
        device = torch.device("cuda", (rank if local is None else local)
                              % torch.cuda.device_count())
    return device


def configure(args: argparse.Namespace) -> None:
    """Turn the flags into what the plugin and Gloo read: environment variables."""
    if args.appliance:
        os.environ["REDUCTION_APPLIANCE"] = args.appliance
    if args.local_address:
        os.environ["REDUCTION_LOCAL_ADDRESS"] = args.local_address
    if args.lanes is not None:
        os.environ["REDUCTION_LANES"] = str(args.lanes)
    if args.deterministic:
        os.environ["REDUCTION_DETERMINISTIC"] = "1"
    if args.transport:
        os.environ["REDUCTION_TRANSPORT"] = args.transport
    ifname = args.ifname
    if ifname is None and args.local_address and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = interface_of(args.local_address)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if args.comm != "gloo" and not os.environ.get("REDUCTION_APPLIANCE"):
        raise SystemExit(f"--comm {args.comm} needs --appliance (or REDUCTION_APPLIANCE)")


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    device = pick_device(args.device, args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(args.inputs, args.hidden, args.layers).to(device)
    task = Task.make(args.seed, args.inputs)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_mb)
    state = None
    compress = COMPRESSED[args.compress]
    if args.comm == "hook":
        state = ApplianceHookState(compress=compress)
        ddp.register_comm_hook(state, appliance_allreduce_hook)
    elif compress is not None:  # on whichever backend the default group runs
        ddp.register_comm_hook(compress, compressed_allreduce_hook)
    try:
        return _loop(args, model, ddp, task, device)
    finally:
        if state is not None:
            state.close()


def _loop(args: argparse.Namespace, model: nn.Module, ddp: DistributedDataParallel,
          task: Task, device: torch.device) -> dict[str, Any]:
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data = batches(task, args.shard, args.batch,
                   torch.Generator().manual_seed(args.seed * _SHARD_STREAM + args.rank + 1))
    curve: list[tuple[int, float]] = []
    times: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = next(data)  # drawn on the CPU: the same samples whatever the device
        x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # returns once every bucket is averaged
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's time, not its queueing
        elapsed = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(elapsed)
        if step % args.log_every == 0 or step == args.steps - 1:
            curve.append((step, float(loss.detach())))
    elapsed_s = time.perf_counter() - start
    eval_x, eval_y = task.sample(_EVAL_SAMPLES,
                                 torch.Generator().manual_seed(args.seed + _EVAL_STREAM))
    eval_x, eval_y = eval_x.to(device), eval_y.to(device)
    with torch.no_grad():
        logits = model(eval_x)
        eval_loss = float(loss_fn(logits, eval_y))
        eval_acc = float((logits.argmax(dim=1) == eval_y).float().mean())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "comm": args.comm, "compress": args.compress, "device": str(device), "rank": args.rank,
        "world": args.world,
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "params": sum(
            p.numel() for p in model.parameters()), "grad_bytes": grad_bytes,
        "bucket_bytes": _bucket_bytes(ddp), "first_loss": curve[0][1], "final_loss": curve[-1][1],
        "eval_loss": eval_loss, "eval_accuracy": eval_acc, "loss_curve": curve,
        "params_sha256": params_sha256(model),
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "step_ms": [round(t * 1e3, 3) for t in times], "elapsed_s": elapsed_s,
    }


def _bucket_bytes(ddp: DistributedDataParallel) -> list[int]:
    """The sizes of DDP's gradient buckets. DDP starts with one bucket and cuts it to
    bucket_cap_mb in the order gradients became ready in the first backward pass."""
    data = ddp._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure(args)
    torch.set_num_threads(args.threads)
    backend = "reduction" if args.comm == "reduction" else "gloo"
    dist.init_process_group(backend, init_method=args.init_method, rank=args.rank,
                            world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        result = train(args)
    finally:
        dist.destroy_process_group()
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        r = result
        print(f"rank {args.rank}/{args.world} {args.comm}: loss {r['first_loss']:.4f} -> "
              f"{r['final_loss']:.4f}, held-out loss {r['eval_loss']:.4f} accuracy "
              f"{r['eval_accuracy']:.3f}; step {r['step_ms_median']:.1f} ms median; gradient "
              f"{r['grad_bytes'] / 2**20:.1f} MiB in {len(r['bucket_bytes'])} buckets; "
              f"params sha256 {r['params_sha256'][:16]}")
    return 0


if __name__ == "__main__":
    # Gloo's threads may abort an interpreter that finalizes: see plugin.torch_exit.
    exit_without_finalizing(main())
