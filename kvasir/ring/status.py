"""A node's status: one typed record that the control socket serialises and the TUI parses (the same schema).

``to_wire()`` gives the JSON object of the control socket's ``status`` message (docs/protocol.md § Control socket);
``from_wire()`` reads one back. Reading is lenient about absent fields (older nodes, recorded sessions), strict about
types: a field of the wrong type raises ValueError (or TypeError), which the TUI shows as a bad message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvasir.ring.links import LinkStats

Json = dict[str, Any]


def _int(obj: Mapping[str, Any], key: str, default: int = 0) -> int:
    v = obj.get(key, default)
    return default if v is None else int(v)


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _pair(v: Any) -> tuple[int, int]:
    a, b = v
    return int(a), int(b)


def _obj(v: Any) -> Mapping[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"expected a JSON object, got {type(v).__name__}")
    return v


@attrs.frozen
class LinkStatus:
    """One link: its state label, and its counters while it is up (``kind`` is None while it is down)."""

    state: str
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
        w = stats.to_json()
        return cls.from_wire({"state": state, **w})

    @property
    def up(self) -> bool:
        return self.kind is not None

    def to_wire(self) -> Json:
        if self.kind is None:
            return {"state": self.state}
        return {
            "state": self.state,
            "kind": self.kind,
            "peer": self.peer,
            "frames_out": self.frames_out,
            "bytes_out": self.bytes_out,
            "frames_in": self.frames_in,
            "bytes_in": self.bytes_in,
            "rtt_ms": self.rtt_ms,
            "up_s": self.up_s,
            "secure": self.secure,
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> LinkStatus:
        obj = _obj(obj)
        kind = obj.get("kind")
        return cls(
            state=str(obj.get("state", "unknown")),
            kind=None if kind is None else str(kind),
            peer=None if obj.get("peer") is None else str(obj["peer"]),
            frames_out=_int(obj, "frames_out"),
            bytes_out=_int(obj, "bytes_out"),
            frames_in=_int(obj, "frames_in"),
            bytes_in=_int(obj, "bytes_in"),
            rtt_ms=_float_or_none(obj.get("rtt_ms")),
            up_s=_float_or_none(obj.get("up_s")),
            secure=obj.get("secure") is True,
        )


@attrs.frozen
class RankStatus:
    """One rank of the manifest as this node knows it."""

    rank: int
    layers: tuple[int, int]
    address: str
    link: str = "direct"

    def to_wire(self) -> Json:
        return {"rank": self.rank, "layers": list(self.layers), "address": self.address, "link": self.link}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> RankStatus:
        obj = _obj(obj)
        return cls(int(obj["rank"]), _pair(obj["layers"]), str(obj.get("address", "")), str(obj.get("link", "direct")))


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
        return attrs.asdict(self)

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> RequestCounters:
        obj = _obj(obj)
        return cls(**{f.name: _int(obj, f.name) for f in attrs.fields(cls)})


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
        return {
            "replays": self.replays,
            "requests": self.requests,
            "frames": self.frames,
            "bytes": self.bytes,
            "duplicates": self.duplicates,
            "last_stall_s": self.last_stall_s,
            "last_window": None if self.last_window is None else list(self.last_window),
            "log_bytes": self.log_bytes,
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> FailoverStatus:
        obj = _obj(obj)
        window = obj.get("last_window")
        return cls(
            replays=_int(obj, "replays"),
            requests=_int(obj, "requests"),
            frames=_int(obj, "frames"),
            bytes=_int(obj, "bytes"),
            duplicates=_int(obj, "duplicates"),
            last_stall_s=_float_or_none(obj.get("last_stall_s")),
            last_window=None if window is None else _pair(window),
            log_bytes=_int(obj, "log_bytes"),
        )


@attrs.frozen
class MarketWindow:
    """One window of the market's coverage map (a self-enrolled node's view of its ring)."""

    rank: int
    layers: tuple[int, int]
    holder: str | None
    reward: float | None
    state: str | None

    def to_wire(self) -> Json:
        return {
            "rank": self.rank,
            "layers": list(self.layers),
            "holder": self.holder,
            "reward": self.reward,
            "state": self.state,
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> MarketWindow:
        obj = _obj(obj)
        holder = obj.get("holder")
        return cls(
            int(obj["rank"]),
            _pair(obj["layers"]),
            None if holder is None else str(holder),
            _float_or_none(obj.get("reward")),
            None if obj.get("state") is None else str(obj["state"]),
        )


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
    predecessor: LinkStatus = LinkStatus("unknown")
    successor: LinkStatus = LinkStatus("unknown")
    requests: RequestCounters = RequestCounters()
    rss_bytes: int | None = None
    #: The market's coverage map of this ring; None for a node started from a manifest.
    market: tuple[MarketWindow, ...] | None = None
    failover: FailoverStatus = FailoverStatus()

    @property
    def layer_tokens(self) -> int:
        """Tokens this node moved, weighted by the layers it ran for each (what its work was worth)."""
        return self.requests.tokens * (self.window[1] - self.window[0])

    def to_wire(self) -> Json:
        return {
            "node_id": self.node_id,
            "rank": self.rank,
            "ring_size": self.ring_size,
            "model": {"name": self.model_name, "sha256": self.model_sha256, "layers": self.n_layers},
            "window": list(self.window),
            "backend": self.backend,
            "threads": self.threads,
            "busy_s": self.busy_s,
            "handoff_s": self.handoff_s,
            "send_s": self.send_s,
            "ready": self.ready,
            "uptime_s": self.uptime_s,
            "ranks": [r.to_wire() for r in self.ranks],
            "links": {"predecessor": self.predecessor.to_wire(), "successor": self.successor.to_wire()},
            "requests": self.requests.to_wire(),
            "contribution": {"tokens": self.requests.tokens, "layer_tokens": self.layer_tokens},
            "memory": {} if self.rss_bytes is None else {"rss_bytes": self.rss_bytes},
            "market": None if self.market is None else [w.to_wire() for w in self.market],
            "failover": self.failover.to_wire(),
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NodeStatus:
        obj = _obj(obj)
        model = _obj(obj.get("model"))
        links = _obj(obj.get("links"))
        market = obj.get("market")
        threads = obj.get("threads")
        rss = _obj(obj.get("memory")).get("rss_bytes")
        ranks: Sequence[Any] = obj.get("ranks") or ()
        return cls(
            node_id=str(obj.get("node_id", "")),
            rank=int(obj["rank"]),
            ring_size=_int(obj, "ring_size"),
            model_name=str(model.get("name", "")),
            model_sha256=str(model.get("sha256", "")),
            n_layers=_int(model, "layers"),
            window=_pair(obj["window"]),
            backend=str(obj.get("backend", "?")),
            threads=None if threads is None else int(threads),
            busy_s=float(obj.get("busy_s") or 0.0),
            handoff_s=float(obj.get("handoff_s") or 0.0),
            send_s=float(obj.get("send_s") or 0.0),
            ready=bool(obj.get("ready", False)),
            uptime_s=float(obj.get("uptime_s") or 0.0),
            ranks=tuple(RankStatus.from_wire(r) for r in ranks),
            predecessor=LinkStatus.from_wire(links.get("predecessor") or {}),
            successor=LinkStatus.from_wire(links.get("successor") or {}),
            requests=RequestCounters.from_wire(obj.get("requests") or {}),
            rss_bytes=None if rss is None else int(rss),
            market=None if market is None else tuple(MarketWindow.from_wire(w) for w in market),
            failover=FailoverStatus.from_wire(obj.get("failover") or {}),
        )


def speculation_line(req: Mapping[str, Any]) -> str:
    """The last rank's speculation counters (docs/speculation.md): verify batches, drafts accepted, eager steps."""
    drafted, accepted = int(req.get("drafted") or 0), int(req.get("accepted") or 0)
    share = f" ({accepted / drafted:.0%})" if drafted else ""
    return (
        f"{req.get('verify_batches', 0)} verify batches · {accepted}/{drafted} drafts accepted{share}"
        f" · {req.get('eager_steps', 0)} steps drafted eagerly"
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
