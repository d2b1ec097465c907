"""reductionctl's operator commands: status, jobs, abort, check-config, steering, clean.

They talk to a running reductiond over its Unix socket (control.apiclient) and print human
tables, or the API's JSON with --json. Exit codes: 0 fine, 1 the appliance said no or is not
running, 2 bad usage or a bad config file.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from reduction_appliance.dataplane.errors import ConfigError, ReductionError
from reduction_appliance.dataplane.units import format_size

from .apiclient import ApiError, UnixApi
from .config import ApiConfig, load
from .jobtext import job_lines, render_job

__all__ = ["add_commands", "render_status"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _api(args: argparse.Namespace) -> UnixApi:
    path = args.socket
    if args.config:
        path = load(args.config).api.unix_socket or path
    return UnixApi(path)


_NAME_MAX = 40  # the widest name column; longer names keep their start and end


def render_status(s: dict[str, Any]) -> str:
    lines = [f"reductiond {s['version']}  up {s['uptime_s']:.0f}s  config {s['config']}"]
    if s.get("segment_bytes"):
        lines.append(f"UDP segments of {s['segment_bytes']} bytes ({s['segment_origin']})")
    if s.get("janitor_errors"):
        lines.append(f"! janitor: {s['janitor_errors']} periodic chore(s) failed since start "
                     "(each logged by reductiond)")
    if s.get("api_requests_abandoned"):
        lines.append(f"! api: {s['api_requests_abandoned']} request(s) not served since start: "
                     "their clients gave up waiting first and asked again (the API was busier "
                     "than their timeouts)")
    lines.append("")
    lines.append(f"{'core':>4} {'pid':>7} {'cpu':>4} {'port':>6} {'state':>10} {'restarts':>8} "
                 f"{'pps in':>9} {'GB/s in':>8} {'pkts in':>10} {'reduced':>10} {'drops':>6} "
                 f"{'busy':>6}")
    for c in s["cores"]:
        k = c["counters"]
        drops = sum(v for name, v in k.items() if name.startswith("drop_"))
        lines.append(
            f"{c['index']:>4} {c['pid'] or '-':>7} {c['cpu'] if c['cpu'] is not None else '-':>4} "
            f"{c['port']:>6} {c['state']:>10} {c['restarts']:>8} {c['packets_per_s']:>9.0f} "
            f"{c['bytes_per_s'] / 1e9:>8.3f} {k.get('packets_in', 0):>10} "
            f"{format_size(k.get('bytes_reduced', 0)):>10} {drops:>6} "
            f"{c['busy_fraction'] * 100:>5.1f}%")
        if c.get("last_exit"):
            lines.append(f"     ! core {c['index']} last exit: {c['last_exit']}")
        lines.extend(_queue_pair_lines(c))
    lines.append("")
    if not s["jobs"]:
        lines.append("jobs: none")
    else:
        # As wide as the longest name (groups and hook states of one job differ at the end)
        wide = max(16, min(_NAME_MAX, max(len(j["name"]) for j in s["jobs"])))
        lines.append(f"{'job':>4} {'name':<{wide}} {'state':<8} {'world':>5} {'joined':>6} "
                     f"{'epoch':>5} {'rounds':>7} {'reduced':>10} {'last activity':>14}  "
                     "lagging ranks")
        for j in s["jobs"]:
            lines.extend(job_lines(j, wide))
    evicted = {cause: n for cause, n in s.get("jobs_evicted", {}).items() if n}
    if evicted:
        lines.append("jobs evicted since start: " + ", ".join(
            f"{n} {cause}" for cause, n in sorted(evicted.items())) + " (the log says which)")
    aborted = {by: n for by, n in s.get("jobs_aborted", {}).items() if n}
    late = s.get("late_ranks_refused", 0)
    if aborted or late:
        lines.append("jobs aborted since start: " + (", ".join(
            f"{n} by {'the operator' if by == 'operator' else 'one of their ranks'}"
            for by, n in sorted(aborted.items())) or "none") + (
            f"; {late} late rank(s) told so at join" if late else "") + " (the log says why)")
    lines.append("")
    for i in s["interfaces"]:
        lines.append(f"interface {i['name']}: {'up' if i['up'] else 'DOWN'}, MTU {i['mtu']}, "
                     f"multicast routes {', '.join(i['multicast_routes']) or 'none'}")
    lines.append("steering: " + ("; ".join(s["steering"]) or "no rules installed"))
    lines.extend(f"  note: {n}" for n in s["steering_notes"])
    lines.append("rdma devices: " + (", ".join(s["rdma_devices"]) or "none"))
    lines.append("fallbacks:" if s.get("fallbacks") else "fallbacks: none")
    lines.extend(f"  - {f}" for f in s.get("fallbacks", ()))
    return "\n".join(lines)


def _queue_pair_lines(core: dict[str, Any]) -> list[str]:
    """A core's RoCE counters and queue pairs (as `rdma res show qp` would list them)."""
    qps = core.get("queue_pairs") or []
    k = core["counters"]
    if not qps and not k.get("roce_polls"):
        return []
    lines = [f"     roce: {len(qps)} queue pair(s); posted {k.get('roce_post_send', 0)} sends "
             f"({k.get('roce_result_writes', 0)} result writes), "
             f"{k.get('roce_post_recv', 0)} receives; {k.get('roce_completions', 0)} "
             f"completions in {k.get('roce_polls', 0)} polls; {k.get('roce_peers_lost', 0)} "
             f"peers lost; {k.get('roce_send_queue_full', 0)} send-queue-full drops, "
             f"{k.get('roce_drop_immediate', 0)} bad immediates, "
             f"{k.get('roce_unsendable', 0)} unsendable"]
    for q in qps:
        local, remote = q["local"], q["remote"]
        state = q["state"] + (f" ({q['lost']})" if q.get("lost") else "")
        lines.append(f"       {q['address'][0]}:{q['address'][1]}  qpn {local['qpn']} on "
                     f"{local['device']} <-> qpn {remote['qpn']} on {remote['device']} "
                     f"({remote['gid']}), mtu {min(local['mtu'], remote['mtu'])}, {state}, "
                     f"{q['outstanding']} sends in flight, results by "
                     + (f"RDMA write ({remote['landing']['slots']} landing slots)"
                        if remote.get("landing") else "send"))
    return lines


