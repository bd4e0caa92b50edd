"""Per-request state a node keeps, its request table, and what the entry node streams to its client."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

import attrs
import trio

from kvasir.core.errors import InputError, InvalidRequest, ProtocolError, RequestRefused
from kvasir.core.sampling import MAX_SEED, SamplingParams
from kvasir.core.speculate import Drafter, SpeculationStats
from kvasir.core.stops import find_stop
from kvasir.ring.compute import RingStage, TokenSampler
from kvasir.ring.events import EndListeners, EventHub, RequestEnded, RequestStarted, TokenPassed
from kvasir.ring.speculation import CacheEnd, DraftPayoff, TokenTrail, VerifyBatch
from kvasir.ring.status import RequestCounters
from kvasir.wire import End, EndReason, ErrorCode, Frame, StartRequest, request_params_hash

log = logging.getLogger("kvasir.node")


class TextDecoder(Protocol):
    """Token pieces to text deltas (kvasir.stage.vocab.TextStream)."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


@attrs.frozen
class TokenEvent:
    index: int
    token: int
    text: str


@attrs.frozen
class EndEvent:
    reason: str  # eog | max_tokens | stop | cancelled | error
    prompt_tokens: int
    generated_tokens: int
    text: str = ""
    error: str | None = None
    #: For reason "error": the ring's error code name (e.g. "bad_request", "context_full", "overloaded").
    code: str | None = None
    #: For reason "error": the rank whose ERROR frame ended the request (its ``error`` text is that member's words,
    #: not this node's: the API shows its clients a fixed message instead, review N18); None when this node ended it.
    origin: int | None = None


ClientEvent = TokenEvent | EndEvent


