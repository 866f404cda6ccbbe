"""turnkv's scheduler-side additions, shared by the pull and the push connector (pure scheduling, no I/O).

Mixed in before an upstream NIXL scheduler class, so ``super()`` reaches upstream's logic:
- decode attaches a token proof (chained per-block digests of the token ids it holds) to the
  ``kv_transfer_params`` it returns for a finished request, and keeps the blocks only when the request
  asked for it (``turnkv_retain``, retain on demand);
- prefill checks that proof against its own prompt before pulling and pulls only the verified prefix
  (the rest is computed); offers without a valid proof are recomputed;
- prefill pulls unless its cost model expects recomputing to cost less, counting what recomputing would
  delay the other requests waiting for the engine (the threshold is a floor; ``connector.policy``);
- TTL and threshold are re-read from the tunables file (hot reload).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from connector import boot, compat, fingerprint, host_tier, inline, token_proof
from connector.admission import Admission, Admissions, ReadPlan, Verdict
from connector.offers import ReplayGuard, model_fields
from connector.policy import CostModel, Decision, Load, StepClock
from connector.retention import EvictReason, Held, HostSlots, ReadDelays, RetentionLedger, Tier
from connector.stats import TurnkvKVConnectorStats
from connector.tunables import TunablesFile, start_values
from connector.worker import TurnkvWorkerMeta
from turnkv import lifetime, wire
from turnkv import params as catalog

logger = logging.getLogger("vllm.turnkv.connector")

#: Where the prefill engine reports its verdict in the kv_transfer_params of its response.
VERDICT_KEY = wire.VERDICT
#: Set by the router on a decode request whose KV the conversation's next turn will pull.
RETAIN_KEY = wire.RETAIN


#: Where each reloadable tunable (``turnkv.params``, ``reloadable``) lives on the scheduler: upstream's own attribute
#: for the two upstream reads, turnkv's for the rest.
RELOADED_INTO = {"decoder_kv_blocks_ttl": "decoder_kv_blocks_ttl", "kv_recompute_threshold": "kv_recompute_threshold",
                 "expiry_skew_margin": "_expiry_skew", "retained_kv_share": "_retained_share",
                 "retention_eviction_grace": "_eviction_grace", "host_kv_budget_mib": "_host_budget_mib",
                 "retention_idle_evict": "_idle_evict", "retention_idle_floor": "_idle_floor",
                 "fork_window": "_fork_window", "inline_pull_max_ms": "_inline_max_ms"}

#: Offers are fork-readable only while the device tier, this turn included, is at most this share full: a read
#: turn kept for forks frees its room only after the eviction grace, so under pressure the room goes to newer turns
#: (read-once, freed on the read, as upstream) rather than to forks.
FORK_ROOM_SHARE = 0.75
#: After decode refused a finished turn for lack of room, offers are single use for this long: under sustained
#: retention pressure a read turn kept for forks would take room the next conversation's turn needs (the pressure
#: benchmark at twice what fits: 7/16 later turns reused with forks kept, against 12/16 single use).
FORK_PRESSURE_COOLDOWN = 60.0


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0").lower() not in ("0", "false", "no")


def _bytes_per_block(kv_cache_config: Any) -> int:
    """KV bytes one block holds across all layers (what a retained block costs decode)."""
    try:
        total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
        return total // max(1, int(kv_cache_config.num_blocks))
    except (AttributeError, TypeError):
        return 0


def _boot_of(metadata: dict[tuple[int, int], Any]) -> str | None:
    """This engine's boot stamp from the handshake payloads it serves: every tensor-parallel rank's NIXL agent
    (pipeline stage 0, the stage a prefill worker reads from), in rank order."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    try:
        stage = min(pp for pp, _ in metadata)
        ranks = sorted(tp for pp, tp in metadata if pp == stage)
        fingerprints = []
        for tp in ranks:
            agent = msgspec.msgpack.decode(metadata[(stage, tp)].agent_metadata_bytes, type=NixlAgentMetadata)
            fingerprints.append(boot.fingerprint(agent.agent_metadata))
        return boot.stamp(fingerprints)
    except Exception:  # no fingerprint: decode's offers are then read without the boot check
        logger.exception("turnkv: could not fingerprint this engine's NIXL agents")
        return None


def _count_blocks(block_ids: Any) -> int:
    try:
        return sum(len(group) for group in block_ids or ())
    except TypeError:
        return 0


def _wall_expiry(params: dict[str, Any], ttl: float) -> float:
    """Decode's expiry on the wall clock: upstream stamps its own ``perf_counter`` (meaningless on another
    host); the same instant converted now, else now + TTL (``turnkv.lifetime``)."""
    return lifetime.decode_wall_expiry(params.get(wire.REMOTE_BLOCKS_EXPIRY_TIME), ttl, time.time(), time.perf_counter)


def remote_block_size(params: dict[str, Any]) -> int | None:
    """Decode's KV block size for an offer: upstream's ``remote_block_size`` param where one is given, and the block
    size decode made its (signed) token proof with; None when neither is known or they disagree (pure)."""
    sizes = set()
    proof = params.get(token_proof.PARAMS_KEY)
    for size in (params.get(wire.REMOTE_BLOCK_SIZE), proof.get("block_size") if isinstance(proof, dict) else None):
        if size is None:
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            return None
        sizes.add(size)
    return sizes.pop() if len(sizes) == 1 else None


