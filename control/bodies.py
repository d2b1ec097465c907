"""The API's request bodies, checked field by field: what is wrong is the caller's fault,
said as `BadRequest` (400) naming the field and what it must be."""

from __future__ import annotations

import ipaddress
from typing import Any

from reduction_appliance.dataplane.errors import BadRequest
from reduction_appliance.dataplane.verbs import QpEndpoint

from .registry import JobRequest

__all__ = ["address", "boolean", "check_landings", "integer", "parse_request", "string", "text"]


def integer(body: dict[str, Any], key: str, low: int = 0, high: int = 2**31,
            default: int | None = None) -> int:
    """`body[key]`, an integer in low..high (`default` where absent, if given)."""
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in {low}..{high}, got {value!r}")
    return value


def string(body: dict[str, Any], key: str, *, required: bool = True) -> str:
    value = body.get(key, None if required else "")
    if not isinstance(value, str) or (required and not value) or len(value) > 256:
        raise BadRequest(f"{key} must be a string of 1..256 characters")
    return value


def text(body: dict[str, Any], key: str) -> str:
    """`body[key]`, words for people (a reason told to other workers and logged): a string of
    1..256 characters, anything unprintable (a newline, an escape) made a space, so one
    caller cannot forge log lines or terminal output elsewhere."""
    return "".join(c if c.isprintable() else " " for c in string(body, key))


def boolean(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false")
    return value


def address(body: dict[str, Any], key: str) -> str:
    value = string(body, key)
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise BadRequest(f"{key} must be an IPv4 address, got {value!r}") from None
    return value


def parse_request(body: dict[str, Any]) -> JobRequest:
    """A job request from its JSON body; `BadRequest` says what is wrong."""
    known = {"name", "world_size", "deterministic", "multicast", "slots", "secret",
             "transport"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; known: {sorted(known)}")
    if "name" not in body or "world_size" not in body:
        raise BadRequest("a job needs name and world_size")
    name, world, slots = body["name"], body["world_size"], body.get("slots", 0)
    if not isinstance(name, str):
        raise BadRequest("name must be a string")
    for key, value in (("world_size", world), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest(f"{key} must be an integer, got {value!r}")
    for key in ("deterministic", "multicast"):
        if not isinstance(body.get(key, False), bool):
            raise BadRequest(f"{key} must be true or false")
    transport = body.get("transport", "udp")
    if transport not in ("udp", "roce"):
        raise BadRequest(f"transport must be \"udp\" or \"roce\", got {transport!r}")
    # Absent: the transport's default (UDP: multicast; RoCE: results RDMA-written to each
    # rank), settled here so that ranks that say it and ranks that do not ask the same.
    multicast = bool(body.get("multicast", transport == "udp"))
    return JobRequest(name, world, bool(body.get("deterministic", False)), multicast, slots,
                      transport)


def check_landings(remotes: list[dict[str, Any]], slots: int, message: int) -> None:
    """A worker's landing buffers must take a result for every slot of the job (the caller's
    fault when not: a core would have to drop them)."""
    for i, remote in enumerate(remotes):
        try:
            landing = QpEndpoint.from_json(remote).landing
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        if landing is None:
            raise BadRequest(f"queue_pairs[{i}] names no landing: results are RDMA-written "
                             "into the worker's landing buffers, one per slot")
        if landing.slots < slots or landing.stride < message:
            raise BadRequest(f"queue_pairs[{i}]: the landing holds {landing.slots} entries of "
                             f"{landing.stride} bytes; the job needs {slots} of {message}")