def status(args: argparse.Namespace) -> int:
    snapshot = _api(args).get("/v1/status")
    print(json.dumps(snapshot, indent=2) if args.json else render_status(snapshot))
    return EXIT_OK


def jobs(args: argparse.Namespace) -> int:
    api = _api(args)
    if args.job_id is not None:
        job = api.get(f"/v1/jobs/{args.job_id}")
        snapshot = api.get("/v1/status")
        live: dict[str, Any] = next(
            (j for j in snapshot["jobs"] if j["job_id"] == args.job_id), {})
        merged = job | {"live": live}
        print(json.dumps(merged, indent=2) if args.json else render_job(job, live))
        return EXIT_OK
    snapshot = api.get("/v1/status")
    if args.json:
        print(json.dumps(snapshot["jobs"], indent=2))
    else:
        text = render_status(snapshot).split("\n\n")
        print(text[2] if len(text) > 2 else "jobs: none")
    return EXIT_OK


def abort(args: argparse.Namespace) -> int:
    job = _api(args).request("POST", f"/v1/jobs/{args.job_id}/abort")
    print(json.dumps(job, indent=2) if args.json else
          f"job {args.job_id} ({job['name']}) aborted; its workers are told")
    return EXIT_OK


def check_config(args: argparse.Namespace) -> int:
    """The daemon's own loader, plus what only this host can tell: whether the chosen kernel
    backend is installed here, and whether the cores' memory and CPUs fit it."""
    # Imported here, not at the top: numpy and pyverbs cost `reductionctl status` nothing then
    # (seconds on a slow host; the emulated RoCE guest starts a CLI in 17 s with them).
    from reduction_appliance.dataplane.reduce import available_backends
    from reduction_appliance.dataplane.slots import arena_bytes
    from reduction_appliance.dataplane.verbs import roce_unavailable

    from .hostfit import host_verdicts
    try:
        cfg = load(args.file)  # its errors name the file
        kernels = cfg.dataplane.kernels
        if kernels != "auto" and kernels not in available_backends():
            raise ConfigError(f"{args.file}: dataplane.kernels: {kernels!r} is not available "
                              f"on this host; choose one of {', '.join(available_backends())} "
                              "or auto")
        if cfg.roce.enabled and (why := roce_unavailable(cfg.roce.device)) is not None:
            raise ConfigError(f"{args.file}: roce.device: {why}")
        crowded = host_verdicts(cfg)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    for warning in crowded:
        print(f"warning: {warning}", file=sys.stderr)
    dp = cfg.dataplane
    summary = {"config": cfg.source, "cores": dp.cores, "segment_bytes": dp.max_payload,
               "segments_from": dp.segment_origin,
               "slot_pairs_per_core": cfg.slot_capacity, "memory_per_core_mib": arena_bytes(
                   cfg.slot_capacity, cfg.arena_payload, dp.rx_buffers) // 2**20,
               "jobs_at_default_slots":
               cfg.slot_capacity // cfg.jobs.slots, "multicast": cfg.multicast.enabled,
               "roce": (f"{cfg.roce.device} port {cfg.roce.port} GID {cfg.roce.gid_index}, "
                        f"segment_bytes {cfg.roce.segment_bytes}") if cfg.roce.enabled else "off"}
    print(json.dumps(summary, indent=2) if args.json else
          "config OK: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    return EXIT_OK


def steering_cmd(args: argparse.Namespace) -> int:
    snapshot = _api(args).get("/v1/status")
    view = {k: snapshot[k] for k in ("interfaces", "steering", "steering_notes")}
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print("\n".join(render_status(snapshot).split("\n")[-(3 + len(view["steering_notes"])
                                                            + len(view["interfaces"])):]))
    return EXIT_OK


def clean(args: argparse.Namespace) -> int:
    """Remove what a crashed reductiond left: its steering rules and its Unix socket, with the
    same teardown code a clean stop runs. A live daemon owns them: if its Unix socket (or its
    TCP API) accepts a connection, nothing is touched."""
    if not args.config:
        print("clean needs --config (the crashed appliance's config)", file=sys.stderr)
        return EXIT_USAGE
    cfg = load(args.config)
    sock = cfg.api.unix_socket
    stale_socket = bool(sock) and Path(sock).is_socket()
    live = (sock if stale_socket and _answers(sock) else
            str(cfg.api.listen) if cfg.api.listen is not None and _tcp_answers(cfg.api.listen)
            else None)
    if live is not None:
        print(f"reductionctl: reductiond is running on {live}: stop it first (clean only "
              "removes what a crashed one left); nothing was changed", file=sys.stderr)
        return EXIT_FAILED
    removed: list[str] = []
    if cfg.dataplane.interface:
        from . import steering  # pyroute2: only `clean` needs it (see check_config)

        inputs = steering.SteeringInputs.from_config(cfg, rx_queues=1)
        removed += steering.remove(steering.plan(inputs))
    if stale_socket:
        Path(sock).unlink(missing_ok=True)
        removed.append(f"stale socket {sock}")
    print(json.dumps(removed) if args.json else
          ("removed: " + "; ".join(removed) if removed else "nothing to clean"))
    return EXIT_OK


def _answers(sock: str) -> bool:
    """Whether a process serves `sock`: a connection it accepts (a crashed daemon's socket file
    refuses). Not an HTTP request: a live daemon that is slow to answer is still alive; and
    whatever leaves it unclear (a full backlog, no permission) counts as alive."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(sock)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # a full backlog (timeout), no permission: cannot tell, so hands off
        return True
    finally:
        probe.close()
    return True


def _tcp_answers(address: tuple[str, int]) -> bool:
    """Whether something accepts connections on the config's API address (from this host)."""
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        return False
    return True


def add_commands(sub: Any) -> None:
    """Register the operator commands on reductionctl's subparsers."""
    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--socket", default=ApiConfig().unix_socket,
                       help="reductiond's Unix socket (default: %(default)s)")
        p.add_argument("--config", help="take the socket (and rules) from this appliance.toml")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    common(sub.add_parser("status", help="one screen: cores, jobs, interfaces, steering")
           ).set_defaults(func=status)
    jobs_p = common(sub.add_parser("jobs", help="jobs; `jobs ID` shows one"))
    jobs_p.add_argument("job_id", nargs="?", type=int)
    jobs_p.set_defaults(func=jobs)
    abort_p = common(sub.add_parser("abort", help="abort a job (its workers are told)"))
    abort_p.add_argument("job_id", type=int)
    abort_p.set_defaults(func=abort)
    check_p = sub.add_parser("check-config", help="validate an appliance.toml")
    check_p.add_argument("file")
    check_p.add_argument("--json", action="store_true")
    check_p.set_defaults(func=check_config)
    common(sub.add_parser("steering", help="data interface, installed rules, notes")
           ).set_defaults(func=steering_cmd)
    common(sub.add_parser("clean", help="remove what a crashed reductiond left behind")
           ).set_defaults(func=clean)


def run(args: argparse.Namespace) -> int:
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"reductionctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ApiError as exc:
        print(f"reductionctl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ReductionError as exc:
        print(f"reductionctl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return code
