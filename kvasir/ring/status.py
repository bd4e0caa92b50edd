"""A node's status: one typed record that the control socket serialises and the TUI parses (the same schema).

``to_wire()`` gives the JSON object of the control socket's ``status`` message (docs/protocol.md § Control socket);
``from_wire()`` reads one back through the schema converter. Reading is lenient only about absent fields (older
nodes, recorded sessions: they take their defaults), strict about types: ``"ready": "false"`` or ``"rank": 3.9`` is a
:class:`~kvasir.core.schema.SchemaError` naming the field, which the TUI counts as a bad message.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kvasir.core.errors import InputError
from kvasir.core.schema import (
    Json,
    converter,
    record_hooks,
    register_hooks,
    register_record,
    require_object,
    structure,
    unstructure,
)
from kvasir.ring.links import LinkStats


@attrs.frozen
class LinkStatus:
    """One link: its state label, and its counters while it is up (``kind`` is None while it is down)."""

    state: str = "unknown"
    kind: str | None = None
    peer: str | None = None
    frames_out: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    bytes_in: int = 0
    rtt_ms: float | None = None
    up_s: float | None = None
    #: The link runs protocol v2: the peer's key was authenticated and the frames travel inside TLS 1.3.
    secure: bool = False

    @classmethod
    def of(cls, state: str, stats: LinkStats | None) -> LinkStatus:
        if stats is None:
            return cls(state)
        return cls(
            state=state,
            kind=stats.kind,
            peer=stats.peer,
            frames_out=stats.frames_out,
            bytes_out=stats.bytes_out,
            frames_in=stats.frames_in,
            bytes_in=stats.bytes_in,
            rtt_ms=None if stats.rtt is None else round(stats.rtt * 1e3, 3),
            up_s=round(time.monotonic() - stats.connected_at, 1),
            secure=stats.secure,
        )

    @property
    def up(self) -> bool:
        return self.kind is not None

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "link") -> LinkStatus:
        return structure(obj, cls, where=where)


@attrs.frozen
class RankStatus:
    """One rank of the manifest as this node knows it."""

    rank: int
    layers: tuple[int, int]
    address: str = ""
    link: str = "direct"

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "rank") -> RankStatus:
        return structure(obj, cls, where=where)


@attrs.frozen
class RequestCounters:
    in_flight: int = 0
    free_sequences: int = 0
    requests: int = 0
    #: Tokens seen passing this node (also what a market credits it for).
    tokens: int = 0
    boundaries: int = 0
    errors: int = 0
    #: Speculative decoding, counted at the last rank: verify batches sampled, drafts in them, drafts accepted.
    verify_batches: int = 0
    drafted: int = 0
    accepted: int = 0
    #: Batched decode (``--batch N``): batches of decode steps run, and the steps in them.
    decode_batches: int = 0
    batched_steps: int = 0
    #: Speculative steps the last rank drafted eagerly (``--draft-policy``, docs/speculation.md).
    eager_steps: int = 0

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "requests") -> RequestCounters:
        return structure(obj, cls, where=where)


@attrs.frozen
class FailoverStatus:
    """What this node did when its successor's window came back after a failure (docs/architecture.md § Failover).

    ``replays``: successor links (re)made with requests in flight, each followed by a replay; ``requests``/``frames``/
    ``bytes``: what those replays resent; ``duplicates``: replayed frames this node received for positions it had
    already seen (each checked equal, then dropped); ``last_stall_s``: how long the successor was away the last time,
    from losing its link to the end of the replay; ``log_bytes``: what the replay logs hold now.
    """

    replays: int = 0
    requests: int = 0
    frames: int = 0
    bytes: int = 0
    duplicates: int = 0
    last_stall_s: float | None = None
    last_window: tuple[int, int] | None = None
    log_bytes: int = 0

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "failover") -> FailoverStatus:
        return structure(obj, cls, where=where)


@attrs.frozen
class MarketWindow:
    """One window of the market's coverage map (a self-enrolled node's view of its ring)."""

    rank: int
    layers: tuple[int, int]
    holder: str | None = None
    reward: float | None = None
    state: str | None = None

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "market window") -> MarketWindow:
        return structure(obj, cls, where=where)


@attrs.frozen
class SupervisedProcess:
    """One process of ``kvasir ring up`` (a rank, a standby, the relay) as its supervisor sees it."""

    label: str
    #: ``up`` (answers its control socket), ``starting`` ((re)started, not answering yet: loading) or ``down`` (dead
    #: or killed, its restart due at ``retry_at``).
    state: str
    pid: int | None = None
    #: Deaths in a row, each before it had run stably: the restart delay doubles with them.
    streak: int = 0
    exit_code: int | None = None
    #: Unix times: when it last went down, and when its next restart is due (``down`` only).
    down_since: float | None = None
    retry_at: float | None = None


@attrs.frozen
class SupervisorStatus:
    """What ``kvasir ring up``'s supervisor last wrote of the ring's processes (``kvasir node --supervisor-state``):
    a node's status carries it, so ``kvasir status`` and the TUI show a window that is down and when it is retried."""

    #: Unix time of the write.
    written_at: float
    processes: tuple[SupervisedProcess, ...] = ()

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "supervisor state") -> SupervisorStatus:
        return structure(obj, cls, where=where)


