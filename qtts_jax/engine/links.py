"""The two ends of a host-core link: `send(batch)`, `recv() -> batch`, `close()`.

A core process's link is a `multiprocessing` pipe (`Connection`: pickled batches over a socket pair, stdlib, measured
in bench/core_hop.py); a core on a thread's is a pair of queues (`thread_links`) carrying the same batches
unpickled."""

from __future__ import annotations

import queue
from typing import Any, Protocol


class Link(Protocol):
    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def close(self) -> None: ...


_CLOSED = object()


class QueueLink:
    """One end of a link between two threads; `recv` raises EOFError once either end closed."""

    def __init__(self, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue):
        self._in, self._out = inbox, outbox
        self._closed = False

    def send(self, obj: Any) -> None:
        if self._closed:
            raise OSError("link closed")
        self._out.put(obj)

    def recv(self) -> Any:
        obj = self._in.get()
        if obj is _CLOSED:
            self._closed = True
            self._in.put(_CLOSED)  # every later recv ends too
            raise EOFError
        return obj

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._out.put(_CLOSED)
            self._in.put(_CLOSED)


def thread_links() -> tuple[QueueLink, QueueLink]:
    """Both ends of a link within a process: (one end, the other)."""
    a, b = queue.SimpleQueue(), queue.SimpleQueue()
    return QueueLink(a, b), QueueLink(b, a)