class SeqPool:
    """Sequence ids of this node's stage context; each in-flight request holds one."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, seq: int) -> None:
        self._free.append(seq)

    @property
    def free(self) -> int:
        return len(self._free)


class EntryStream:
    """What the client of the entry node receives: text deltas that never show part of a stop string, and never more
    than the client asked, whatever the ring sends (issue 24, N3 and N8)."""

    def __init__(self, text_stream: TextDecoder, stop: Sequence[str], max_tokens: int) -> None:
        self._text = text_stream
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._buffer = ""
        self.emitted = ""
        self.max_tokens = max_tokens
        #: The client's stop string showed up in the text: the ring must end the request at this token.
        self.stopped = False
        # Bounded by the request itself: at most max_tokens token events, a tail and one end event (push refuses
        # more, so a full channel never raises into the link task that streams).
        self.send, self.receive = trio.open_memory_channel[ClientEvent](max_tokens + 2)

    def push(self, index: int, token: int) -> None:
        """Stream token ``index``; RequestRefused (PARAMS_MISMATCH) when the ring goes on past what the client asked:
        beyond ``max_tokens`` or after a stop string (an honest last rank ends the request there, so a member altered
        the START). Nothing past it reaches the client or the token count."""
        if index >= self.max_tokens or self.stopped:
            past = f"max_tokens {self.max_tokens}" if index >= self.max_tokens else "stop string"
            raise RequestRefused(
                ErrorCode.PARAMS_MISMATCH,
                f"the ring sent token {index} past the client's {past}: the START was altered on the way",
            )
        self._buffer += self._text.push(token)
        safe = self._buffer
        cut = find_stop(self.emitted + safe, self._stop)
        if cut is not None:
            safe = (self.emitted + safe)[:cut][len(self.emitted) :]
            self.stopped = True
        elif self._hold:
            safe = safe[: max(0, len(safe) - self._hold)]
        self._buffer = self._buffer[len(safe) :]
        self.emitted += safe
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):  # the client left: it cancels
            self.send.send_nowait(TokenEvent(index, token, safe))

    def finish(
        self,
        reason: str,
        prompt_tokens: int,
        generated: int,
        error: str | None = None,
        code: str | None = None,
        origin: int | None = None,
    ) -> None:
        rest = self._buffer + (self._text.flush() if reason != "stop" else "")
        full = self.emitted + rest
        cut = find_stop(full, self._stop)
        if cut is not None:
            full = full[:cut]
        tail = full[len(self.emitted) :] if len(full) > len(self.emitted) else ""
        self.emitted += tail
        try:
            if tail:
                self.send.send_nowait(TokenEvent(-1, -1, tail))
            self.send.send_nowait(EndEvent(reason, prompt_tokens, generated, self.emitted, error, code, origin))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        self.send.close()


@attrs.define
class RequestState:
    start: StartRequest
    seq: int
    #: Tokens seen passing this node (index of the next expected one).
    seen: int = 0
    generated: int = 0
    #: Last rank: the request's sampler chain (built in the worker thread of its first sample).
    sampler: TokenSampler | None = None
    #: Last rank only: detokenized output, for stop strings.
    text_stream: TextDecoder | None = None
    text: str = ""
    entry: EntryStream | None = None
    done: bool = False
    #: Held while the stage computes for this request, so its sequence is never freed mid-compute.
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    #: When a frame of this request last passed this node (trio's clock); the stale-request reaper reads it.
    touched: float = attrs.field(factory=trio.current_time)
    #: The replay log: every data frame this node sent its successor for this request (its START, then its boundaries
    #: or, at the last rank, its tokens), in order, with their original chunk and step schedule. When the successor's
    #: window comes back after a failure, these rebuild its state exactly. Freed when the request ends here.
    sent: list[Frame] = attrs.field(factory=list)
    sent_bytes: int = 0
    #: What arrived from the predecessor, by (position, row of a verify batch): a digest of each boundary (or, at
    #: rank 0, the token ids). A replayed frame for a key seen before must match it (then it is dropped); a difference
    #: is an error.
    received: dict[tuple[int, int], bytes] = attrs.field(factory=dict)
    #: Rank 0: set once its prompt is prefilled (a replay can bring the tokens before a rebuilt prefill is done).
    prefilled: trio.Event = attrs.field(factory=trio.Event)
    #: Speculative decoding (kvasir.ring.speculation): where this node's cache of the request ends, the latest
    #: verify batch seen (for streaming its accepted drafts) and, at the last rank, the drafting state.
    cache: CacheEnd = attrs.field(factory=CacheEnd)
    trail: TokenTrail = attrs.field(factory=TokenTrail)
    drafter: Drafter | None = None
    #: Last rank: the verify batch whose rows are arriving (the last one begun), and when the step now going round
    #: was sent (trio's clock; for the drafting policy's RingPace).
    verifying: VerifyBatch | None = None
    step_sent_at: float | None = None
    #: Last rank: when the latest step's tokens were sampled (a trip runs from one to the next, drafting included),
    #: and whether eager drafting pays (``--draft-policy auto``).
    sampled_at: float | None = None
    payoff: DraftPayoff = attrs.field(factory=DraftPayoff)

    @property
    def request_id(self) -> int:
        return self.start.request_id

    @property
    def prompt_len(self) -> int:
        return self.start.prompt_length


def start_needs_tokens(receiver: int, entry: int, size: int, *, penalties: bool) -> bool:
    """Whether the START sent to ``receiver`` must carry the prompt's token ids (pure).

    Only rank 0 needs them (it embeds the prompt), and the last rank when repeat penalties look at the prompt; a START
    goes from its entry round to the rank before it, so it carries them while one of those is still ahead.
    """
    needed = {0, size - 1} if penalties else {0}
    k = receiver % size
    for _ in range(size):
        if k == entry:
            return False
        if k in needed:
            return True
        k = (k + 1) % size
    return False


def client_start(
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    stop: Sequence[str],
    speculate: int,
    entry_rank: int,
    entry_node_id: str,
    client_auth: str = "",
) -> StartRequest:
    """A client's request as its START (a fresh request id); InputError (InvalidRequest past a wire limit) when the
    client asked for something no ring serves. ``client_auth``: the client's signed authorisation, carried as is."""
    if not prompt:
        raise InputError("empty prompt")
    if max_tokens < 1:
        raise InputError("max_tokens must be at least 1")
    if params.temperature != 0.0 and params.seed is None:
        # Fixed here, at the entry: a last rank rebuilt after a failure replays the same draws.
        params = attrs.evolve(params, seed=secrets.randbelow(MAX_SEED + 1))
    try:
        start = StartRequest(
            request_id=secrets.randbits(63) | 1,
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            entry_rank=entry_rank,
            entry_node_id=entry_node_id,
            sampling=params,
            stop=tuple(stop),
            speculate=speculate,
            client_auth=client_auth,
        )
    except ProtocolError as exc:  # beyond a wire limit (prompt length, stop strings…): the client's input
        raise InvalidRequest(ErrorCode.BAD_REQUEST, str(exc)) from None
    # The entry's commitment to what its client asked: every node checks it, the last rank echoes it in END.
    return attrs.evolve(start, params_hash=request_params_hash(start))


