"""Streams that survive a dead decode engine: the pure part (no I/O).

When decode dies after tokens have reached the client, the router continues the same stream on another
decode engine: a P/D dispatch of ``/v1/completions`` whose prompt is the request's rendered prompt token
ids plus the tokens generated so far, asking for the tokens still allowed. Greedy decoding from that exact
sequence gives the tokens the dead engine would have given; no token is lost or sent twice because the
router counts the token ids it relayed (``return_token_ids``, vLLM's own field) and the continuation
starts right after them. Its chunks are rewritten into the client's stream (same id, object and model).

The prompt token ids come from the prefill leg's answer (``prompt_token_ids``); the router asks both legs
for token ids and strips them from what the client sees unless the client asked for them itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from router.outcomes import RequestKind

#: Request fields that change sampling and carry over to the continuation unchanged.
SAMPLING_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "logit_bias", "bad_words", "allowed_token_ids", "cache_salt",
)
#: Requests whose output state a token-id continuation cannot restore: tool and reasoning parsers, structured
#: output, logprobs offsets, penalties over generated tokens, several choices.
_NOT_MIGRATABLE = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar", "logprobs", "top_logprobs", "echo", "presence_penalty",
                   "frequency_penalty", "best_of", "suffix")
_TOKEN_IDS = b'"token_ids":['
_PROMPT_IDS = b'"prompt_token_ids":['


def migratable(kind: RequestKind, body: Mapping[str, Any]) -> bool:
    """Whether a streamed request can be continued on another engine if its decode dies."""
    if not body.get("stream") or (body.get("n") or 1) != 1:
        return False
    if any(body.get(f) not in (None, False, [], {}) for f in _NOT_MIGRATABLE):
        return False
    chat_kwargs = body.get("chat_template_kwargs") or {}
    if isinstance(chat_kwargs, Mapping) and chat_kwargs.get("enable_thinking"):
        return False
    return kind == RequestKind.CHAT or isinstance(body.get("prompt"), str)


def _cut(line: bytes, marker: bytes) -> tuple[bytes, bytes | None]:
    """``line`` without the JSON list field starting at ``marker``, and that list's text between the brackets
    (None when absent). Not parsed here: the relay only keeps it, for a migration that rarely comes."""
    at = line.find(marker)
    if at < 0:
        return line, None
    end = line.find(b"]", at)
    if end < 0:
        return line, None
    ids = line[at + len(marker):end]
    if line[at - 1:at] == b",":
        return line[:at - 1] + line[end + 1:], ids
    if line[end + 1:end + 2] == b",":
        return line[:at] + line[end + 2:], ids
    return line[:at] + line[end + 1:], ids


def parse_ids(raw: list[bytes]) -> list[int]:
    """Token ids from the list texts ``_cut`` kept (ValueError when one is not a list of integers)."""
    return [int(x) for x in b",".join(raw).split(b",") if x.strip()]


def take_token_ids(line: bytes, strip: bool) -> tuple[bytes, bytes]:
    """The generated token ids an SSE data line carries, as the text of the JSON list (b"" when none), and the
    line to send on (without the ids fields when ``strip``: the client did not ask for them)."""
    if not line.startswith(b"data: {"):
        return line, b""
    out, ids = _cut(line, _TOKEN_IDS)
    if strip:
        out, _ = _cut(out, _PROMPT_IDS)
        return out, ids or b""
    return line, ids or b""


def cut_prompt_ids(answer: bytes) -> tuple[bytes, bytes | None]:
    """A non-streaming answer (prefill's) without its ``prompt_token_ids`` (top level for chat, per choice
    otherwise), and that list's text, unparsed (None when absent). The list is as long as the prompt, thousands of
    ids that a stream needs only if it migrates: ``prompt_ids`` parses them then."""
    return _cut(answer, _PROMPT_IDS)


def prompt_ids(raw: bytes) -> list[int] | None:
    """The prompt token ids ``cut_prompt_ids`` kept (None when they are not a list of integers)."""
    try:
        return parse_ids([raw])
    except ValueError:
        return None


def continuation_body(body: Mapping[str, Any], sequence: list[int], generated: int) -> dict[str, Any] | None:
    """The ``/v1/completions`` request that goes on from ``sequence`` (prompt + generated ids), or None when
    nothing is left to generate."""
    out: dict[str, Any] = {f: body[f] for f in SAMPLING_FIELDS if f in body}
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None:
        if int(limit) - generated <= 0:
            return None
        out["max_tokens"] = int(limit) - generated
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - generated)
    out.update(prompt=sequence, stream=True, return_token_ids=True)
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage"):
        out["stream_options"] = {"include_usage": True}
    return out


@dataclass
class StreamState:
    """What the relay knows of the client's stream: its identity (first event) and the ids relayed so far."""

    kind: RequestKind
    client_ids: bool  # the client asked for token ids: keep them in what it sees
    head: dict[str, Any] = field(default_factory=dict)  # id, object, created, model of the client's chunks
    prompt_tokens: int = 0
    _ids: list[int] = field(default_factory=list)  # generated token ids, parsed
    _raw: list[bytes] = field(default_factory=list)  # generated token ids as relayed lines carried them, unparsed

    @property
    def generated(self) -> list[int]:
        """The token ids relayed so far (ValueError when an engine sent ids that are not integers)."""
        if self._raw:
            self._ids.extend(parse_ids(self._raw))
            self._raw.clear()
        return self._ids

    def ids_parse(self) -> bool:
        """Parse the relayed ids now; False when the engine sent ids that are not integers."""
        try:
            return self.generated is not None
        except ValueError:
            return False

    def observe(self, line: bytes) -> bytes:
        """Count the token ids of one relayed line; return the line for the client."""
        if not self.head and line.startswith(b"data: {"):
            try:
                first = orjson.loads(line[6:])
                self.head = {k: first.get(k) for k in ("id", "object", "created", "model")}
            except orjson.JSONDecodeError:
                pass
        out, ids = take_token_ids(line, strip=not self.client_ids)
        if ids:
            self._raw.append(ids)
        return out

    def rewrite(self, chunk: Mapping[str, Any]) -> bytes | None:
        """A continuation chunk (``/v1/completions``) as a chunk of the client's stream; None to drop it."""
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if not choices and not usage:
            return None  # kv_transfer_params-only chunks and the like
        out: dict[str, Any] = dict(self.head)
        out_choices = []
        for choice in choices:
            ids = choice.get("token_ids") or []
            self.generated.extend(ids)
            text = choice.get("text") or ""
            if self.kind == RequestKind.CHAT:
                c: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                                     "finish_reason": choice.get("finish_reason")}
            else:
                c = {"index": 0, "text": text, "logprobs": None, "finish_reason": choice.get("finish_reason")}
            if choice.get("stop_reason") is not None:
                c["stop_reason"] = choice["stop_reason"]
            if self.client_ids:
                c["token_ids"] = ids
            out_choices.append(c)
        out["choices"] = out_choices
        if isinstance(usage, Mapping):
            completion = len(self.generated)
            out["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                            "total_tokens": self.prompt_tokens + completion}
        return b"data: " + orjson.dumps(out) + b"\n\n"
