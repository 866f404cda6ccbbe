"""Server-sent events as an engine streams them: complete lines out of network chunks (pure, no I/O).

An upstream stream arrives in chunks that cut lines anywhere (mid-line, between ``\\r`` and ``\\n``, inside
a JSON payload). Every relay acts on complete lines only and writes once per chunk received, not per line
(fewer writes under load). The decode relay and a migrated stream's continuation (``router.relay``) both
split their input here; what each does with a line (strip params, count token ids, rewrite) is theirs.
"""

from __future__ import annotations

DONE = b"[DONE]"


class LineCollector:
    """Feeds chunks, returns the lines they complete (line endings kept); an unfinished line waits."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete lines ``chunk`` finishes, in order, each with its ending (``\\n``, ``\\r\\n`` or ``\\r``)."""
        pending = self._pending + chunk if self._pending else chunk
        cut = pending.rfind(b"\n") + 1
        if not cut:
            self._pending = pending
            return []
        self._pending = pending[cut:]
        return pending[:cut].splitlines(keepends=True)

    def flush(self) -> bytes:
        """What is left without a line ending (the stream ended mid-line), and forget it."""
        rest, self._pending = self._pending, b""
        return rest


def data_of(line: bytes) -> bytes | None:
    """The payload of a ``data:`` line, stripped (``[DONE]`` included), or None for any other line (comments,
    the blank line ending an event, other fields). One optional space after the colon, as the SSE spec says."""
    if not line.startswith(b"data:"):
        return None
    return line[5:].strip()