def kept_remote_blocks(offered_blocks: int, verified: int, remote_size: int | None, local_size: int) -> int | None:
    """How many of decode's blocks hold the first ``verified`` tokens, counted in decode's block size; None when that
    cannot be told safely: decode's block size unknown, or one upstream cannot pair with this engine's (it reads
    only when this block size is a multiple of decode's), or more tokens than the offer's blocks hold (pure)."""
    if remote_size is None or local_size <= 0 or local_size % remote_size:
        return None
    keep = -(-verified // remote_size)
    return keep if keep <= offered_blocks else None


def held_tokens(computed: int, token_ids: int) -> int:
    """Tokens a finished decode request holds KV for: its computed tokens, at most its token ids (pure; draft
    tokens of speculative decoding may be counted as computed past the last token id)."""
    return max(0, min(computed, token_ids))


class TurnkvSchedulerMixin:
    """turnkv's scheduler-side behaviour, mixed in before an upstream NIXL scheduler (pull or push)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.turnkv_stats = TurnkvKVConnectorStats()
        # Prefill side: each request carrying decode's offer, admitted once at its first look (connector.admission):
        # refused, pulled (from which tier, by when, inline or not) or recomputed; later looks, the allocation, the
        # workers' read plans and the request's end read this record alone.
        self._admissions = Admissions()
        # Offers without a valid proof are recomputed unless TURNKV_REQUIRE_TOKEN_PROOF=0.
        self._require_proof = _flag("TURNKV_REQUIRE_TOKEN_PROOF", True)
        # Decode retains a finished request's blocks only when the request asks (TURNKV_RETAIN_ON_DEMAND=0:
        # upstream's retain-everything behaviour).
        self._retain_on_demand = _flag("TURNKV_RETAIN_ON_DEMAND", True)
        # turnkv's reloadable tunables at the catalog's defaults until the start-up values and the file are read
        for name, attr in RELOADED_INTO.items():
            if attr.startswith("_"):
                setattr(self, attr, catalog.BY_NAME[name].kind(catalog.BY_NAME[name].default))
        # Decode side, forks: turns retained this step whose offer is fork-readable (the workers keep them after a
        # read, until the scheduler evicts them: connector.retention).
        self._forkable: set[str] = set()
        # Decode side, retention (connector.retention): blocks held for another engine to read, by tier (until
        # read, expired or evicted), the evictions the workers have not been told yet (request id -> (grace s,
        # offer's wall expiry)), and how long read turns had waited (what "idle" means).
        self._retained = RetentionLedger()
        self._evictions: dict[str, tuple[float, float]] = {}
        self._read_delays = ReadDelays()
        # Host tier (connector.host_tier): each rank's pool base, the pool's slots, the budget it was sized by,
        # copies the workers have to make (request id -> (device blocks, slots, wall expiry)), and host releases
        # counted per rank.
        vllm_config = getattr(self, "vllm_config", None) or kwargs.get("vllm_config") or (args[0] if args else None)
        self._tp_size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        self._host_bases: dict[int, int] = {}
        self._host_pool_blocks = 0
        # Each rank's pool slots as reported: the tier is used only once every rank reported the same count (one
        # offer names one slot list for all ranks), and is off on every rank, loudly, when they differ.
        self._host_rank_slots: dict[int, int] = {}
        self._host_disagree = False
        self._host_started_mib = 0
        # KV seals (connector.fingerprint): whether each rank's worker can digest its KV blocks (reported at start);
        # decode marks its offers SEALED only when every rank can. Turns retained since the last step, for the
        # workers to seal (request id -> (device blocks, the turn's wire.seal_identity, the offer's wall expiry)).
        self._sealing: dict[int, bool] = {}
        self._to_seal: dict[str, tuple[list[int], str, float]] = {}
        # Host tier as each rank's worker granted it at start: rank -> (configured bytes, granted bytes, why off).
        self._host_granted: dict[int, tuple[int, int, str]] = {}
        self._to_host: dict[str, tuple[list[int], list[int], float]] = {}
        self._host_released: dict[str, int] = {}
        # When decode last refused a turn for lack of room (forks are single use for FORK_PRESSURE_COOLDOWN after).
        self._refused_at = float("-inf")
        # Start-up values: every engine tunable the engine was started with (kv_connector_extra_config), then the
        # tunables file (hot reload) over them.
        self._apply_tunables(start_values(vllm_config))
        self._host_started_mib = self._host_budget_mib
        self._tunables = TunablesFile(self._apply_tunables)
        self._tunables.poll()
        # Why this engine reads no pull inline, if it does not (connector.inline.refusal): Model Runner V2, or an
        # offloading connector beside turnkv's.
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
        self._inline_refusal = inline.refusal(compat.uses_v2_model_runner(vllm_config),
                                              bool(dict(extra).get(wire.OFFLOAD_SIBLING_KEY)))
        if self._inline_refusal:
            logger.info("turnkv: pulls are read asynchronously, never inline (%s; connector.inline.refusal)",
                        self._inline_refusal)
        # Pull only when it is expected to beat recomputing (TURNKV_ADAPTIVE_THRESHOLD=0: the threshold alone).
        self._adaptive = _flag("TURNKV_ADAPTIVE_THRESHOLD", True)
        self.cost = CostModel()
        # Each step's start, by step number: with async scheduling step N+1 is scheduled before step N's
        # output comes back, so one "step started" slot would be overwritten.
        self._steps = StepClock()
        self._step_seq = 0
        # Requests seen and not finished (the engine's prefill work, for the decision's load).
        self._pending: dict[str, Any] = {}
        self._pulls_started: dict[str, tuple[float, int, str]] = {}
        # Engines handshaken with: a pull from another one also pays the NIXL handshake.
        self._handshaken: set[str] = set()
        # Engines pulled from: the first pull's wait also holds the handshake, so it is no wait sample.
        self._pulled_from: set[str] = set()
        # Decode engines handshaken by a worker that reads from them without converting blocks (connector.inline), by
        # the ranks that have: a pull is read inline only from an engine every rank is ready for.
        self._inline_engines: dict[str, set[int]] = {}
        # Decode side: vLLM's block pool (bound by the connector) and the incoming requests looked at but not yet
        # given blocks (request id -> blocks their prompt needs): while they outnumber the free blocks, finished
        # turns are not retained on the device (they go to the host tier, or are not retained), so retention never
        # holds the room running requests wait for.
        self._block_pool: Any = None
        self._decode_waiting: dict[str, int] = {}
        self._bytes_per_block = _bytes_per_block(self.kv_cache_config)
        # This engine's boot fingerprint (decode stamps its params).
        self._boot: str | None = None
        # Signed offers (turnkv.wire): decode signs what it returns, prefill reads only valid, live, unread offers.
        self._offer_secret = wire.offer_secret()
        self._model = wire.model_fingerprint(model_fields(getattr(self, "vllm_config", None)
                                                          or kwargs.get("vllm_config") or (args[0] if args else None)))
        self._require_signed = _flag("TURNKV_REQUIRE_SIGNED_OFFERS", True)
        # Only offers a router cleared (it read decode's evictions feed) are read: TURNKV_REQUIRE_CLEARED_OFFERS=0
        # reads any valid offer, honouring a read-by instant where there is one.
        self._require_cleared = _flag(wire.REQUIRE_CLEARED_ENV, True)
        self._replays = ReplayGuard()
        if self._offer_secret is None:
            logger.warning("turnkv: no offer secret (%s / %s): decode's offers are unsigned and %s",
                           wire.OFFER_SECRET_ENV, wire.OFFER_SECRET_FILE_ENV,
                           "prefill recomputes every offer" if self._require_signed else "read unchecked")
        # Prefill side: prompt tokens not computed (local prefix hits + pulled) as of the request's last
        # admission, for releases whose scheduler does not report them itself (compat.prefill_cached_tokens).
        self._prefill_cached: dict[str, int] = {}
        # Prefill side: prompt tokens found in this engine's own prefix cache as of the request's last admission
        # (reported apart from the pulled ones: upstream's remote_prefill_cached_tokens counts both).
        self._prefill_local: dict[str, int] = {}

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        super().set_xfer_handshake_metadata(metadata)  # type: ignore[misc]
        self._boot = _boot_of(metadata)

    def _apply_tunables(self, values: dict[str, int | float]) -> None:
        for name, value in values.items():
            if name in RELOADED_INTO:  # parsed by the catalog: int or float as it declares
                setattr(self, RELOADED_INTO[name], value)
        if "host_kv_budget_mib" in values and self._host_started_mib and self._host_budget_mib > self._host_started_mib:
            logger.warning("turnkv: host_kv_budget_mib %d is above the %d MiB this engine started with: the host "
                           "tier stays at %d MiB until a restart", self._host_budget_mib, self._host_started_mib,
                           self._host_started_mib)
        if "retained_kv_share" in values or "host_kv_budget_mib" in values or "fork_window" in values:
            self._refused_at = float("-inf")  # retention reconfigured: the pressure seen before is no guide
        if "retained_kv_share" in values or "host_kv_budget_mib" in values:
            self._enforce_rooms()

    # prefill side ------------------------------------------------------------------------------

    def _is_decode_offer(self, params: dict[str, Any] | None) -> bool:
        return bool(params and params.get(wire.DO_REMOTE_DECODE) and params.get(wire.REMOTE_BLOCK_IDS)
                    and not params.get(wire.REMOTE_BLOCKS_PROCESSED))

    def turnkv_bind_block_pool(self, pool: Any) -> None:
        """vLLM's block pool (``KVConnectorBase_V1.bind_gpu_block_pool``): decode reads its free blocks."""
        self._block_pool = pool

    def _device_pressure(self) -> bool:
        """Whether incoming decode requests wait for more blocks than are free (they are looked at every step they
        wait, and leave the count once given blocks)."""
        if self._block_pool is None or not self._decode_waiting:
            return False
        try:
            free = int(self._block_pool.get_num_free_blocks())
        except Exception:
            return False
        return sum(self._decode_waiting.values()) > free

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._tunables.poll()
        request_id = request.request_id
        self._pending[request_id] = request
        self._prefill_local[request_id] = int(num_computed_tokens)
        params = request.kv_transfer_params
        if params and params.get(wire.DO_REMOTE_PREFILL) and not self._decode_waiting.get(request_id):
            tokens = int(getattr(request, "num_tokens", 0) or 0) - int(num_computed_tokens)
            self._decode_waiting[request_id] = max(1, -(-tokens // max(1, int(self.block_size))))
        if params and params.get(wire.DO_REMOTE_DECODE) and params.get(wire.REMOTE_BLOCKS_PROCESSED):
            # The one READ of decode's blocks was already tried: it failed (decode died, lease gone) or the
            # request was preempted after it. Upstream would report the tokens as loadable again without
            # queueing a transfer, and the request would wait for remote KV forever. Compute them instead.
            return 0, False
        admission = self._admissions.get(request_id)
        if admission is None and self._is_decode_offer(params):
            return self._first_look(request, params, num_computed_tokens)
        if admission is not None and self._admissions.past_deadline(request_id, time.time()):
            # Admitted at an earlier look, but the request waited (no KV room) past the offer's deadline: decode
            # may have freed and reused the blocks since. Computed instead, as a late offer at the first look.
            self._refuse(request, params, "late")
        # Upstream alone for a request that is no pull: the record's verdict already cut its params to nothing.
        count, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if admission is None or not admission.pulls:
            return count, asynchronous
        return self._inline_or_not(request, admission, num_computed_tokens, count, asynchronous)

    def _first_look(self, request: Any, params: dict[str, Any], num_computed_tokens: int) -> tuple[int, bool]:
        """Decide once whether, what and how decode's offer is read (``connector.admission``)."""
        request_id = request.request_id
        host = self._admit_host_offer(request, params) if host_tier.is_host_offer(params) else None
        if (host_tier.is_host_offer(params) and host is None) or not self._offer_admitted(request, params):
            # Refused before any READ: the request is an ordinary prefill now (nothing read, no peer contacted).
            self.turnkv_stats.record_label("turnkv_decisions", "recompute")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        stamp = params.get(boot.PARAMS_KEY)
        proof = self._check_offer(request, params)
        seal = self._seal_of(params)
        if params.get(wire.SEALED) and seal is None:
            # Decode promised (signed) a seal of the bytes, and none valid came with the replay: not read.
            self._refuse(request, params, "unsealed")
            self.turnkv_stats.record_label("turnkv_decisions", "recompute")
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        deadline = wire.read_deadline(params, self._expiry_skew)
        plan = ReadPlan(deadline=deadline, safe_until=deadline + self._expiry_skew if deadline is not None else None,
                        boot=stamp if isinstance(stamp, str) else None,
                        host=(tuple(host[0]), host[1]) if host is not None else None, seal=seal)
        count, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        decision = None
        if self._adaptive:
            engine = str(wire.KVParams(params).engine_id)
            decision = self.cost.decide(count, self.kv_recompute_threshold, self._load(request_id),
                                        new_engine=engine not in self._handshaken, tier=plan.tier)
        pull = count > 0 and (decision is None or decision.pull)
        if not pull:
            # Decided for good: upstream is given no token to pull at a later look either. The block ids stay, so
            # decode is still notified at the allocation and frees the turn.
            self._limit_offer(params, 0)
            count, asynchronous = 0, False
        reason = decision.reason if decision is not None else ("ok" if pull else "nothing")
        admission = self._admissions.decide(request_id, Admission(Verdict.PULL if pull else Verdict.RECOMPUTE,
                                                                  reason, plan if pull else ReadPlan(), proof))
        self.turnkv_stats.record_label("turnkv_decisions", "pull" if pull else "recompute")
        if pull:
            self.turnkv_stats.record_label("turnkv_pulls", plan.tier)
        if decision is not None:
            self._export_decision(decision)
            if decision.reason in ("slower", "probe"):
                logger.info("turnkv: request %s: %s %d tokens (pull ~%.1f ms vs compute ~%.1f ms + %.1f ms of "
                            "delay to %d waiting requests)", request_id,
                            "probing a pull of" if decision.pull else "recomputing", decision.tokens,
                            1000 * (decision.predicted_pull_s or 0), 1000 * (decision.predicted_compute_s or 0),
                            1000 * decision.queue_delay_s, decision.load.requests)
        if not pull:
            return count, asynchronous
        return self._inline_or_not(request, admission, num_computed_tokens, count, asynchronous)

    def _seal_of(self, params: dict[str, Any]) -> tuple[tuple[int, ...], ...] | None:
        """Decode's per-rank block digests from a replay's seals (``wire.SEALS``), each cut to the offer's block ids
        (the token proof may have cut them to the verified prefix); None when absent, not valid for this offer, or
        shorter than the blocks offered."""
        texts = wire.seal_digests(self._offer_secret, params, wire.KVParams(params).tp_size)
        groups = params.get(wire.REMOTE_BLOCK_IDS) or []
        if texts is None or len(groups) != 1:
            return None
        blocks = len(groups[0])
        digests = [fingerprint.decode(text) for text in texts]
        if any(d is None or len(d) < blocks for d in digests):
            return None
        return tuple(tuple(d[:blocks]) for d in digests)  # type: ignore[index]

    def _inline_or_not(self, request: Any, admission: Admission, num_computed_tokens: int, count: int,
                       asynchronous: bool) -> tuple[int, bool]:
        """A pull short enough is read inside the step that computes the request (``connector.inline``); planned
        anew at each look (the look that gets the request allocated is the one that counts)."""
        if count <= 0 or not asynchronous:
            self._admissions.set_inline(request.request_id, False)
            return count, asynchronous
        params = request.kv_transfer_params or {}
        remaining = int(getattr(request, "num_prompt_tokens", 0) or 0) - int(num_computed_tokens)
        engine = str(wire.KVParams(params).engine_id)
        groups = getattr(getattr(self, "kv_cache_config", None), "kv_cache_groups", None) or [None]
        predicted = self.cost.predicted_pull(count, tier=admission.plan.tier)
        ready = len(self._inline_engines.get(engine, ())) >= self._tp_size and len(groups) == 1  # hybrid: async
        planned = inline.plan(count, remaining, predicted, float(self._inline_max_ms), ready, self._inline_refusal)
        self.turnkv_stats.record_label("turnkv_inline_plans", planned.reason)
        self._admissions.set_inline(request.request_id, planned.inline)
        return (count, False) if planned.inline else (count, asynchronous)

    def _load(self, exclude: str) -> Load:
        """Prefill work of the other requests this engine has seen and not finished (a lower bound: requests
        queued behind the step's token budget are seen only when the scheduler reaches them)."""
        requests = tokens = 0
        for req_id, other in self._pending.items():
            if req_id == exclude:
                continue
            done = max(int(getattr(other, "num_computed_tokens", 0) or 0),
                       self._pulls_started.get(req_id, (0.0, 0, ""))[1])
            left = int(getattr(other, "num_prompt_tokens", 0) or 0) - done
            if left > 0:
                requests, tokens = requests + 1, tokens + left
        return Load(requests, tokens)

    def _export_decision(self, decision: Decision) -> None:
        s = self.turnkv_stats
        s.record_reason(decision.reason)
        s.data["turnkv_decision_tokens"] = [decision.tokens]
        s.data["turnkv_decision_queue_requests"] = [decision.load.requests]
        s.data["turnkv_decision_queue_tokens"] = [decision.load.tokens]
        if decision.predicted_pull_s is not None and decision.predicted_compute_s is not None:
            s.data["turnkv_decision_pull_seconds"] = [decision.predicted_pull_s]
            s.data["turnkv_decision_compute_seconds"] = [decision.predicted_compute_s]
            s.data["turnkv_decision_queue_delay_seconds"] = [decision.queue_delay_s]

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._decode_waiting.pop(request.request_id, None)
        cached = compat.prefill_cached_tokens(request)
        if cached is not None:  # as of this admission (a failed READ is admitted again, loading nothing)
            self._prefill_cached[request.request_id] = cached
        params = request.kv_transfer_params
        # Allocated for nothing to read: the workers get no read plan (decode is only notified).
        admission = self._admissions.allocated(request.request_id, num_external_tokens)
        if num_external_tokens > 0 and self._is_decode_offer(params):
            self._pulls_started[request.request_id] = (time.perf_counter(), num_external_tokens,
                                                       str(wire.KVParams(params).engine_id))
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if admission is not None and admission.pulls and admission.plan.inline and num_external_tokens > 0:
            self._inline_destination(request.request_id, blocks, num_external_tokens)

    def _inline_destination(self, request_id: str, blocks: Any, num_external_tokens: int) -> None:
        """Where an inline read lands: the blocks after prefill's own prefix hit that hold the pulled tokens.

        Upstream takes a pull's destination as the request's blocks not yet hashed, which for its asynchronous load
        (blocks cached only once the load is done) are exactly those. A synchronous load is allocated for the whole
        prompt and its full blocks up to the pulled tokens' end are hashed at once, so "not hashed" would start one
        block late (after the last full pulled block) and run into the blocks of the tokens the step computes: the
        READ would write decode's blocks one block off, and answers differ (the three-arm sweep: 5 of 6 inline pulls
        answered differently before this)."""
        entry = self._reqs_need_recv.get(request_id)
        if entry is None:
            return
        first = self._prefill_local.get(request_id, 0) // int(self.block_size)
        count = -(-num_external_tokens // int(self.block_size))
        groups = blocks.get_block_ids()
        local = tuple(list(group[first:first + count]) for group in groups)
        self._reqs_need_recv[request_id] = (entry[0], self.get_exchange_clipped_blocks(local),
                                            tuple(first for _ in groups), *entry[3:])

    # cost model inputs: step compute time, transfers, handshakes ---------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        step = None
        if tokens > 0:  # a step that runs the model: its output always comes back to update_connector_output
            self._step_seq = step = self._step_seq + 1
            self._steps.scheduled(step, tokens, time.perf_counter())
        meta = super().build_connector_meta(scheduler_output)
        # The worker echoes the step number with the step's output (connector.worker.TurnkvWorkerMeta).
        meta.turnkv_step = step
        # Each READ's plan from its admission record (connector.admission): the deadline after which the worker
        # posts no READ (after a handshake either), decode's expected boot, decode's host pool for a host-tier
        # offer, and whether the worker finishes it before this step's forward (inline). A receive with no plan only
        # notifies decode.
        meta.turnkv_reads = self._admissions.for_workers(meta.reqs_to_recv)
        for rid, plan in meta.turnkv_reads.items():
            if plan.inline:  # never reported as received, so its start is no wait sample either
                started = self._pulls_started.pop(rid, None)
                if started is not None:
                    self._pulled_from.add(started[2])
        # Retained turns to seal: the workers digest their blocks now (before the host copies below).
        meta.turnkv_seal, self._to_seal = self._to_seal, {}
        # Finished turns placed on the host tier: the workers copy their device blocks into the slots now.
        meta.turnkv_to_host, self._to_host = self._to_host, {}
        # Turns retained with a fork-readable offer: the workers keep them after a read (until evicted).
        meta.turnkv_forkable, self._forkable = self._forkable, set()
        # Retained turns evicted since the last step: the workers announce them and free them after the grace.
        meta.turnkv_evict, self._evictions = self._evictions, {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        now = time.perf_counter()
        self._observe_worker(getattr(connector_output, "kv_connector_worker_meta", None), now)
        wall = time.time()
        released = False
        for request_id in connector_output.finished_sending or ():
            held = self._retained.get(request_id)
            if held is None or held.tier is not Tier.DEVICE:
                continue  # a host-tier turn's device blocks, freed once copied: the turn itself is still held
            read = request_id in self._retained.live and wall < held.expires_at - 1.0
            self._release(request_id, read, wall)
            released = True
        if released:
            self._export_retained()
        for req_id in connector_output.finished_recving or ():
            started_pull = self._pulls_started.pop(req_id, None)
            if started_pull is None:
                continue
            started, tokens, engine = started_pull
            if engine in self._pulled_from:  # the first one also waited for the handshake
                transfer = self.cost.predicted_pull(tokens) or 0.0
                self.cost.observe_wait(now - started - transfer)
            self._pulled_from.add(engine)
            self._handshaken.add(engine)
        self._export_estimates()
        super().update_connector_output(connector_output)

    def _observe_worker(self, meta: Any, now: float) -> None:
        """Feed the cost model what the workers measured in the step(s) this output closes."""
        if not isinstance(meta, TurnkvWorkerMeta):
            return
        self._observe_host(meta)
        self._observe_forks(meta)
        for rank, can in getattr(meta, "sealing", ()):
            self._sealing[int(rank)] = bool(can)
        for step in meta.steps:
            sample = self._steps.finished(step, now)
            if sample is not None:
                self.cost.observe_step(*sample)
        tokens_per_byte = self.block_size / self._bytes_per_block if self._bytes_per_block else 0.0
        for moved, seconds in meta.reads:
            self.cost.observe_transfer(seconds, moved * tokens_per_byte)
        for moved, seconds in getattr(meta, "host_reads", ()):
            self.cost.observe_transfer(seconds, moved * tokens_per_byte, Tier.HOST)
        for engine, seconds in meta.handshakes:
            self.cost.observe_handshake(seconds)
            self._handshaken.add(engine)
        for engine, rank, ready in getattr(meta, "inline_engines", ()):
            ranks = self._inline_engines.setdefault(engine, set())
            (ranks.add if ready else ranks.discard)(rank)

    def _export_estimates(self) -> None:
        s, cost = self.turnkv_stats, self.cost
        if cost.compute_per_token is not None:
            s.data["turnkv_compute_seconds_per_token"] = [cost.compute_per_token]
            s.data["turnkv_compute_step_overhead_seconds"] = [cost.step_overhead or 0.0]
        if cost.pull_per_token is not None:
            s.data["turnkv_pull_seconds_per_token"] = [cost.pull_per_token]
            s.data["turnkv_pull_overhead_seconds"] = [cost.pull_overhead or 0.0]
        if cost.host_pull_per_token is not None:
            s.data["turnkv_host_pull_seconds_per_token"] = [cost.host_pull_per_token]
            s.data["turnkv_host_pull_overhead_seconds"] = [cost.host_pull_overhead or 0.0]
        if cost.handshake.value is not None:
            s.data["turnkv_handshake_seconds"] = [cost.handshake.value]
        if cost.wait.value is not None:
            s.data["turnkv_pull_wait_seconds"] = [cost.wait.value]

    def _observe_host(self, meta: TurnkvWorkerMeta) -> None:
        """Host tier news from the workers: pools registered, host turns done with, leases renewed."""
        for rank, configured, granted, why in getattr(meta, "host_tier", ()):
            self._host_granted[int(rank)] = (int(configured), int(granted), str(why))
            if len(self._host_granted) >= self._tp_size:
                s = self.turnkv_stats
                s.data["turnkv_host_tier_configured_bytes"] = [sum(c for c, _, _ in self._host_granted.values())]
                s.data["turnkv_host_tier_granted_bytes"] = [0 if self._host_disagree else
                                                            sum(g for _, g, _ in self._host_granted.values())]
        for rank, base, blocks in meta.host_pools:
            self._host_bases[int(rank)] = int(base)
            self._host_rank_slots[int(rank)] = int(blocks)
        if meta.host_pools or getattr(meta, "host_tier", ()):
            self._settle_host_pools()
        wall = time.time()
        for request_id in meta.renewed:
            self._retained.touch(request_id, wall)
        changed = False
        for request_id, read in meta.host_released:
            count = self._host_released.get(request_id, 0) + 1
            if count < self._tp_size:
                self._host_released[request_id] = count
                continue
            self._host_released.pop(request_id, None)
            self._release(request_id, read and request_id in self._retained.live, wall)
            changed = True
        if changed:
            self._export_retained()

    def _observe_forks(self, meta: TurnkvWorkerMeta) -> None:
        """Turns read and kept for forks (their first read is the read-delay sample), and those whose fork window
        has passed (announced now, freed after the grace)."""
        wall = time.time()
        for request_id in meta.fork_held:
            held = self._retained.mark_read(request_id, wall)
            if held is not None:
                self._read_delays.observe(wall - held.since, held.tenant)
                self.turnkv_stats.record("turnkv_fork_holds", 1)
        for request_id, held in self._retained.forks_done(wall):
            # No router replays it past its window (plus FORK_READ_SLACK for prefill to start the READ): the short
            # grace, not the one that waits for routers to read the evictions feed.
            self._announce_eviction(request_id, held, EvictReason.READ, wire.FORK_READ_SLACK + self._expiry_skew)

    def _settle_host_pools(self) -> None:
        """Once every rank has reported its pool (or that it has none): the pool's slots if every rank registered a
        pool of the same slot count, else the tier off on every rank (a rank re-fitted after
        ``host_tier.agree_blocks``, or one without a pool: an offer's one slot list would address beyond, or outside,
        a rank's pool)."""
        if self._host_pool_blocks or self._host_disagree:
            return
        without = {rank for rank, (_, g, _) in self._host_granted.items() if g <= 0}
        if len(set(self._host_rank_slots) | without) < self._tp_size or len(without) >= self._tp_size:
            return  # a rank's news is still on its way, or the tier is off on every rank (each said why)
        slots = set(self._host_rank_slots.values())
        if not without and len(slots) == 1:
            self._host_pool_blocks = slots.pop()
            self._retained.host = HostSlots(self._host_pool_blocks)
            self._export_retained()
            return
        self._host_disagree = True
        s = self.turnkv_stats
        s.data["turnkv_host_tier_granted_bytes"] = [0]  # the HostTierShort alarm and `turnkv doctor` see it
        s.record("turnkv_host_tier_rank_mismatches", 1)
        logger.error("turnkv: HOST TIER OFF on every rank: the ranks' pools differ (slots by rank %s, ranks without a "
                     "pool %s); one offer addresses the same slots on every rank, so no turn is placed on the host "
                     "tier", dict(sorted(self._host_rank_slots.items())), sorted(without))

    def _release(self, request_id: str, read: bool, wall: float) -> None:
        held = self._retained.release(request_id)
        if held is not None and read and held.read_at is None:  # a fork-held turn was sampled at its first read
            self._read_delays.observe(wall - held.since, held.tenant)

    def _host_room(self) -> float:
        """Host-tier slots usable now: the pool, as far as the (reloadable) budget allows; 0 until every rank's
        pool is known."""
        if not self._host_pool_blocks or len(self._host_bases) < self._tp_size or not self._host_started_mib:
            return 0.0
        return self._host_pool_blocks * min(1.0, self._host_budget_mib / self._host_started_mib)

    def _enforce_rooms(self) -> None:
        """A lowered share or host budget: evict each tier's oldest turns until it fits again."""
        for tier, room in ((Tier.DEVICE, self._retention_capacity()), (Tier.HOST, self._host_room())):
            for request_id, held in self._retained.shrink(tier, room):
                self._announce_eviction(request_id, held, EvictReason.SHRUNK)

    def _export_retained(self) -> None:
        ledger = self._retained
        s = self.turnkv_stats
        host = ledger.used(Tier.HOST)
        s.data["turnkv_retained_requests"] = [len(ledger.live) + len(ledger.evicting)]
        s.data["turnkv_retained_blocks"] = [ledger.blocks]
        s.data["turnkv_retained_bytes"] = [ledger.blocks * self._bytes_per_block]
        s.data["turnkv_host_retained_requests"] = [ledger.count(Tier.HOST)]
        s.data["turnkv_host_retained_bytes"] = [host * self._bytes_per_block]
        s.data["turnkv_host_pool_bytes"] = [self._host_pool_blocks * self._bytes_per_block]

    def _offer_admitted(self, request: Any, params: dict[str, Any]) -> bool:
        """Signature, expiry on this host's wall clock, a router's clearance and read-by instant (decode may have
        evicted the turn since the router last read its feed), and single use; a refused offer is neutralized."""
        reason = wire.offer_verdict(self._offer_secret, params, self._model, time.time(), self._expiry_skew,
                                    require_cleared=self._require_cleared, engine_id=self._engine_id())
        if reason == "unsigned" and not self._require_signed:
            return True
        if reason == "ok" and not self._replays.first_use(wire.replay_key(params), float(params[wire.EXPIRES_AT])):
            reason = "replayed"
        if reason == "ok":
            return True
        self._refuse(request, params, reason)
        return False

    def _refuse(self, request: Any, params: dict[str, Any], reason: str) -> None:
        """Refuse an offer for good, at its first look or a later one: its record says so, nothing is read and no
        peer is contacted (the params are neutralized)."""
        request_id = request.request_id
        proof = token_proof.Verdict(wire.KVParams(params).num_tokens, 0, reason)
        admission = self._admissions.refuse(request_id, reason) or \
            self._admissions.decide(request_id, Admission(Verdict.REFUSED, reason))
        admission.proof = proof
        self.turnkv_stats.record(f"turnkv_offers_{reason}", 1)
        logger.warning("turnkv: request %s: decode's offer is %s; recomputing without reading it", request_id, reason)
        wire.neutralize(params)

    def _engine_id(self) -> str | None:
        """This engine's NIXL engine id (upstream's scheduler attribute): a clearance naming another is refused."""
        engine_id = getattr(self, "engine_id", None)
        return str(engine_id) if engine_id is not None else None

    def _admit_host_offer(self, request: Any, params: dict[str, Any]) -> tuple[list[int], int] | None:
        """A host-tier offer is read only when a router cleared it (the router checked that decode's copy is done),
        whatever ``TURNKV_REQUIRE_CLEARED_OFFERS`` says, and only with a well-formed pool field: decode's pool
        (bases, slots), or None when refused."""
        parsed = host_tier.parse_offer_field(params.get(wire.HOST_TIER))
        reason = "ok" if parsed is not None else "forged"
        if parsed is not None and self._offer_secret is not None:
            reason = wire.offer_verdict(self._offer_secret, params, self._model, time.time(), self._expiry_skew,
                                        require_cleared=True, engine_id=self._engine_id())
        elif parsed is not None:
            reason = "unsigned"
        if reason == "ok":
            return parsed
        self._refuse(request, params, reason)
        return None

    def _check_offer(self, request: Any, params: dict[str, Any]) -> token_proof.Verdict:
        """The token proof against this prompt; the offer is cut to the verified prefix."""
        remote = wire.KVParams(params).num_tokens
        proof = params.get(token_proof.PARAMS_KEY)
        verdict = token_proof.verify(proof, request.prompt_token_ids or [], remote)
        if verdict.reason in ("no-proof", "bad-proof") and not self._require_proof:
            verdict = token_proof.Verdict(verdict.offered, verdict.offered, "unverified")
        s = self.turnkv_stats
        s.record("turnkv_proof_offered_tokens", verdict.offered)
        s.record("turnkv_proof_verified_tokens", verdict.verified)
        if verdict.mismatched:
            s.record("turnkv_proof_rejected_tokens", verdict.mismatched)
        if verdict.reason == "mismatch":
            s.record("turnkv_proof_mismatches", 1)
            logger.warning("turnkv: request %s: token proof matched %d of %d offered tokens; computing the rest",
                           request.request_id, verdict.verified, verdict.offered)
        elif verdict.reason in ("no-proof", "bad-proof"):
            s.record("turnkv_proof_missing", 1)
            logger.warning("turnkv: request %s: decode's offer has %s; recomputing", request.request_id,
                           verdict.reason)
        if verdict.verified < remote or self._names_spare_blocks(params):
            self._limit_offer(params, verdict.verified)
        return verdict

    def _names_spare_blocks(self, params: dict[str, Any]) -> bool:
        """Whether decode's offer names more blocks than its tokens fill (with speculative decoding vLLM allocates a
        running request's lookahead blocks, and upstream offers every block it holds). Upstream pairs decode's blocks
        with prefill's from the end of the list, so a spare block at the end shifts every block the READ brings by
        one (found by tests/sim, scenario spec): such an offer is cut to the blocks its tokens fill."""
        groups = params.get(wire.REMOTE_BLOCK_IDS) or []
        size = remote_block_size(params)
        tokens = wire.KVParams(params).num_tokens
        return size is not None and any(len(group) > -(-tokens // size) for group in groups)

    def _limit_offer(self, params: dict[str, Any], verified: int) -> None:
        """Make decode's offer cover only the verified prefix (upstream then pulls just that). Decode's block ids are
        cut in decode's block size, which may differ from this engine's; when it is unknown or incompatible the
        offer is recomputed rather than cut by a guess."""
        params[wire.REMOTE_NUM_TOKENS] = verified
        groups = params.get(wire.REMOTE_BLOCK_IDS) or []
        keep = None
        if verified > 0 and len(groups) == 1:
            keep = kept_remote_blocks(len(groups[0]), verified, remote_block_size(params), int(self.block_size))
        if keep is None:
            # Nothing (or, with several KV cache groups or an unknown block size, nothing safely) pulled. The block
            # ids stay, so decode is still notified and frees its blocks.
            params[wire.REMOTE_NUM_TOKENS] = 0
            return
        params[wire.REMOTE_BLOCK_IDS] = [list(groups[0][:keep])]

    # both sides ----------------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        is_decode = bool(params) and not params.get(wire.DO_REMOTE_DECODE)
        unwanted = self._retain_on_demand and not params.get(RETAIN_KEY)
        adding = _count_blocks(block_ids)
        tenant = wire.tenant_tag(params) if is_decode else None
        placement = None
        if is_decode and not unwanted and self.is_bidirectional_kv_xfer_enabled:
            placement = self._place(adding, block_ids, tenant)
            if placement.tier is None:
                unwanted = True  # no room in any tier for a turn still likely to be read: not retained
        if is_decode and unwanted and self.is_bidirectional_kv_xfer_enabled:
            # Nobody will come back for this turn: free its blocks now, as upstream does without bi-directional.
            self.is_bidirectional_kv_xfer_enabled = False
            try:
                delay, out = super().request_finished(request, block_ids)
            finally:
                self.is_bidirectional_kv_xfer_enabled = True
        else:
            delay, out = super().request_finished(request, block_ids)
        admission = self._admissions.drop(request.request_id)
        verdict = admission.proof if admission is not None else None
        self._pending.pop(request.request_id, None)
        self._decode_waiting.pop(request.request_id, None)
        self._pulls_started.pop(request.request_id, None)
        cached = self._prefill_cached.pop(request.request_id, None)
        local = self._prefill_local.pop(request.request_id, 0)
        if out is None:
            return delay, out
        if out.get(wire.DO_REMOTE_PREFILL) and local > 0:
            out[wire.PREFILL_LOCAL_TOKENS] = local
        if out.get(wire.DO_REMOTE_PREFILL) and cached is not None and not compat.reports_prefill_cached_tokens():
            # What 0.32's scheduler adds to prefill's answer (the router counts reuse from it).
            out.setdefault(wire.REMOTE_PREFILL_CACHED_TOKENS, cached)
        if out.get(wire.DO_REMOTE_DECODE) and delay and out.get(wire.REMOTE_NUM_TOKENS):
            # Decode: prove which tokens the retained blocks hold. Upstream offers num_computed_tokens, which with
            # speculative decoding can count draft slots past the request's token ids: only tokens that exist are
            # held (and offered), else the proof covers fewer tokens than claimed and every offer is refused.
            out[wire.REMOTE_NUM_TOKENS] = held_tokens(int(out[wire.REMOTE_NUM_TOKENS]), len(request.all_token_ids))
            held = list(request.all_token_ids[: out[wire.REMOTE_NUM_TOKENS]])
            out[token_proof.PARAMS_KEY] = token_proof.make_proof(held, self.block_size)
            if self._boot:
                out[boot.PARAMS_KEY] = self._boot
            if tenant is not None:  # signed: prefill reads it only under a clearance for this tenant
                out[wire.TENANT] = tenant
            expires_at = _wall_expiry(out, self.decoder_kv_blocks_ttl)
            tier, slots = (placement.tier, placement.slots) if placement is not None and placement.tier else \
                (Tier.DEVICE, ())
            if tier is Tier.HOST:
                # Offered from the host pool: the slots replace the device blocks, which the workers copy from at
                # the next step and then free (connector.host_tier).
                device_blocks = list((out.get(wire.REMOTE_BLOCK_IDS) or [[]])[0])
                out[wire.REMOTE_BLOCK_IDS] = [list(slots)]
                out[wire.HOST_TIER] = host_tier.offer_field([self._host_bases[r] for r in range(self._tp_size)],
                                                            self._host_pool_blocks)
            fork_window = 0.0
            if tier is Tier.DEVICE and self._fork_window > 0 and self._fork_room(_count_blocks(block_ids)):
                # Readable by every fork of this history for the window after its first read (connector.retention).
                fork_window = out[wire.FORK_WINDOW] = self._fork_window
                self._forkable.add(request.request_id)
            sealing = self._offer_secret is not None and self._seals_kv() and len(block_ids or ()) == 1
            if sealing:
                out[wire.SEALED] = True  # signed: prefill reads this offer only with its seal
            if self._offer_secret is not None:
                expires_at = wire.sign_offer(self._offer_secret, out, expires_at, self._model)[wire.EXPIRES_AT]
            if sealing:
                # The workers digest the blocks at the next step, before any host copy (same bytes on both tiers).
                blocks = device_blocks if tier is Tier.HOST else list((out.get(wire.REMOTE_BLOCK_IDS) or [[]])[0])
                self._to_seal[request.request_id] = (blocks, wire.seal_identity(out), expires_at)
            if tier is Tier.HOST:
                self._to_host[request.request_id] = (device_blocks, list(slots), expires_at)
            self._retained.hold(request.request_id, Held(_count_blocks(out.get(wire.REMOTE_BLOCK_IDS)), expires_at,
                                                         tier, time.time(), tuple(slots), fork_window=fork_window,
                                                         tenant=tenant))
            self.turnkv_stats.record_label("turnkv_retention_placed", tier)
            self._export_retained()
        elif placement is not None and placement.slots and self._retained.host is not None:
            self._retained.host.give_back(placement.slots)  # placed, but upstream did not keep the blocks
        if verdict is not None:
            out[VERDICT_KEY] = {"offered": verdict.offered, "verified": verdict.verified, "reason": verdict.reason}
        return delay, out

    def _seals_kv(self) -> bool:
        """Whether every rank's worker digests its KV blocks (connector.fingerprint), as reported at start."""
        return len(self._sealing) >= self._tp_size and all(self._sealing.values())

    def _fork_room(self, adding: int) -> bool:
        """Whether the device tier has room for keeping this turn after its read: no turn refused for lack of room
        lately (``FORK_PRESSURE_COOLDOWN``) and the tier at most ``FORK_ROOM_SHARE`` full with this turn."""
        if time.time() - self._refused_at < FORK_PRESSURE_COOLDOWN:
            return False
        return self._retained.used(Tier.DEVICE) + adding <= FORK_ROOM_SHARE * self._retention_capacity()

    def _retention_capacity(self) -> float:
        """Device blocks decode may hold for next turns: ``retained_kv_share`` of its KV cache (unbounded when
        unknown)."""
        total = int(getattr(getattr(self, "kv_cache_config", None), "num_blocks", 0) or 0)
        return self._retained_share * total if total > 0 else float("inf")

    def _place(self, adding: int, block_ids: Any, tenant: str | None = None) -> Any:
        """The tier a finished turn of ``tenant`` goes to (``connector.retention``), evicting idle turns (each
        tenant's idle measured on its own reads) and over-share tenants' turns when no tier has room."""
        ttl = float(self.decoder_kv_blocks_ttl)

        def idle_after(of: str | None) -> float:
            return self._read_delays.idle_after(self._idle_evict, ttl, of, self._idle_floor)

        host_ok = len(block_ids or ()) == 1  # one KV cache group: the pool's layout
        device_room = self._retention_capacity()
        if self._device_pressure():
            # Requests wait for room: no new device retention (the host tier, else not retained) until they run.
            device_room = min(device_room, float(self._retained.used(Tier.DEVICE)))
            self.turnkv_stats.record("turnkv_retention_yielded", 1)
        placement = self._retained.place(adding, time.time(), device_room, self._host_room(),
                                         idle_after, host_ok=host_ok, tenant=tenant)
        for request_id, held in placement.evicted:
            reason = EvictReason.READ if held.read_at is not None else EvictReason.IDLE
            self._announce_eviction(request_id, held, reason)
        if placement.refusal is not None:
            self._refused_at = time.time()  # retention pressure: no fork-readable offers for a while
            self.turnkv_stats.record("turnkv_retention_refused", 1)
            self.turnkv_stats.record_label("turnkv_retention_refusals", placement.refusal)
        return placement

    def _announce_eviction(self, request_id: str, held: Held, reason: EvictReason,
                           grace: float | None = None) -> None:
        """Announced now, freed after the grace (the workers do both; ``connector.retention``)."""
        grace = self._eviction_grace if grace is None else grace
        self._evictions[request_id] = (grace, held.expires_at)
        self.turnkv_stats.record("turnkv_retention_evicted", 1)
        self.turnkv_stats.record_label("turnkv_retention_evictions", reason)
        logger.info("turnkv: evicting retained request %s (%s tier, %d blocks, %s; freed in %g s)", request_id,
                    held.tier, held.blocks, reason, grace)

    def take_turnkv_stats(self) -> TurnkvKVConnectorStats | None:
        if self.turnkv_stats.is_empty():
            return None
        return self.turnkv_stats.clone_and_reset()
