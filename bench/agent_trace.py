"""Agent traces: a JSON description of agent traffic, expanded deterministically into sessions (pure: no I/O but
``load``).

A trace describes how agents talk to a model, not what they say: every session shares one prefix (the agent's
system prompt and its tool schemas), opens with a user task, and then takes steps of these kinds, each after a
think time drawn from its kind's distribution (the time a tool runs, a user types, a harness retries):

- ``tool``: the model's reply asked for tools; their results come back as new messages, several in one step when
  the calls ran in parallel;
- ``user``: a follow-up from the user;
- ``fork``: N branches sent at once from the same history (parallel samples, retries), each with its own short
  message; the session goes on from the first branch;
- ``subagent``: one or more child conversations started at once from the parent's history plus a new task, each
  running its own tool turns; the parent waits for them and resumes (a ``join`` turn) with their final replies as
  tool results.

Roles: the local tiny model's chat template (``turnkv.local.model.CHAT_TEMPLATE``) renders any role, but an
OpenAI ``role: tool`` message must answer a ``tool_calls`` entry of the assistant message before it, and the
tiny model never generates tool calls; inventing calls it did not make would also change the assistant message
the router addresses the turn by. So tool results are ``user`` messages whose text starts
``tool result ( NAME ) :``; the assistant messages are the model's replies, unchanged (the router finds the previous
turn by the digest of the history plus the exact reply decode generated).

Text is drawn from the tiny model's own vocabulary (``turnkv.local.model``), one token per word, and the fixed
phrases (``task :``, ``tool result ( read ) :``, ``agent task :``, ``step 2 :``) use only its common words, so
nothing tokenizes to ``<unk>``; against a real model the word counts are approximate tokens. Distributions are those
of vLLM's multi-turn generator (``turnkv.plan.workload.Distribution``: constant, uniform, lognormal, zipf, poisson).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turnkv.plan.workload import Distribution, WorkloadError

FORMAT = "turnkv-agent-trace/1"
#: Kinds of the steps after a session's first (``task``); ``join`` is a parent resuming after its subagents.
STEP_KINDS = ("tool", "user", "fork", "subagent")
THINK_KINDS = ("task", *STEP_KINDS, "join")
#: Every kind a recorded request can have (a subagent's first turn is ``subagent``, its later ones ``tool``).
REQUEST_KINDS = ("task", "tool", "user", "fork", "subagent", "join")
TOOL_NAMES = ("search", "read", "open", "run", "test", "list", "show", "fix", "write", "plan")
WORKLOADS = Path(__file__).resolve().parent / "workloads"

_TOP = {"format", "name", "description", "source", "scaling", "seed", "sessions", "steps", "max_tokens",
        "shared_prefix_words", "tools", "task_words", "step_weights", "tool", "user", "fork", "subagent", "think_s"}
_SECTIONS = {
    "tool": {"calls", "result_words"},
    "user": {"words"},
    "fork": {"branches", "words"},
    "subagent": {"session_share", "count", "steps", "task_words", "result_words"},
}


class TraceError(ValueError):
    """A trace turnkv cannot read; the message names the field."""


def _dist(conf: Any, where: str) -> Distribution:
    try:
        return Distribution.parse(conf, where)
    except WorkloadError as exc:
        raise TraceError(str(exc)) from None


def _int(conf: dict[str, Any], key: str, default: int | None, low: int, where: str = "") -> int:
    name = f"{where}{key}"
    if key not in conf:
        if default is None:
            raise TraceError(f"missing field {name!r}")
        return default
    value = conf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def draw(dist: Distribution, rng: np.random.Generator, integer: bool = True, low: float = 0) -> float:
    """One sample. A lognormal given by its ``average`` is drawn as such (``Distribution.sample`` rescales each
    batch to the exact average, which would make a batch of one a constant)."""
    if dist.kind == "lognormal":
        mu, sigma = dist._lognormal()
        value = float(rng.lognormal(mu, sigma))
        if dist.max is not None:
            value = min(value, dist.max)
        value = round(value) if integer else value
    else:
        value = float(dist.sample(rng, 1, integer=integer)[0])
    return max(value, low)


@dataclass(frozen=True)
class AgentTrace:
    name: str
    sessions: int
    steps: Distribution
    max_tokens: int
    shared_prefix_words: int
    tools: tuple[str, ...]
    task_words: Distribution
    step_weights: dict[str, float]
    tool_calls: Distribution
    tool_result_words: Distribution
    user_words: Distribution
    fork_branches: Distribution
    fork_words: Distribution
    subagent_share: float
    subagent_count: Distribution
    subagent_steps: Distribution
    subagent_task_words: Distribution
    think_s: dict[str, Distribution]
    seed: int = 7
    description: str = ""
    source: tuple[Any, ...] = ()
    scaling: str = ""

    @classmethod
    def from_dict(cls, conf: Any) -> AgentTrace:
        if not isinstance(conf, dict):
            raise TraceError("an agent trace must be a JSON object")
        if conf.get("format") != FORMAT:
            raise TraceError(f"format: expected {FORMAT!r}, got {conf.get('format')!r}")
        unknown = sorted(set(conf) - _TOP)
        if unknown:
            raise TraceError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(_TOP))})")
        sections: dict[str, dict[str, Any]] = {}
        for name, keys in _SECTIONS.items():
            section = conf.get(name, {})
            if not isinstance(section, dict):
                raise TraceError(f"{name}: expected an object, got {section!r}")
            extra = sorted(set(section) - keys)
            if extra:
                raise TraceError(f"unknown field '{name}.{extra[0]}' (known: {', '.join(sorted(keys))})")
            sections[name] = section
        weights = conf.get("step_weights", {"tool": 1.0})
        if not isinstance(weights, dict) or not weights:
            raise TraceError(f"step_weights: expected an object of kind -> weight, got {weights!r}")
        for kind, w in weights.items():
            if kind not in ("tool", "user", "fork"):
                raise TraceError(f"step_weights.{kind}: unknown step kind (tool, user or fork; subagent steps are "
                                 "placed by subagent.session_share)")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
                raise TraceError(f"step_weights.{kind}: expected a number >= 0, got {w!r}")
        if sum(weights.values()) <= 0:
            raise TraceError("step_weights: at least one weight must be above 0")
        think = conf.get("think_s", {})
        if not isinstance(think, dict):
            raise TraceError(f"think_s: expected an object of step kind -> distribution, got {think!r}")
        for kind in think:
            if kind not in THINK_KINDS:
                raise TraceError(f"think_s.{kind}: unknown step kind (one of {', '.join(THINK_KINDS)})")
        tools = conf.get("tools", list(TOOL_NAMES[:5]))
        if not isinstance(tools, list) or not tools or not all(isinstance(t, str) and t for t in tools):
            raise TraceError(f"tools: expected a non-empty list of tool names, got {tools!r}")
        sub = sections["subagent"]
        share = sub.get("session_share", 0)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise TraceError(f"subagent.session_share: expected a number in [0, 1], got {share!r}")
        source = conf.get("source", [])
        for key, what in (("steps", "steps per session, the first task included"),
                          ("task_words", "words of the task that opens a session")):
            if key not in conf:
                raise TraceError(f"missing field {key!r} ({what})")
        zero = Distribution("constant", {"value": 0.0})
        return cls(
            name=str(conf.get("name") or "agent-trace"),
            sessions=_int(conf, "sessions", None, 1),
            steps=_dist(conf["steps"], "steps"),
            max_tokens=_int(conf, "max_tokens", 32, 1),
            shared_prefix_words=_int(conf, "shared_prefix_words", 500, 0),
            tools=tuple(tools),
            task_words=_dist(conf["task_words"], "task_words"),
            step_weights={k: float(v) for k, v in weights.items()},
            tool_calls=_dist(sections["tool"].get("calls", 1), "tool.calls"),
            tool_result_words=_dist(sections["tool"].get("result_words", 80), "tool.result_words"),
            user_words=_dist(sections["user"].get("words", 40), "user.words"),
            fork_branches=_dist(sections["fork"].get("branches", 2), "fork.branches"),
            fork_words=_dist(sections["fork"].get("words", 10), "fork.words"),
            subagent_share=float(share),
            subagent_count=_dist(sub.get("count", 1), "subagent.count"),
            subagent_steps=_dist(sub.get("steps", 3), "subagent.steps"),
            subagent_task_words=_dist(sub.get("task_words", 60), "subagent.task_words"),
            think_s={kind: _dist(think[kind], f"think_s.{kind}") if kind in think else zero for kind in THINK_KINDS},
            seed=_int(conf, "seed", 7, 0),
            description=str(conf.get("description") or ""),
            source=tuple(source) if isinstance(source, list) else (source,),
            scaling=str(conf.get("scaling") or ""),
        )


def load(path: str | Path) -> AgentTrace:
    """Read and validate a trace file; a shipped trace may be named without its folder and extension
    (``agent-coding``). Errors are ``TraceError`` naming the file and the field."""
    path = resolve(path)
    try:
        conf = json.loads(path.read_text())
    except FileNotFoundError:
        shipped = ", ".join(shipped_traces()) or "none"
        raise TraceError(f"{path}: no such trace file (shipped traces: {shipped})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read it: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON: {exc}") from None
    try:
        return AgentTrace.from_dict(conf)
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None


def resolve(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists() and p.parent == Path(".") and (WORKLOADS / f"{p.stem}.json").exists():
        return WORKLOADS / f"{p.stem}.json"
    return p


def shipped_traces() -> list[str]:
    """Names of the traces in bench/workloads/ (the files of this format there)."""
    names = []
    for path in sorted(WORKLOADS.glob("*.json")):
        try:
            if json.loads(path.read_text()).get("format") == FORMAT:
                names.append(path.stem)
        except (OSError, ValueError):
            continue
    return names


# -- expansion ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One step of an agent. ``messages`` are appended after the previous reply (``task``, ``tool``, ``user``);
    a ``fork`` has one message list per branch; a ``subagent`` step starts ``children`` from the history so far and
    then resumes the parent with their final replies (its ``messages`` are empty: they are made when played)."""

    kind: str
    think_s: float
    messages: tuple[dict[str, str], ...] = ()
    branches: tuple[tuple[dict[str, str], ...], ...] = ()
    children: tuple[Agent, ...] = ()


