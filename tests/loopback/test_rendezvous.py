"""A worker's rendezvous against an API on loopback that answers from another release."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from reduction_appliance.client import JobAborted
from reduction_appliance.control.config import parse
from reduction_appliance.control.registry import JobRequest, Registry
from reduction_appliance.dataplane.wire import VERSION
from reduction_appliance.plugin import rendezvous
from reduction_appliance.plugin.rendezvous import (
    JobInfo,
    RendezvousError,
    api_address,
    join,
    leave,
    register,
)
from tests.fake_api import fake_api


@contextmanager
def api_answering(answer: dict[str, object]) -> Iterator[str]:
    """An API on loopback that answers every POST with `answer`; its "host:port"."""
    body = json.dumps(answer).encode()
    with fake_api(lambda _: (201, body)) as (where, _):
        yield where


def described() -> dict[str, object]:
    plan = Registry(parse({})).plan(JobRequest("j", 2), cookie=3, secret="s", now=0.0)
    return plan.describe(parse({}), member=True).to_json()


@pytest.mark.parametrize("version", [None, VERSION - 1, VERSION + 1])
def test_an_appliance_speaking_another_datagram_format_is_refused_by_name(
        version: int | None) -> None:
    answer = described()
    if version is None:  # an appliance from before the field existed
        del answer["wire_version"]
    else:
        answer["wire_version"] = version
    with api_answering(answer) as where, \
            pytest.raises(RendezvousError, match=rf"speaks datagram format v{version or 2}, "
                                                 rf"this worker v{VERSION}"):
        register(where, "j", 2, timeout_s=5)


def test_the_same_format_is_accepted() -> None:
    with api_answering(described()) as where:
        info = register(where, "j", 2, timeout_s=5)
    assert (info.name, info.world_size, info.secret) == ("j", 2, None)


@contextmanager
def api_replying(statuses: list[int]) -> Iterator[tuple[str, list[str]]]:
    """An API on loopback that answers the n-th POST with `statuses[n]` (the last one from
    then on) and an error body; its "host:port" and the paths it was asked."""
    def reply(n: int) -> tuple[int, bytes]:
        status = statuses[min(n, len(statuses)) - 1]
        return status, json.dumps({"error": f"status {status}"}).encode()

    with fake_api(reply) as served:
        yield served


def _joined(where: str) -> JobInfo:
    """Job "j" (id 1) as a rank knows it, its API at `where`."""
    with api_answering(described()) as served:
        info = register(served, "j", 2, timeout_s=5)
    return replace(info, appliance=where)


def test_a_leave_whose_answer_was_lost_and_finds_the_job_gone_is_done() -> None:
    """The first attempt's answer never came (here: the appliance was busy, 503); the repeat
    finds no job, since that attempt was the last rank's leave and removed it."""
    with api_replying([503, 404]) as (where, asked):
        leave(_joined(where), 1, timeout_s=5)
    assert asked == ["/v1/jobs/1/leave"] * 2


def test_a_first_leave_that_finds_no_job_is_an_error() -> None:
    with api_replying([404]) as (where, asked), \
            pytest.raises(RendezvousError, match="refused POST /v1/jobs/1/leave: 404"):
        leave(_joined(where), 1, timeout_s=5)
    assert asked == ["/v1/jobs/1/leave"]


def test_a_leave_whose_first_attempt_hangs_is_repeated_within_its_time() -> None:
    """Every call leaves time for a second attempt: a leave's first attempt that never answers
    (until the second arrives) is repeated, however short the call's time. (One attempt
    used to take a leave's whole 5 s, and a timed-out leave was never repeated.)"""
    second = threading.Event()
    body = json.dumps(described()).encode()

    def reply(n: int) -> tuple[int, bytes]:
        if n == 1:
            second.wait(30)  # (set by the second attempt; a bound, not a wait for time)
        else:
            second.set()
        return 200, body

    with fake_api(reply) as (where, asked):
        leave(_joined(where), 1, timeout_s=2)
    assert asked == ["/v1/jobs/1/leave"] * 2


