"""Deterministic agentic multi-turn conversations (pure: no I/O).

Each conversation shares one system prompt (an agent's instructions and tool list), opens with a
long user task, and every later turn appends a tool result or user follow-up after the model's
reply, as coding and research agents do. Text is drawn from a word list so that the local tiny
model tokenizes it one token per word; against a real model the word counts are approximate tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from turnkv.local.model import make_words


@dataclass(frozen=True)
class WorkloadSpec:
    conversations: int = 3
    turns: int = 8
    system_words: int = 500
    first_user_words: int = 700
    turn_words: int = 380
    max_tokens: int = 32
    seed: int = 7

    def approx_last_prompt(self) -> int:
        return self.system_words + self.first_user_words + (self.turns - 1) * (self.turn_words + self.max_tokens)


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str
    user_turns: tuple[str, ...]  # the user/tool message that opens each turn

    def messages_for(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """Messages of turn ``turn`` (0-based) given the replies of the turns before it."""
        messages = [{"role": "system", "content": self.system}]
        for t in range(turn + 1):
            messages.append({"role": "user", "content": self.user_turns[t]})
            if t < turn:
                messages.append({"role": "assistant", "content": replies[t]})
        return messages


def _text(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n))


def build(spec: WorkloadSpec, words: list[str] | None = None) -> list[Conversation]:
    words = words or make_words(1200, spec.seed)
    rng = random.Random(spec.seed)
    system = "you are an agent . tools : search read open run test . " + _text(rng, words, spec.system_words)
    conversations = []
    for i in range(spec.conversations):
        first = _text(rng, words, spec.first_user_words)
        later = []
        for t in range(1, spec.turns):
            role_hint = "tool result :" if t % 2 else "user :"
            later.append(f"{role_hint} {_text(rng, words, spec.turn_words)}")
        conversations.append(Conversation(i, system, (first, *later)))
    return conversations
