"""A hostile or clumsy host on the emulated rack, as the integrity report tried it. Prints one
JSON line with what it did.

    sniff GROUP PORT                    wait for one multicast RESULT: learn job, cookie, core
    contribute GROUP PORT RANK COUNT    ... then send COUNT contributions as RANK with the cookie
    results GROUP PORT COUNT            ... then send COUNT forged RESULTs to the group
    far GROUP PORT RANK COUNT [SPOOF]   ... then COUNT contributions of round 2**32-1 and slot
                                        uses far ahead of any slot's (2**20 and more) or
                                        2**32-1 (before the wrap, wire.WRAP: stale); SPOOF=
                                        IP:PORT forges that source (a raw socket)
    hold API JOB SECRET WORLD SLOTS     join a deterministic job as ranks 1..WORLD-1 from one
                                        socket each and send every slot out of turn (rank 0
                                        never comes), twice: held buffers up to the job's quota
    leaked HOST PORT JOB COOKIE EPOCH RANK COUNT
                                        with a leaked cookie, send COUNT contributions as RANK
                                        to the core, then count results that reach this host

Everything a host on the bridge can learn comes from the job's multicast results (the bridge
floods multicast to every port); nothing here reads the appliance's state.
"""

from __future__ import annotations

import json
import socket
import sys

from reduction_appliance.dataplane.wire import HEADER, HEADER_SIZE, MAGIC, VERSION, Kind, unpack
from reduction_appliance.plugin.rendezvous import join, register

FAR = 2**32 - 1


def sniff(group: str, port: int) -> tuple[bytes, tuple[str, int]]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((group, port))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                    socket.inet_aton(group) + socket.inet_aton("0.0.0.0"))
    print(json.dumps({"listening": [group, port]}), flush=True)
    sock.settimeout(30)
    while True:
        data, source = sock.recvfrom(65536)
        if len(data) >= HEADER_SIZE and unpack(data).kind is Kind.RESULT:
            return data, source


def fields(datagram: bytes) -> list[int]:
    return list(HEADER.unpack_from(datagram))


def send_all(datagrams: list[bytes], dest: tuple[str, int], spoof: str | None = None) -> None:
    if spoof is None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for d in datagrams:
                sock.sendto(d, dest)
        return
    from scapy.layers.inet import IP, UDP
    from scapy.sendrecv import send

    host, port = spoof.rsplit(":", 1)
    send([IP(src=host, dst=dest[0]) / UDP(sport=int(port), dport=dest[1]) / d
          for d in datagrams], verbose=False)


def contributions(f: list[int], rank: int, count: int, rounds: list[int], uses: list[int],
                  length: int) -> list[bytes]:
    out = []
    for i in range(count):
        g = f.copy()
        g[2] = Kind.CONTRIBUTION
        g[7] = rank
        g[10] = rounds[i % len(rounds)]
        g[11] = i % 32  # slot
        g[12] = 0  # offset
        g[13] = length
        g[14] = uses[i % len(uses)]
        out.append(HEADER.pack(*g) + b"\x7f" * length)
    return out


def main(argv: list[str]) -> int:
    mode = argv[0]
    report: dict[str, object] = {"mode": mode}
    if mode == "hold":
        api, job_name, secret, world, slots = argv[1:6]
        job = register(api, job_name, int(world), secret=secret, deterministic=True)
        socks, joined = [], []
        for rank in range(1, int(world)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("0.0.0.0", 0))
            core = (job.cores[0].host, job.cores[0].port)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect(core)
                source = (probe.getsockname()[0], sock.getsockname()[1])
            joined.append(join(job, rank, source))
            socks.append(sock)
        sent = 0
        for _ in range(2):
            for rank, (sock, info) in enumerate(zip(socks, joined, strict=True), start=1):
                for core in info.cores:
                    for slot in range(int(slots)):
                        header = HEADER.pack(MAGIC, VERSION, Kind.CONTRIBUTION, 1, 1, 0,
                                             info.job_id, rank, info.epoch, info.cookie or 0,
                                             1, slot, slot * 4096, 4096, 1)
                        sock.sendto(header + bytes(4096), (core.host, core.port))
                        sent += 1
        report.update(sent=sent, job_id=joined[0].job_id)
        print(json.dumps(report), flush=True)
        sys.stdin.read()  # stay joined (and holding) until the test closes stdin
        return 0
    if mode == "leaked":
        host, port_text, job_id, cookie, epoch, rank, count = argv[1:8]
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        for i in range(int(count)):
            header = HEADER.pack(MAGIC, VERSION, Kind.CONTRIBUTION, 1, 1, 0, int(job_id), int(rank),
                                 int(epoch), int(cookie), 1 + i % 4, i % 32, 0, 64, 1 + i % 4)
            sock.sendto(header + bytes(64), (host, int(port_text)))
        sock.settimeout(2.0)  # whatever the appliance would send here comes within this
        received = 0
        try:
            while True:
                sock.recv(65536)
                received += 1
        except TimeoutError:
            pass
        report.update(sent=int(count), received=received)
        print(json.dumps(report), flush=True)
        return 0
    group, port = argv[1], int(argv[2])
    result, core = sniff(group, port)
    f = fields(result)
    report.update(job_id=f[6], cookie_learned=f[9] != 0, core=list(core))
    if mode == "sniff":
        pass
    elif mode == "contribute":
        rank, count = int(argv[3]), int(argv[4])
        send_all(contributions(f, rank, count, [f[10], f[10] + 1], [f[14], f[14] + 1],
                               f[13]), core)
        report["sent"] = count
    elif mode == "results":
        count = int(argv[3])
        forged = []
        for i in range(count):
            g = f.copy()
            g[10] = f[10] + 1 + i % 8  # the next rounds the workers will wait for
            g[14] = f[14] + 1 + i % 8
            g[12] = (i // 8) * f[13]
            forged.append(HEADER.pack(*g) + b"\x7f" * f[13])
        send_all(forged, (group, port))
        report["sent"] = count
    elif mode == "far":
        rank, count = int(argv[3]), int(argv[4])
        spoof = argv[5] if len(argv) > 5 else None
        datagrams = contributions(f, rank, count, [FAR], [f[14] + 2**20 + i for i in range(8)]
                                  + [FAR], f[13])
        send_all(datagrams, core, spoof)
        report["sent"] = count
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