def test_a_leave_to_an_appliance_where_nothing_listens_fails_at_once() -> None:
    """A refused connection is final for a leave: the daemon is gone, and its jobs with it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        where = f"127.0.0.1:{probe.getsockname()[1]}"  # (closed: nothing listens there)
    with pytest.raises(RendezvousError, match="cannot reach appliance API") as raised:
        leave(_joined(where), 1, timeout_s=30)
    assert "gave up after" not in str(raised.value)


def test_a_join_refused_while_the_rank_is_held_waits_as_told_then_joins() -> None:
    """A worker restarted by a launcher joins before the appliance counts its predecessor
    gone: the 409 says how long until it may (`retry_after_s`), and the join asks again then
    instead of failing. Another conflict fails at once, and a rank held for good (a live
    duplicate) fails at the join's deadline, saying so."""
    held = json.dumps({"error": "rank 0 of job 1 is already joined", "retry_after_s": 0.2})
    joined = described()

    def reply(n: int) -> tuple[int, bytes]:
        return (409, held.encode()) if n <= 2 else (200, json.dumps(joined).encode())

    with fake_api(reply) as (where, asked):
        info = join(replace(_joined(where), secret="s"), 0, ("127.0.0.1", 40000), timeout_s=10)
    assert asked == ["/v1/jobs/1/join"] * 3 and info.cookie == joined["cookie"]
    with api_replying([409]) as (where, asked), \
            pytest.raises(RendezvousError, match="refused POST /v1/jobs/1/join: 409"):
        join(replace(_joined(where), secret="s"), 0, ("127.0.0.1", 40000), timeout_s=10)
    assert asked == ["/v1/jobs/1/join"]  # no retry_after_s: not a held rank
    with fake_api(lambda _: (409, held.encode())) as (where, asked), \
            pytest.raises(RendezvousError, match=r"already joined.*still held after .* of the "
                                                 r"1\.5 s this call may take"):
        join(replace(_joined(where), secret="s"), 0, ("127.0.0.1", 40000), timeout_s=1.5)
    assert 2 <= len(asked) <= 4


def test_a_refusal_says_the_appliances_reason_not_its_json() -> None:
    said = "job 'j' exists and that is not its join secret: another run may have this name"
    with fake_api(lambda _: (403, json.dumps({"error": said}).encode())) as (where, _), \
            pytest.raises(RendezvousError) as refused:
        register(where, "j", 2, secret="mine", timeout_s=5)
    assert str(refused.value) == f"appliance {where} refused POST /v1/jobs: 403 {said}"


def test_a_registration_refused_while_the_name_may_be_held_waits_as_told() -> None:
    """A launcher registering a restarted job's name with a new secret, a moment after its
    workers died: the appliance refuses (403) saying when the old job counts as abandoned, and
    the registration asks again then."""
    held = json.dumps({"error": "job 'j' exists and that is not its join secret",
                       "retry_after_s": 0.2})

    def reply(n: int) -> tuple[int, bytes]:
        return (403, held.encode()) if n == 1 else (201, json.dumps(described()).encode())

    with fake_api(reply) as (where, asked):
        info = register(where, "j", 2, secret="new", timeout_s=10)
    assert asked == ["/v1/jobs"] * 2 and info.name == "j"


@pytest.mark.parametrize(("token", "hint"), [
    (None, "this worker sent none: give it the appliance's API token, REDUCTION_TOKEN"),
    ("stale", "this worker sent the token it was given, which the appliance's api.token_file "
              "does not hold"),
])
def test_a_refused_token_says_which_end_to_fix(token: str | None, hint: str) -> None:
    refusal = json.dumps({"error": "missing or wrong bearer token"}).encode()
    with fake_api(lambda _: (401, refusal)) as (where, _), \
            pytest.raises(RendezvousError) as refused:
        register(where, "j", 2, token=token, timeout_s=5)
    assert "401" in str(refused.value) and hint in str(refused.value)


