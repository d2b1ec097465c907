"""What each data-plane core counter is called in Prometheus, and what it means (HELP): the
table `control.metrics` renders a core's counters with, kept apart from the rendering because
it grows with every counter the data plane gains."""

from __future__ import annotations

__all__ = ["CORE_COUNTERS", "CORE_GAUGES"]

# Core counter name (dataplane.counters.Counter, lower case) -> (metric name, HELP). The `_total`
# suffix is added by the client. Counters not listed here and not `drop_*` are not exported: the
# unit tests check that every Counter is covered, so a new one cannot be forgotten silently.
CORE_COUNTERS: dict[str, tuple[str, str]] = {
    "packets_in": (
        "core_packets_received",
        "Datagrams the core received, whatever became of them; moves once per receive burst.",
    ),
    "bytes_in": (
        "core_bytes_received",
        "Bytes of received datagrams (header and payload); moves once per receive burst.",
    ),
    "packets_out": (
        "core_packets_sent",
        "Datagrams the core sent (results, resent results, PENDING notes); moves once per burst.",
    ),
    "bytes_out": (
        "core_bytes_sent",
        "Bytes of datagrams the core sent (header and payload); moves once per burst.",
    ),
    "segments_reduced": (
        "core_segments_reduced",
        "Segments whose contributions from all ranks were reduced; moves when a slot completes.",
    ),
    "roce_post_send": (
        "core_roce_send_requests",
        "RoCE send work requests posted (one per message: a contribution's result, a notice).",
    ),
    "roce_post_recv": (
        "core_roce_receive_requests",
        "RoCE receive work requests posted on the core's shared receive queue (one per message "
        "received).",
    ),
    "roce_polls": (
        "core_roce_polls",
        "Polls of the core's RoCE completion queue, empty ones included.",
    ),
    "roce_completions": (
        "core_roce_completions",
        "RoCE work completions the core polled (receives, and one per signalled batch of sends).",
    ),
    "roce_peers_lost": (
        "core_roce_peers_lost",
        "RoCE queue pairs whose worker was lost (an error completion: retries exhausted, "
        "remote error); the rank falls silent and the liveness timeout names it.",
    ),
    "roce_send_queue_full": (
        "core_roce_send_queue_full",
        "RoCE messages dropped because the queue pair's send queue was full (the worker's "
        "retransmission repairs it).",
    ),
    "roce_result_writes": (
        "core_roce_result_writes",
        "Results the core RDMA-wrote (WRITE_WITH_IMM) into workers' landing buffers (part of "
        "the send requests).",
    ),
    "roce_drop_immediate": (
        "core_roce_drop_immediate",
        "RoCE contributions dropped because their immediate (the slot) disagreed with their "
        "header: a worker's fault.",
    ),
    "roce_unsendable": (
        "core_roce_unsendable",
        "RoCE messages the core could not send: larger than a worker's receive buffers and no "
        "result for one of its landing slots.",
    ),
    "roce_multicast_chunks": (
        "core_roce_multicast_chunks",
        "UD multicast chunks of results the core sent (RoCE jobs with multicast results).",
    ),
    "heartbeats": (
        "core_heartbeats",
        "HEARTBEATs from joined ranks (workers send several per liveness timeout), answered.",
    ),
    "job_notices": (
        "core_job_notices",
        "RESYNC and DIVERGED notices sent to workers (a re-joined rank, ranks that disagree), and "
        "the word that a rank they wait for ended (LIVENESS flagged UNASKED).",
    ),
    "bytes_reduced": (
        "core_bytes_reduced",
        "Payload bytes of completed segments (one copy, not times the world size); moves when a "
        "slot completes.",
    ),
    "results_resent": (
        "core_results_resent",
        "Finished results sent again to one worker that retransmitted a contribution it had "
        "already sent (its result was lost); moves on each such retransmission.",
    ),
    "results_withheld": (
        "core_results_withheld",
        "Queries for a result still on its way to the worker (it heard no later result from "
        "the core, and the result left less than 10 ms before, or 100 ms when the worker lacks "
        "an earlier one too: a queue): answered with a PENDING note (all ranks in); a later "
        "query gets the result.",
    ),
    "runs_taken": (
        "core_runs_taken",
        "Bursts taken whole by the burst path: consecutive datagrams of one worker's coalesced "
        "receive (UDP GRO), each a first transmission to a slot of its own, with one header "
        "decoded, one set of checks and one kernel call per stretch of consecutive slots.",
    ),
    "contributions_missed": (
        "core_contributions_missed",
        "Contributions a rank's own numbering showed lost (later ones came): that rank is "
        "told at once with a MISSING note and resends them, without waiting for its peers' "
        "queries; moves by the number of contributions each note lists.",
    ),
    "path_probes": (
        "core_path_probes",
        "PATH_PROBEs from joined ranks, each answered with a PATH_ECHO: a worker that joins "
        "sends a few of each size it tests, to learn whether the path carries the job's "
        "datagrams whole in both directions.",
    ),
    "path_echo_bytes": (
        "core_path_echo_bytes",
        "Bytes of the PATH_ECHOs sent (counted in bytes_out too): what joins cost, apart from "
        "the bytes of results.",
    ),
    "job_outages": (
        "core_job_outages",
        "Times every rank of a job fell silent at once for half its liveness timeout and then "
        "came back (a link flap, a switch reboot, a stalled core): the ranks were not declared "
        "silent for it, each getting a fresh timeout. Longer than the timeout, the workers "
        "themselves fail their rounds with ApplianceSilent.",
    ),
    "unknown_job_notices": (
        "core_unknown_job_notices",
        "Heartbeats of a job this core does not have (or with another cookie), answered with "
        "UNKNOWN_JOB: the workers of a job lost when the appliance restarted, or of one that "
        "ended, learn it at once (they ask the API before they believe it).",
    ),
    "reach_probes": (
        "core_reach_probes",
        "REACHes sent to ranks a slot waits for that the core has not heard for 1.5 heartbeat "
        "intervals: is anything still listening at their endpoint? A live (or paused) worker "
        "ignores them.",
    ),
    "ranks_ended": (
        "core_ranks_ended",
        "Ranks whose host answered ICMP port unreachable at their endpoint (each core that read "
        "it counts it): their process ended without leaving (killed, crashed, exited); where a "
        "round waits for one, its peers are told at once, not after the liveness timeout.",
    ),
    "declined_datagrams": (
        "core_declined_datagrams",
        "Datagrams of coalesced receives the burst path left to the one-by-one path (a "
        "retransmission, a query, a duplicate, a deterministic job, anything unusual): taken "
        "alone, every check on the way; the bursts before and after them are still taken whole.",
    ),
    "pending_sent": (
        "core_pending_sent",
        "PENDING notes: to a worker that retransmitted or queried a segment still waiting for "
        "other ranks, and to each of those ranks (their contribution never came).",
    ),
    "queries": (
        "core_queries",
        "QUERYs: a rank whose contribution already arrived asks for the result (48 bytes instead "
        "of resending the segment); answered with the result or PENDING.",
    ),
    "duplicates": (
        "core_duplicates",
        "Contributions received again from a rank already counted for that segment (never added "
        "twice); moves on each duplicate.",
    ),
    "abandoned": (
        "core_segments_abandoned",
        "Unfinished segments abandoned by their workers (they timed out and moved on) whose slot "
        "was recycled; moves when a newer round claims such a slot.",
    ),
    "abort_notices": (
        "core_abort_notices_sent",
        "ABORTED notices sent to workers of an aborted job (once per worker at the abort, then "
        "once per later datagram of that job); moves on each notice.",
    ),
    "send_errors": (
        "core_send_errors",
        "Datagrams the core failed to send (the kernel refused them); moves on each failure.",
    ),
    "poll_loops": (
        "core_poll_loops",
        "Iterations of the core's poll loop; moves on every iteration.",
    ),
    "poll_busy_loops": (
        "core_poll_busy_loops",
        "Poll-loop iterations that found at least one datagram; rate() over poll_loops gives "
        "the recent busy fraction.",
    ),
}

# Core counter cells that hold a level, not a count.
CORE_GAUGES: dict[str, tuple[str, str]] = {
    "slots_in_use": (
        "core_slots_in_use",
        "Slots of the core's arena currently assigned to admitted jobs.",
    ),
}