def params_problem(start: StartRequest) -> str | None:
    """Why ``start``'s parameters are not the ones its parameters hash commits to (altered on the way), or None
    (pure). A START without a hash has nothing to check here: its entry finds the missing echo in END."""
    if not start.params_hash or request_params_hash(start) == start.params_hash:
        return None
    return "the START's parameters are not the ones its entry committed to (altered on the way)"


def check_params(start: StartRequest, rank: int) -> None:
    """RequestRefused (PARAMS_MISMATCH) when ``start`` reached rank ``rank`` altered (:func:`params_problem`)."""
    if (problem := params_problem(start)) is not None:
        raise RequestRefused(ErrorCode.PARAMS_MISMATCH, f"rank {rank}: {problem}")


def end_problem(start: StartRequest, end: End, *, entry: bool) -> str | None:
    """Why an END does not echo the parameters hash of the START this node holds (its entry's commitment, at the
    entry), or None (pure). Every node compares: one that got its START after the last rank (rank 0, which embeds
    the prompt) catches a last rank that served one START and forwarded another."""
    if not start.params_hash or end.params_hash == start.params_hash:
        return None
    echoed = end.params_hash.hex()[:16] + "…" if end.params_hash else "none"
    mine = "this entry committed" if entry else "this node's START has"
    return (
        f"the last rank served other parameters than the client asked (parameters hash {echoed}, {mine}"
        f" {start.params_hash.hex()[:16]}…): the START was altered on the way"
    )


def outgoing_start(start: StartRequest, rank: int, size: int) -> StartRequest:
    """START as the successor of rank ``rank`` gets it (pure): the prompt's token ids only while a node ahead needs
    them (the last rank needs them for repeat penalties, and to draft from when the request speculates)."""
    penalties = uses_penalties(start.sampling) or start.speculate > 0
    if start_needs_tokens((rank + 1) % size, start.entry_rank, size, penalties=penalties):
        return start
    return start.withheld()


def uses_penalties(params: SamplingParams) -> bool:
    """Whether the sampler's repeat penalties read the prompt (greedy ignores every other setting)."""
    return params.temperature != 0.0 and params.repeat_penalty != 1.0 and params.repeat_last_n != 0


#: How many ended requests a node remembers (ids only), to tell a replayed START from a new one.
ENDED_MEMORY = 4096

REASONS = {
    EndReason.EOG: "eog",
    EndReason.MAX_TOKENS: "max_tokens",
    EndReason.STOP: "stop",
    EndReason.CANCELLED: "cancelled",
    EndReason.ERROR: "error",
}


