"""Standing labs: emulated racks that outlive the command that built them (`reductionctl lab`).

A standing lab is built by the same :class:`~deploy.testnet.lab.Lab` as a test's, then detached.
A small JSON record under ``/run/reduction-appliance/labs/NAME.json`` (tmpfs: gone at reboot,
like the namespaces themselves) remembers its topology, so that ``down`` rebuilds the same
:class:`Topology` and removes exactly its namespaces with the same teardown a Lab's exit runs.
Exact names, not a prefix match: lab ``ab`` must never take lab ``abc`` down with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import netns

from reduction_appliance.deploy.testnet.lab import Lab, LabError, remove_namespaces, teardown
from reduction_appliance.deploy.testnet.topology import (
    DEFAULT_PREFIX_ROOT,
    PREFIX_PID_DIGITS,
    Topology,
)

__all__ = ["STATE_DIR", "LabRecord", "down", "list_labs", "orphaned_labs", "up"]

STATE_DIR = Path("/run/reduction-appliance/labs")


@dataclass(frozen=True)
class LabRecord:
    """What a standing lab is: enough to rebuild its Topology, plus when it was made."""

    name: str
    workers: int
    appliances: int
    rate: str | None
    loss_pct: float
    mtu: int
    created: str

    @property
    def topology(self) -> Topology:
        return Topology.rack(self.workers, self.appliances, rate=self.rate,
                             loss_pct=self.loss_pct, mtu=self.mtu, prefix=self.name)

    def namespaces(self) -> list[str]:
        topo = self.topology
        return [topo.switch_netns, *(topo.netns_name(h.name) for h in topo.hosts)]

    def state(self) -> str:
        """up (every namespace there), partial, or gone (e.g. after a reboot or a manual clean)."""
        existing = set(netns.listnetns())
        present = sum(name in existing for name in self.namespaces())
        return "up" if present == len(self.namespaces()) else "partial" if present else "gone"

    def describe(self) -> dict[str, Any]:
        """The record plus every host's address, namespace and interface (lab up/list --json)."""
        topo = self.topology
        hosts = [{"name": h.name, "role": "appliance" if h in topo.appliances else "worker",
                  "address": h.address, "netns": topo.netns_name(h.name),
                  "ifname": topo.host_ifname(h.name)} for h in topo.hosts]
        return {"name": self.name, "workers": self.workers, "appliances": self.appliances,
                "rate": self.rate, "loss_pct": self.loss_pct, "mtu": self.mtu,
                "created": self.created, "subnet": topo.subnet, "switch_netns": topo.switch_netns,
                "hosts": hosts, "state": self.state()}

    @classmethod
    def load(cls, path: Path) -> LabRecord:
        data = json.loads(path.read_text())
        return cls(name=data["name"], workers=data["workers"], appliances=data["appliances"],
                   rate=data["rate"], loss_pct=data["loss_pct"], mtu=data["mtu"],
                   created=data["created"])


def _path(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.json"


def up(topology: Topology, state_dir: Path = STATE_DIR) -> LabRecord:
    """Build `topology` and leave it running; refuse a name that is taken."""
    topo = topology
    record = LabRecord(
        name=topo.name_prefix, workers=len(topo.workers), appliances=len(topo.appliances),
        rate=topo.worker_link.rate, loss_pct=topo.worker_link.loss_pct, mtu=topo.worker_link.mtu,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    path = _path(state_dir, record.name)
    taken = set(netns.listnetns()) & set(record.namespaces())
    if path.exists() or taken:
        raise LabError(f"a lab named {record.name!r} exists ({', '.join(sorted(taken)) or path});"
                       f" take it down first or pick another --name")
    state_dir.mkdir(parents=True, exist_ok=True)
    with Lab(topology) as lab:
        # Record first, detach last: if the record cannot be written, the with block still
        # tears the rack down, so there is never a standing lab nobody knows about.
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record.describe() | {"state": None}, indent=2) + "\n")
        os.replace(tmp, path)
        lab.detach()
    return record


def down(name: str, state_dir: Path = STATE_DIR) -> list[str]:
    """Tear a standing lab down, or what a killed run left (`orphaned_labs`); returns the
    namespaces removed."""
    path = _path(state_dir, name)
    if not path.exists():
        orphans = orphaned_labs(state_dir)
        if name in orphans:  # exactly its namespaces: never another lab's that shares a prefix
            return remove_namespaces(orphans[name])
        raise LabError(f"no standing lab named {name!r} (see `reductionctl lab list`)")
    removed = teardown(LabRecord.load(path).topology)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return removed


def list_labs(state_dir: Path = STATE_DIR) -> list[LabRecord]:
    if not state_dir.is_dir():
        return []
    records = []
    for path in sorted(state_dir.glob("*.json")):
        try:
            records.append(LabRecord.load(path))
        except (OSError, ValueError, KeyError) as exc:
            raise LabError(f"unreadable lab record {path}: {exc}") from exc
    return records


# A run's own rack: DEFAULT_PREFIX_ROOT, its maker's pid (topology.unique_prefix), 2 more.
_RUN_PREFIX = re.compile(rf"^({DEFAULT_PREFIX_ROOT}[0-9a-z]{{{PREFIX_PID_DIGITS + 2}}})-")


def orphaned_labs(state_dir: Path = STATE_DIR) -> dict[str, list[str]]:
    """Racks that runs built for themselves and could not tear down (killed outright: SIGKILL,
    the OOM killer), by prefix, with their namespaces: named as a run names its rack, no
    standing lab's, and no process left whose pid the name carries. (Only a pid's last digits
    fit the name: a process that shares them keeps its namespaces listed as its own.)"""
    standing = {record.name for record in list_labs(state_dir)}
    found: dict[str, list[str]] = {}
    for name in netns.listnetns():
        match = _RUN_PREFIX.match(name)
        if match and match.group(1) not in standing:
            found.setdefault(match.group(1), []).append(name)
    modulus = 36**PREFIX_PID_DIGITS
    living = {int(pid) % modulus for pid in os.listdir("/proc") if pid.isdigit()}
    start = len(DEFAULT_PREFIX_ROOT)
    return {prefix: sorted(names) for prefix, names in found.items()
            if int(prefix[start:start + PREFIX_PID_DIGITS], 36) not in living}
