"""Server-sent events as an engine streams them: complete lines out of network chunks (pure, no I/O).

An upstream stream arrives in chunks that cut lines anywhere (mid-line, between ``\\r`` and ``\\n``, inside
a JSON payload). Every relay acts on complete lines only and writes once per chunk received, not per line
(fewer writes under load). The decode relay and a migrated stream's continuation (``router.relay``) both
split their input here; what each does with a line (strip params, count token ids, rewrite) is theirs.
"""

from __future__ import annotations

from router.upstream import EngineHTTPError

DONE = b"[DONE]"


#: Longest line an engine may send (a bound on what waits for its line ending): far above any SSE event.
MAX_LINE = 8 * 1024 * 1024


class LineTooLong(EngineHTTPError):
    """An engine sent more than ``MAX_LINE`` bytes without a line ending: treated as a failed engine leg."""


class LineCollector:
    """Feeds chunks, returns the lines they complete (line endings kept); an unfinished line waits, up to
    ``max_line`` bytes (LineTooLong past it)."""

    __slots__ = ("_pending", "max_line")

    def __init__(self, max_line: int | None = None) -> None:
        self._pending = b""
        self.max_line = MAX_LINE if max_line is None else max_line

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete lines ``chunk`` finishes, in order, each with its ending (``\\n``, ``\\r\\n`` or ``\\r``)."""
        pending = self._pending + chunk if self._pending else chunk
        cut = pending.rfind(b"\n") + 1
        if len(pending) - cut > self.max_line:
            self._pending = b""
            raise LineTooLong(f"the engine sent a line longer than {self.max_line} bytes")
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