def read_supervisor_state(path: Path) -> SupervisorStatus | None:
    """The supervisor's state from its file; None if there is none (yet) or it does not read as one."""
    try:
        return SupervisorStatus.from_wire(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, InputError):
        return None


def supervisor_lines(sup: SupervisorStatus, clock: Callable[[float], str] | None = None) -> list[str]:
    """What ``kvasir status`` and the TUI say of the supervisor's view: one line per process that is not up (down
    since when, why, its next restart), or one line saying all are up. ``clock``: a Unix time as the reader shows it
    (default: local ``HH:MM:SS``)."""
    at = clock or (lambda t: time.strftime("%H:%M:%S", time.localtime(t)))
    lines = []
    for p in sup.processes:
        if p.state == "up":
            continue
        since = "" if p.down_since is None else f" since {at(p.down_since)}"
        why = [] if p.exit_code is None else [f"exit {p.exit_code}"]
        if p.streak > 1:
            why.append(f"{p.streak} times in a row")
        because = f" ({', '.join(why)})" if why else ""
        if p.state == "down":
            retry = "" if p.retry_at is None else f"; next restart at {at(p.retry_at)}"
            lines.append(f"{p.label} down{since}{because}{retry}")
        else:
            lines.append(f"{p.label} restarted{since and ', down' + since}{because}; loading, not answering yet")
    return lines or [f"all {len(sup.processes)} processes up"]


@attrs.frozen
class NodeStatus:
    node_id: str
    rank: int
    ring_size: int
    model_name: str
    model_sha256: str
    n_layers: int
    window: tuple[int, int]
    backend: str = "?"
    threads: int | None = None
    busy_s: float = 0.0
    #: Seconds handing stage calls to the worker thread and back, and in link sends to the successor.
    handoff_s: float = 0.0
    send_s: float = 0.0
    ready: bool = False
    uptime_s: float = 0.0
    ranks: tuple[RankStatus, ...] = ()
    predecessor: LinkStatus = LinkStatus()
    successor: LinkStatus = LinkStatus()
    requests: RequestCounters = RequestCounters()
    rss_bytes: int | None = None
    #: The market's coverage map of this ring; None for a node started from a manifest.
    market: tuple[MarketWindow, ...] | None = None
    failover: FailoverStatus = FailoverStatus()
    #: Under ``kvasir ring up``: its supervisor's view of every process of the ring (None: a node on its own).
    supervisor: SupervisorStatus | None = None

    @property
    def layer_tokens(self) -> int:
        """Tokens this node moved, weighted by the layers it ran for each (what its work was worth)."""
        return self.requests.tokens * (self.window[1] - self.window[0])

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "status") -> NodeStatus:
        """The status in ``obj``; SchemaError (an InputError) naming the field when it does not fit."""
        return structure(obj, cls, where=where)


# ---------------------------------------------------------------------------------------------- the wire shape
# The status object nests what NodeStatus keeps flat (``model``, ``links``, ``memory``) and adds ``contribution``,
# which a reader derives again; these records are that shape, field order = key order.


@attrs.frozen
class _ModelWire:
    name: str = ""
    sha256: str = ""
    layers: int = 0


@attrs.frozen
class _LinksWire:
    predecessor: LinkStatus = LinkStatus()
    successor: LinkStatus = LinkStatus()