@dataclass(frozen=True)
class Agent:
    name: str  # "main", or "sub<step>.<i>" for the i-th child spawned at the parent's step <step>
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Session:
    index: int
    system: str
    main: Agent
    max_tokens: int

    def requests(self) -> int:
        """Requests one arm sends for this session."""
        return _requests(self.main)

    def start_s(self) -> float:
        return self.main.steps[0].think_s


def _requests(agent: Agent) -> int:
    total = 0
    for step in agent.steps:
        if step.kind == "fork":
            total += len(step.branches)
        elif step.children:
            total += sum(_requests(c) for c in step.children) + 1  # the children, then the parent's join
        else:
            total += 1
    return total


@dataclass
class _Text:
    words: list[str]
    rng: np.random.Generator

    def __call__(self, n: int) -> str:
        idx = self.rng.integers(0, len(self.words), size=max(int(n), 1))
        return " ".join(self.words[i] for i in idx)


def vocabulary() -> list[str]:
    """The local tiny model's words (what ``turnkv.local.model.build`` trains its tokenizer on, less the common words
    the templates use): one token each, never ``<unk>``."""
    from turnkv.local.model import COMMON_WORDS, ModelSpec, make_words

    spec = ModelSpec()
    return [w for w in make_words(spec.vocab_words, spec.seed) if w not in COMMON_WORDS]