def test_a_server_that_is_not_the_appliance_is_named_so_at_once() -> None:
    """REDUCTION_APPLIANCE pointing at another service: an SSH server's banner escaped as a
    bare BadStatusLine traceback; a web server's 501 was retried for the whole 30 s, then
    quoted as a page of HTML; its 200 page was retried as "cannot reach"."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def banner() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

        thread = threading.Thread(target=banner, daemon=True)
        thread.start()
        with pytest.raises(RendezvousError, match=r"is not an appliance's API: it answered "
                                                  r"POST /v1/jobs with 'not HTTP: SSH-2\.0"):
            register(f"127.0.0.1:{listener.getsockname()[1]}", "j", 2, timeout_s=30)
        thread.join(5)
    page = b"<!DOCTYPE HTML><html><body>" + b"x" * 2000 + b"</body></html>"
    for status in (501, 200):
        with fake_api(lambda _, status=status: (status, page)) as (where, asked), \
                pytest.raises(RendezvousError, match="is not an appliance's API") as refused:
            register(where, "j", 2, timeout_s=30)
        assert len(asked) == 1  # at once, not retried for 30 s
        assert "REDUCTION_APPLIANCE" in str(refused.value) and len(str(refused.value)) < 400


@pytest.mark.parametrize(("given", "taken"), [
    ("198.18.0.1:7070", "198.18.0.1:7070"),
    (" appliance-a:7070 ", "appliance-a:7070"),  # after a comma in a list
    ("http://198.18.0.1:7070/", "198.18.0.1:7070"),
    ("HTTP://[fd00::1]:7070", "[fd00::1]:7070"),
])
def test_an_api_address_is_taken_as_users_write_it(given: str, taken: str) -> None:
    assert api_address(given) == taken


@pytest.mark.parametrize(("given", "why"), [
    ("198.18.0.1", "not an appliance API address: give the host:port"),
    ("https://198.18.0.1:7070", "the API speaks plain HTTP"),
    ("198.18.0.1:7070/v1", "not an appliance API address"),
    ("198.18.0.1:http", "Port could not be cast"),
    ("198.18.0.1:99999", "out of range"),
    ("a b:7070", "not an appliance API address"),
    ("", "not an appliance API address"),
])
def test_a_malformed_api_address_is_refused_before_anything_is_asked(given: str,
                                                                      why: str) -> None:
    """Each of these was asked for a registration's whole 30 s, then failed as "cannot reach"
    (an "http://" prefix, a missing port) or as "not an appliance's API" (a leading blank)."""
    with pytest.raises(RendezvousError, match=why) as refused:
        register(given, "j", 2, timeout_s=30)
    assert repr(given) in str(refused.value) and "api.listen" in str(refused.value)


def test_a_registration_at_an_address_written_as_a_url_reaches_the_api() -> None:
    with api_answering(described()) as where:
        info = register(f"http://{where}/", "j", 2, secret="s", timeout_s=5)
    assert info.appliance == where and info.name == "j"


@pytest.mark.parametrize("status", [408, 429])
def test_a_request_the_appliance_had_no_time_to_read_or_take_is_repeated(status: int) -> None:
    """408: the request's body did not come within the API's header timeout (a host that
    stalled between its head and its body; thousands of ranks joining at once, where a test
    once saw 3126 of 4096 joins fail for good on it). 429: too many requests. Neither was
    acted on, and a join is safe to repeat."""
    joined = described()

    def reply(n: int) -> tuple[int, bytes]:
        return ((status, json.dumps({"error": f"status {status}"}).encode()) if n <= 2
                else (200, json.dumps(joined).encode()))

    with fake_api(reply) as (where, asked):
        info = join(replace(_joined(where), secret="s"), 0, ("127.0.0.1", 40000), timeout_s=10)
    assert asked == ["/v1/jobs/1/join"] * 3 and info.cookie == joined["cookie"]


@pytest.mark.parametrize(("call_s", "attempt_s"), [(30.0, 15.0), (120.0, 30.0)])
def test_an_attempt_waits_half_its_calls_time_from_the_first(
        monkeypatch: pytest.MonkeyPatch, call_s: float, attempt_s: float) -> None:
    """A busy API answers its queue in turn, and an attempt given up queues again at the back:
    with 5 s first attempts, 4096 ranks joining at once gave up about 1950 attempts a run,
    against none so (benchmarks-journal.md, "Joins pushed without the lock"). A second
    attempt still fits (the test above), and a long call's attempts wait 30 s at most."""
    waits: list[float] = []
    joined = json.dumps(described()).encode()

    def reply(n: int) -> tuple[int, bytes]:
        return (503, b'{"error": "busy"}') if n == 1 else (200, joined)

    real_attempt = rendezvous._attempt

    def attempt(*args: object) -> object:
        waits.append(float(args[-1]))  # type: ignore[arg-type]
        return real_attempt(*args)  # type: ignore[arg-type]

    with fake_api(reply) as (where, asked):
        info = replace(_joined(where), secret="s")
        monkeypatch.setattr(rendezvous, "_attempt", attempt)
        join(info, 0, ("127.0.0.1", 40000), timeout_s=call_s)
    assert asked == ["/v1/jobs/1/join"] * 2
    assert waits == pytest.approx([attempt_s] * 2, abs=0.1)  # (the old: 5 s, then 10)


@pytest.mark.parametrize("call", ["join", "connect"])
def test_a_rank_refused_for_coming_after_the_abort_raises_job_aborted(call: str) -> None:
    """410: the job was aborted before this rank joined (control/aborts.py). The rank raises
    what its peers raised, `JobAborted`, with the appliance's reason, and asks once."""
    with api_replying([410]) as (where, asked), pytest.raises(JobAborted) as told:
        info = replace(_joined(where), cookie=None, secret="s")
        if call == "join":
            join(info, 1, ("127.0.0.1", 40000), timeout_s=5)
        else:
            rendezvous.connect(info, 1, "127.0.0.1", [], timeout_s=5)
    assert str(told.value) == (f"appliance {where} refused POST /v1/jobs/1/{call}: 410 "
                               "status 410")
    assert asked == [f"/v1/jobs/1/{call}"]


def test_a_leave_after_the_abort_is_gone_as_after_a_removal() -> None:
    """A leave's repeated attempt that finds the job aborted is done, as one that finds it
    removed (404): what a rank on its way out asks for holds."""
    with api_replying([503, 410]) as (where, asked):
        leave(_joined(where), 1, timeout_s=5)
    assert asked == ["/v1/jobs/1/leave"] * 2
