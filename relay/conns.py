"""The relay's connection table: caps that one address, or a crowd of strangers, cannot use up (security N5).

A connection is *unauthenticated* from its TCP accept until its edge token is admitted at the WebSocket upgrade.
Caps apply per address group (an IPv4 /24 or an IPv6 /64: :func:`kvasir.util.addrgroup.network_group`) and in
all. When a newcomer's group is full, it takes the place of that group's oldest unauthenticated connection; when
the relay is full, of the oldest unauthenticated connection of any group. Only when every connection in the way is
authenticated is the newcomer refused, and a refused newcomer is never counted, so connections over a group's cap
never count toward the global one. Authenticated connections are never evicted.

Pure bookkeeping (no I/O): the relay cancels an evicted connection's ``scope``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio


@attrs.define(eq=False)
class Conn:
    """One counted connection (in-process state); ``scope`` closes it when it is evicted."""

    group: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Its edge token was admitted at the upgrade: never evicted from then on.
    authenticated: bool = False


class ConnTable:
    """The connections a relay counts, oldest first, with ``per_group`` and ``total`` caps."""

    def __init__(self, per_group: int, total: int) -> None:
        self.per_group = per_group
        self.total = total
        self._conns: list[Conn] = []
        self._groups: dict[str, int] = {}
        #: Unauthenticated connections closed to make room for newer ones.
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._conns)

    def group_count(self, group: str) -> int:
        return self._groups.get(group, 0)

    def admit(self, group: str) -> Conn | None:
        """A place for a new connection from ``group``, evicting the oldest unauthenticated connection in its way
        (its scope is cancelled); None: refused, every connection in the way is authenticated."""
        if self.group_count(group) >= self.per_group:
            if not self._evict_oldest(lambda c: c.group == group):
                return None
        elif len(self._conns) >= self.total and not self._evict_oldest(lambda c: True):
            return None
        conn = Conn(group)
        self._conns.append(conn)
        self._groups[group] = self.group_count(group) + 1
        return conn

    def release(self, conn: Conn) -> None:
        """``conn`` closed (an evicted one was released when it was evicted)."""
        if conn in self._conns:
            self._conns.remove(conn)
            left = self._groups[conn.group] - 1
            if left:
                self._groups[conn.group] = left
            else:
                del self._groups[conn.group]

    def _evict_oldest(self, where: Callable[[Conn], bool]) -> bool:
        for conn in self._conns:
            if not conn.authenticated and where(conn):
                conn.scope.cancel()
                self.release(conn)
                self.evictions += 1
                return True
        return False