def shared_prefix(trace: AgentTrace, words: list[str]) -> str:
    """The system prompt every session shares: instructions, then one schema line per tool, padded with text to
    ``shared_prefix_words`` words."""
    text = _Text(words, np.random.default_rng([trace.seed, 0xA9E]))
    head = ["you are an agent . answer the user and call a tool when you can . tool list :"]
    per_tool = max((trace.shared_prefix_words - 20) // (2 * len(trace.tools)), 1)
    for tool in trace.tools:
        head.append(f"function {tool} ( {text(3)} ) : {text(per_tool)} .")
    prefix = " ".join(head)
    missing = trace.shared_prefix_words - len(prefix.split())
    return prefix + (" " + text(missing) if missing > 0 else "")


def _think(trace: AgentTrace, kind: str, rng: np.random.Generator) -> float:
    return round(draw(trace.think_s[kind], rng, integer=False), 3)


def _tool_step(trace: AgentTrace, rng: np.random.Generator, text: _Text) -> Step:
    calls = int(draw(trace.tool_calls, rng, low=1))
    messages = []
    for _ in range(calls):
        name = trace.tools[int(rng.integers(0, len(trace.tools)))]
        messages.append({"role": "user", "content": f"tool result ( {name} ) : "
                                                    f"{text(draw(trace.tool_result_words, rng, low=1))}"})
    return Step("tool", _think(trace, "tool", rng), tuple(messages))


def _child(trace: AgentTrace, name: str, rng: np.random.Generator, text: _Text) -> Agent:
    task = {"role": "user", "content": f"agent task : {text(draw(trace.subagent_task_words, rng, low=1))}"}
    steps = [Step("subagent", 0.0, (task,))]
    for _ in range(int(draw(trace.subagent_steps, rng, low=1)) - 1):
        steps.append(_tool_step(trace, rng, text))
    return Agent(name, tuple(steps))


def expand(trace: AgentTrace, words: list[str] | None = None) -> list[Session]:
    """The trace's sessions, the same for the same trace and seed. Each session draws from its own generator seeded
    by (seed, session index), so adding sessions leaves the earlier ones as they were."""
    words = words or vocabulary()
    system = shared_prefix(trace, words)
    picker = np.random.default_rng([trace.seed, 0x5AB])
    n_sub = round(trace.subagent_share * trace.sessions)
    with_subagent = set(picker.choice(trace.sessions, size=n_sub, replace=False).tolist()) if n_sub else set()
    kinds = list(trace.step_weights)
    p = np.array([trace.step_weights[k] for k in kinds], dtype=float)
    p /= p.sum()
    sessions = []
    for index in range(trace.sessions):
        rng = np.random.default_rng([trace.seed, index])
        text = _Text(words, rng)
        count = int(draw(trace.steps, rng, low=1))
        spawn_at = int(rng.integers(1, count)) if index in with_subagent and count > 1 else None
        steps = [Step("task", _think(trace, "task", rng),
                      ({"role": "user", "content": f"task : {text(draw(trace.task_words, rng, low=1))}"},))]
        for s in range(1, count):
            if s == spawn_at:
                n = int(draw(trace.subagent_count, rng, low=1))
                children = tuple(_child(trace, f"sub{s}.{i}", rng, text) for i in range(n))
                steps.append(Step("subagent", _think(trace, "subagent", rng), children=children))
                continue
            kind = kinds[int(rng.choice(len(kinds), p=p))]
            if kind == "tool":
                steps.append(_tool_step(trace, rng, text))
            elif kind == "user":
                steps.append(Step("user", _think(trace, "user", rng),
                                  ({"role": "user", "content": f"user : {text(draw(trace.user_words, rng, low=1))}"},)))
            else:
                n = int(draw(trace.fork_branches, rng, low=2))
                branches = tuple(({"role": "user", "content": f"step {b + 1} : "
                                                              f"{text(draw(trace.fork_words, rng, low=1))}"},)
                                 for b in range(n))
                steps.append(Step("fork", _think(trace, "fork", rng), branches=branches))
        sessions.append(Session(index, system, Agent("main", tuple(steps)), trace.max_tokens))
    return sessions


def join_messages(final_replies: list[str]) -> tuple[dict[str, str], ...]:
    """The parent's resume after its subagents: each child's final reply as a tool result."""
    return tuple({"role": "user", "content": f"tool result ( agent ) : {reply}"} for reply in final_replies)


@dataclass
class Stats:
    """What a trace expands to (for docs and the CLI's header line)."""

    sessions: int = 0
    requests: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    sessions_with_subagents: int = 0


def stats(sessions: list[Session]) -> Stats:
    out = Stats(sessions=len(sessions))

    def walk(agent: Agent) -> None:
        for step in agent.steps:
            if step.kind == "fork":
                out.kinds["fork"] = out.kinds.get("fork", 0) + len(step.branches)
            elif step.children:
                for child in step.children:
                    walk(child)
                out.kinds["join"] = out.kinds.get("join", 0) + 1
            else:
                out.kinds[step.kind] = out.kinds.get(step.kind, 0) + 1

    for s in sessions:
        walk(s.main)
        out.requests += s.requests()
        out.sessions_with_subagents += any(step.children for step in s.main.steps)
    return out