class RequestTable:
    """The requests in flight at one node: registration (with admission and the sequence pool), token accounting,
    finishing (which frees the sequence) and the reaper of requests that stopped making progress.

    Refusals are typed: :class:`InvalidRequest` (BAD_REQUEST, CONTEXT_FULL) or :class:`RequestRefused`
    (OVERLOADED), each carrying the ERROR code the node answers the ring with.
    """

    def __init__(self, stage: RingStage, hub: EventHub, rank: int) -> None:
        self.stage = stage
        self.hub = hub
        self.rank = rank
        n = stage.config.n_seq_max
        self._states: dict[int, RequestState] = {}
        #: Requests that ended here lately, so that a replayed START of one is not taken for a new request.
        self._ended: OrderedDict[int, None] = OrderedDict()
        self._seqs = SeqPool(n)
        #: Client requests entering at this node wait here for a sequence instead of being refused.
        self.admission = trio.Semaphore(n)
        self.requests = 0
        self.tokens = 0
        self.boundaries = 0
        self.errors = 0
        #: Lossless: every request that ended here, once its compute is over (receipts, the market agent's ledger).
        self.on_end = EndListeners()
        self.speculation = SpeculationStats()

    def count_error(self) -> None:
        self.errors += 1

    def get(self, request_id: int) -> RequestState | None:
        return self._states.get(request_id)

    def ended(self, request_id: int) -> bool:
        """Whether ``request_id`` ended here lately (the last :data:`ENDED_MEMORY` requests)."""
        return request_id in self._ended

    @property
    def replay_bytes(self) -> int:
        """Bytes the replay logs of the requests in flight hold."""
        return sum(state.sent_bytes for state in self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    @property
    def free_sequences(self) -> int:
        return self._seqs.free

    def counters(self) -> RequestCounters:
        s = self.speculation
        return RequestCounters(
            len(self._states), self._seqs.free, self.requests, self.tokens, self.boundaries, self.errors,
            s.verify_batches, s.drafted, s.accepted, eager_steps=s.eager_steps,
        )  # fmt: skip

    def register(
        self,
        start: StartRequest,
        entry: EntryStream | None,
        *,
        check_vocab: bool,
    ) -> RequestState:
        """Take a sequence for ``start`` (the last rank builds its sampler at its first sample, off the loop)."""
        if start.request_id in self._states:
            raise InvalidRequest(ErrorCode.BAD_REQUEST, f"request {start.request_id:x} is already in flight")
        n_ctx = self.stage.config.n_ctx
        if start.prompt_length + start.max_tokens > n_ctx:
            raise InvalidRequest(
                ErrorCode.CONTEXT_FULL,
                f"prompt ({start.prompt_length}) + max_tokens ({start.max_tokens}) exceed the context of {n_ctx}",
            )
        check_params(start, self.rank)
        if check_vocab and start.prompt:  # a withheld START was checked by the nodes that hold the tokens
            try:
                self.stage.vocab.check_tokens(start.prompt)
            except InputError as exc:
                raise InvalidRequest(ErrorCode.BAD_REQUEST, str(exc)) from None
        seq = self._seqs.take()
        if seq is None:
            raise RequestRefused(
                ErrorCode.OVERLOADED,
                f"rank {self.rank} has no free sequence (all {self.stage.config.n_seq_max} in use)",
            )
        state = RequestState(start=start, seq=seq, entry=entry)
        self._states[start.request_id] = state
        self.requests += 1
        self.hub.publish(RequestStarted(start.request_id, start.prompt_length, start.entry_rank))
        return state

    def see(self, state: RequestState, index: int, token: int) -> None:
        """A token of ``state`` passes this node; each index is handled once."""
        if index != state.seen:
            return
        if state.entry is not None:  # first: a token the client did not ask for is neither streamed nor counted
            state.entry.push(index, token)
        state.seen += 1
        self.tokens += 1
        self.hub.publish(
            TokenPassed(state.request_id, index, token, self.stage.vocab.piece(token).decode("utf-8", "replace"))
        )

    def see_step(self, state: RequestState, pos: int, tokens: Sequence[int]) -> None:
        """A decode step at ``pos`` feeding ``tokens`` passes: its first token, after the drafts of the step before
        that it shows accepted (speculation: they are emitted once the next step starts past them)."""
        for position, token in state.trail.step(pos, tokens):
            if position >= state.prompt_len:
                self.see(state, position - state.prompt_len, token)

    def see_end(self, state: RequestState, end: End, chain_problem: str | None = None) -> None:
        """An END says ``generated`` tokens, the last being ``latest`` (−1: none sent, e.g. EOG): the last verify
        batch's accepted drafts are in the batch seen last, then comes the last token. RequestRefused, before any of
        them is seen, when ``chain_problem`` (this node requires the last rank's chain head: issue 24, N9) or when END
        does not echo the parameters hash of this node's START (N8: at the entry, the one it committed to)."""
        if chain_problem is not None:
            raise RequestRefused(ErrorCode.CHAIN_MISMATCH, f"rank {self.rank}: {chain_problem}")
        if (problem := end_problem(state.start, end, entry=state.entry is not None)) is not None:
            raise RequestRefused(ErrorCode.PARAMS_MISMATCH, f"rank {self.rank}: {problem}")
        generated, latest = end.generated_tokens, end.latest_token
        upto = state.prompt_len + generated - (1 if latest >= 0 else 0)
        for position, token in state.trail.confirmed(upto):
            if position >= state.prompt_len:
                self.see(state, position - state.prompt_len, token)
        if latest >= 0 and generated > state.seen:
            self.see(state, generated - 1, latest)

    async def finish(
        self,
        state: RequestState,
        reason: str,
        error: str | None = None,
        code: ErrorCode | None = None,
        origin: int | None = None,
    ) -> None:
        """End ``state`` here: free its sequence (after any compute of it), then tell its client; ``origin``: the
        rank whose ERROR frame ended it (None: this node did)."""
        if state.done:
            return
        state.done = True
        self._states.pop(state.request_id, None)
        self._ended[state.request_id] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        state.sent.clear()  # the replay log: nothing will need it now
        state.sent_bytes = 0
        state.received.clear()
        state.prefilled.set()  # anything waiting for the prefill sees the request done
        try:
            # Wait out a compute of this request before its sequence is reused. Shielded: a caller that gives up
            # (a client's cancel with a deadline, a shutdown) must not leak the sequence; the wait is one compute.
            with trio.CancelScope(shield=True):
                async with state.lock:
                    await self.stage.run(self.stage.free_sequence, state.seq)
                    if state.drafter is not None:  # a draft model's sequence too, before the sequence is reused
                        if state.drafter.blocking:
                            await trio.to_thread.run_sync(state.drafter.close)
                        else:
                            state.drafter.close()
                    self._seqs.give(state.seq)
                    if state.sampler is not None:
                        state.sampler.close()
                        state.sampler = None
        finally:
            # Only now tell the client: once it leaves, its admission slot lets the next request in, which must
            # find this sequence free.
            if state.entry is not None:
                name = code.name.lower() if code else None
                state.entry.finish(reason, state.prompt_len, state.seen, error, name, origin)
        ended = RequestEnded(state.request_id, reason, state.seen, error, state.start.entry_rank)
        # Lossless, before the observers' lossy copy; only the market's ledger needs the client's authorisation.
        self.on_end.emit(attrs.evolve(ended, client_auth=state.start.client_auth or None))
        self.hub.publish(ended)

    async def reap(self, limit: float) -> None:
        """Free requests nothing has happened to for ``limit`` seconds; runs until cancelled.

        The entry node gives up on a stalled request and sends CANCEL; a node that never hears it (its entry died, a
        link stayed down) would otherwise keep the request's sequence forever.
        """
        while True:
            await trio.sleep(max(0.05, limit / 4))
            now = trio.current_time()
            for state in self:
                if not state.done and now - state.touched > limit:
                    log.warning(
                        "rank %d: request %x made no progress for %.0f s; freeing it",
                        self.rank,
                        state.request_id,
                        limit,
                    )
                    # Nothing came round: a frame or a node of the ring is gone (llama.cpp did not fail here).
                    message = f"no progress for {limit:.0f} s at rank {self.rank}"
                    await self.finish(state, "error", message, ErrorCode.LINK_LOST)