@attrs.frozen
class _ContributionWire:
    tokens: int = 0
    layer_tokens: int = 0


@attrs.frozen
class _MemoryWire:
    rss_bytes: int | None = None


@attrs.frozen(kw_only=True)
class _StatusWire:
    node_id: str = ""
    rank: int
    ring_size: int = 0
    model: _ModelWire = _ModelWire()
    window: tuple[int, int]
    backend: str = "?"
    threads: int | None = None
    busy_s: float = 0.0
    handoff_s: float = 0.0
    send_s: float = 0.0
    ready: bool = False
    uptime_s: float = 0.0
    ranks: tuple[RankStatus, ...] = ()
    links: _LinksWire = _LinksWire()
    requests: RequestCounters = RequestCounters()
    contribution: _ContributionWire = _ContributionWire()
    memory: _MemoryWire = _MemoryWire()
    market: tuple[MarketWindow, ...] | None = None
    failover: FailoverStatus = FailoverStatus()
    supervisor: SupervisorStatus | None = None


def _status_from_wire(data: object, _: type) -> NodeStatus:
    w = converter.structure(require_object(data), _StatusWire)
    return NodeStatus(
        node_id=w.node_id,
        rank=w.rank,
        ring_size=w.ring_size,
        model_name=w.model.name,
        model_sha256=w.model.sha256,
        n_layers=w.model.layers,
        window=w.window,
        backend=w.backend,
        threads=w.threads,
        busy_s=w.busy_s,
        handoff_s=w.handoff_s,
        send_s=w.send_s,
        ready=w.ready,
        uptime_s=w.uptime_s,
        ranks=w.ranks,
        predecessor=w.links.predecessor,
        successor=w.links.successor,
        requests=w.requests,
        rss_bytes=w.memory.rss_bytes,
        market=w.market,
        failover=w.failover,
        supervisor=w.supervisor,
    )


def _status_to_wire(s: NodeStatus) -> Json:
    out: Json = unstructure(
        _StatusWire(
            node_id=s.node_id,
            rank=s.rank,
            ring_size=s.ring_size,
            model=_ModelWire(s.model_name, s.model_sha256, s.n_layers),
            window=s.window,
            backend=s.backend,
            threads=s.threads,
            busy_s=s.busy_s,
            handoff_s=s.handoff_s,
            send_s=s.send_s,
            ready=s.ready,
            uptime_s=s.uptime_s,
            ranks=s.ranks,
            links=_LinksWire(s.predecessor, s.successor),
            requests=s.requests,
            contribution=_ContributionWire(s.requests.tokens, s.layer_tokens),
            memory=_MemoryWire(s.rss_bytes),
            market=s.market,
            failover=s.failover,
            supervisor=s.supervisor,
        )
    )
    return out


_link_from_wire, _link_fields = record_hooks(LinkStatus)


def _link_to_wire(link: LinkStatus) -> Json:
    # A link that is down travels as its state label only.
    return {"state": link.state} if link.kind is None else _link_fields(link)


register_hooks(LinkStatus, _link_from_wire, _link_to_wire)
register_record(RankStatus)
register_record(RequestCounters)
register_record(FailoverStatus)
register_record(MarketWindow)
register_record(SupervisedProcess)
register_record(SupervisorStatus)
register_record(_ModelWire)
register_record(_LinksWire)
register_record(_ContributionWire)
register_record(_MemoryWire, omit_if_none=("rss_bytes",))
register_record(_StatusWire, omit_if_none=("supervisor",))  # absent for a node that no ring up supervises
register_hooks(NodeStatus, _status_from_wire, _status_to_wire)


def speculation_line(req: Mapping[str, Any] | RequestCounters) -> str:
    """The last rank's speculation counters (docs/speculation.md): verify batches, drafts accepted, eager steps.
    ``req``: the counters, or a status's ``requests`` object (read strictly: SchemaError on a wrong type)."""
    c = req if isinstance(req, RequestCounters) else RequestCounters.from_wire(req)
    share = f" ({c.accepted / c.drafted:.0%})" if c.drafted else ""
    return (
        f"{c.verify_batches} verify batches · {c.accepted}/{c.drafted} drafts accepted{share}"
        f" · {c.eager_steps} steps drafted eagerly"
    )


def rss_bytes() -> int:
    """This process's resident memory (its peak where /proc is missing)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
