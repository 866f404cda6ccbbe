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
    #: Per-turn reply length and pause before each turn (from a workload file); empty: the run's defaults.
    max_tokens: tuple[int, ...] = ()
    think_s: tuple[float, ...] = ()

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


def from_workload_file(workload, words: list[str] | None = None, seed: int = 7) -> list[Conversation]:
    """Conversations shaped by a ``turnkv plan`` workload (vLLM's multi-turn generator format), so a plan
    and a measurement describe the same load: the common prefix is the system prompt, each conversation's
    prefix opens its first user message, and turns, message lengths, reply lengths and think times are
    the file's samples (``turnkv.plan.workload.sample``, one word per token)."""
    from turnkv.plan.workload import sample

    words = words or make_words(1200, seed)
    rng = random.Random(seed)
    turns = sample(workload, workload.num_conversations, seed)
    tpl = workload.template_tokens_per_message
    common = turns.common_prefix_tokens
    system = _text(rng, words, max(common, 1))
    conversations = []
    for c in range(workload.num_conversations):
        sel = turns.conv == c
        user = [_text(rng, words, max(int(n) - tpl - (common if t == 0 else 0), 1))
                for t, n in zip(turns.turn[sel], turns.new_tokens[sel], strict=True)]
        conversations.append(Conversation(c, system, tuple(user), tuple(int(o) for o in turns.output_tokens[sel]),
                                          tuple(float(x) for x in turns.think_s[sel])))
    return conversations
