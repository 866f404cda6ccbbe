"""The pure parts of the schedule simulation: labelled KV content, conversations' tokens, the oracle, the trace.

Nothing here imports vLLM or the connector, so the oracle can be read (and tested) on its own: a block's content is
a :class:`Label` naming the tenant, conversation, writing request, tensor-parallel rank and token positions whose KV
it holds. A request may compute on a block only if that label is its own prompt's: same tenant, same rank, the
block's position, the prompt's token ids there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Tokens per KV block in the simulation (both engines; small so that turns span several blocks cheaply).
BLOCK_SIZE = 4
#: Trace events kept in every violation's story.
CONTEXT = ("restarts", "time passes", "fault:", "reload", "VIOLATION", "injected", "new requests for")


@dataclass(frozen=True)
class Label:
    """What one KV block (or host slot) holds: who wrote it, for which TP rank and token positions."""

    tenant: str
    conv: str
    writer: str  # the request whose forward (or READ) wrote it
    rank: int
    start: int  # first token position held
    tokens: tuple[int, ...]  # the token ids whose KV it holds, from ``start``

    def short(self) -> str:
        return f"{self.tenant}/{self.conv}@{self.start}+{len(self.tokens)}(r{self.rank},{self.writer})"


def block_labels(tenant: str, conv: str, writer: str, rank: int, tokens: Sequence[int],
                 block_size: int = BLOCK_SIZE) -> list[Label]:
    """The labels a forward over ``tokens`` writes, block after block (the last one may be partial)."""
    return [Label(tenant, conv, writer, rank, start, tuple(tokens[start:start + block_size]))
            for start in range(0, len(tokens), block_size)]


def token_at(conv_number: int, position: int) -> int:
    """A token id that differs between conversations at every position (forks copy their parent's history
    instead of calling this, so a fork shares exactly its parent's prefix)."""
    return 1 + (conv_number * 7919 + position * 104_729 + position * position * 31) % 999_983


def block_fault(label: Label | None, tenant: str, prompt: Sequence[int], rank: int, index: int, upto: int,
                block_size: int = BLOCK_SIZE) -> str | None:
    """Why block ``index`` of a request of ``tenant`` computing ``prompt`` on rank ``rank`` does not hold the KV of
    its prompt's tokens before position ``upto`` (the tokens it computes on), or None when it does."""
    start = index * block_size
    end = min(start + block_size, upto)
    if end <= start:
        return None
    if label is None:
        return "unwritten block"
    if label.rank != rank:
        return f"rank {label.rank}'s KV on rank {rank}"
    if label.tenant != tenant:
        return f"tenant {label.tenant}'s KV"
    if label.start != start:
        return f"positions {label.start}.. where {start}.. belong"
    if tuple(label.tokens[:end - start]) != tuple(prompt[start:end]):
        return f"other tokens ({label.conv}'s)" if len(label.tokens) >= end - start else "too few tokens"
    return None


@dataclass
class Violation:
    """One broken promise: what, where, and the trace index at which it was seen."""

    kind: str  # "kv" (a block's bytes), "tier" (host read of device memory or back), "layout", "crash", "stuck"
    request: str
    detail: str
    step: int  # its line in the trace (0: the trace was off)
    related: tuple[str, ...] = ()  # ids whose trace lines tell its story (request, conversation, offer)

    def __str__(self) -> str:
        where = f" (trace line {self.step})" if self.step else ""
        return f"[{self.kind}] {self.request}: {self.detail}{where}"


@dataclass
class Trace:
    """The readable sequence of actions (and what they caused) of one schedule."""

    lines: list[str] = field(default_factory=list)
    enabled: bool = True

    def add(self, now: float, text: str) -> int:
        if self.enabled:
            self.lines.append(f"{now:9.3f}s  {text}")
        return len(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    def story(self, related: tuple[str, ...], context: tuple[str, ...] = CONTEXT) -> list[str]:
        """The lines that mention one of ``related`` (whole ids), or an event of ``context`` (restarts, time jumps,
        faults, reloads): a violation's story without every other request's looks."""
        pattern = re.compile(r"\b(" + "|".join(re.escape(r) for r in related) + r")\b") if related else None
        return [line for i, line in enumerate(self.lines)
                if i == 0 or (pattern is not None and pattern.search(line)) or any(c in line for c in context)]

    def render(self, last: int | None = None) -> str:
        lines = self.lines if last is None else self.lines[-last:]
        first = len(self.lines) - len(lines)
        return "\n".join(f"{first + i:4d} {line}" for i, line in enumerate(lines))
