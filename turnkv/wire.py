"""turnkv's additions to the NIXL ``kv_transfer_params`` wire protocol, named once (pure, no I/O).

The router and the connector never import each other; both import this module, so a key, the lease
route or the offer signature has one definition.

**Signed offers.** A decode engine's returned params are an *offer*: "blocks B of engine E, boot X,
hold tokens T until wall-clock time W". Prefill READs those blocks by position and cannot tell what
they hold now, so it reads only offers that (1) carry a valid MAC made with the deployment's shared
offer secret over every field the read depends on, (2) have not expired on prefill's own wall clock
(minus a skew margin), and (3) it has not already read. The MAC covers every field the READ uses: the engine id,
the boot, the request id, host and port, the block ids, the token count, the token proof, the expiry, the model
fingerprint, the host tier and fork window, decode's parallel sizes (tp, dcp, pp), its block size and the transfer
mode, and the tenant the turn is retained for: a forged, edited, re-pointed or other-checkpoint offer fails the
check and is recomputed.

**Cleared replays.** A signed offer is still valid after decode *evicted* its turn (retention under memory
pressure): decode frees the blocks ``retention_eviction_grace`` after announcing the eviction on its feed, well
before the signed expiry. Routers read every decode engine's feed and, when they replay an offer, *clear* it: a
read-by instant (``READ_BY``) and a MAC over it and the offer's signature (``CLEARANCE``), keyed with the same
secret. Prefill reads only cleared offers before their read-by instant, so an offer that did not come through a
router (replayed from a log, sent straight to prefill) can never reach blocks freed after an eviction. A clearance
also names the tenant it was dispatched for (``CLEARED_TENANT``: an offer retained for a tenant is read only under a
clearance for that tenant) and, where the router knows it, the prefill engine it was sent to (``CLEARED_FOR``: read
by no other engine).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson

from turnkv import lifetime

# -- the router's HTTP protocol with its clients (turnkv.smoke, bench/, users' code) -----------------
# The router (router/flow.py, router/legs.py) and every client of it read these names from here.

#: A client's switch: ``X-TurnKV-Reuse: off`` (or 0/false/no) recomputes the prompt, nothing pulled or retained.
REUSE_HEADER = "X-TurnKV-Reuse"
REUSE_OFF = "off"
#: Prompt tokens prefill pulled from decode for this request.
REUSED_TOKENS_HEADER = "X-TurnKV-Reused-Tokens"
#: Prompt tokens prefill found in its own prefix cache.
PREFILL_CACHED_HEADER = "X-TurnKV-Prefill-Cached-Tokens"
#: Why the request did or did not reuse KV: a :class:`ReuseOutcome` value.
REUSE_OUTCOME_HEADER = "X-TurnKV-Reuse-Outcome"
#: A client-chosen conversation id (a body field ``conversation_id`` does the same).
CONVERSATION_HEADER = "X-Conversation-Id"
#: The request id, echoed back (a client's own when it sent one).
REQUEST_ID_HEADER = "X-Request-Id"


class ReuseOutcome(StrEnum):
    """Why a request did or did not reuse the previous turn's KV (docs/router.md "Reuse outcomes"): the values of
    ``X-TurnKV-Reuse-Outcome``, the SSE trailer comment, Prometheus labels and EMF fields. A member is its value
    wherever it leaves the process. The order is the order of the Prometheus label children
    (``router.telemetry.OUTCOMES``)."""

    HIT = "hit"  # replayed
    MISS = "miss"  # nothing stored at this history's address
    MISMATCH = "mismatch"  # the prompt does not extend the stored history
    EXPIRED = "expired"  # the entry's blocks are (nearly) freed
    REFUSED = "refused"  # the stored params name an unknown engine (or decode ejected / evicted them since)
    RECOMPUTE = "recompute"  # replayed, but prefill recomputed (pull failed or below kv_recompute_threshold)
    TOKEN_MISMATCH = "token_mismatch"  # the text matched but prefill's token proof pulled less
    DISABLED = "disabled"  # the client turned reuse off
    STORE_ERROR = "store_error"  # the store was down or slow
    #: Nothing to look up: a first turn (no assistant message yet), n > 1, a token prompt, a raw-prompt completion
    #: without a session hint.
    NONE = "none"


#: Every outcome as a user reads it: what it means, whether a stack that shows it is healthy, and where to look when
#: it is not. The one source of README.md's outcome table (checked by tests/unit/test_outcomes.py) and of
#: ``turnkv smoke``'s failure advice.
OUTCOME_DOCS: dict[ReuseOutcome, tuple[str, str, str]] = {
    ReuseOutcome.HIT: (
        "prefill pulled the previous turn's KV from decode (`X-TurnKV-Reused-Tokens` > 0)", "yes",
        ""),
    ReuseOutcome.RECOMPUTE: (
        "the router replayed decode's retained turn but prefill pulled nothing: with "
        "`X-TurnKV-Prefill-Cached-Tokens` > 0 its own prefix cache held the history and the rest was fewer tokens "
        "than a pull is worth (`kv_recompute_threshold`, or computing was cheaper); with 0, the pull was refused or "
        "failed",
        "yes with prefill-cached tokens; no without",
        "prefill refused or failed the read: the offer secret must be the same on engines and router (prefill's "
        "vllm:turnkv_offers_* counters name the refusal), and prefill's log names a failed NIXL transfer"),
    ReuseOutcome.MISS: (
        "the router had nothing stored for this history",
        "yes where the router never stored it (a forked or edited history); no on a steady conversation's turn 2+",
        "decode returned no kv_transfer_params (connector not bi-directional) or had no room to retain the turn "
        "(retained_kv_share, host_kv_budget_mib; decode's vllm:turnkv_retention_refusals_total counts the turns it "
        "refused), or the router's store lost it (a restart with the memory store)"),
    ReuseOutcome.MISMATCH: (
        "completions: the prompt does not extend the session's stored text exactly", "yes (the client's edit)",
        "something between turns rewrote the conversation (a proxy, the client's own truncation)"),
    ReuseOutcome.TOKEN_MISMATCH: (
        "replayed, but prefill's token proof found the history re-tokenized differently and pulled less",
        "partly (the text re-renders to other tokens)",
        "the chat template renders the previous answer to other tokens than decode generated (reasoning text "
        "dropped, whitespace); docs/troubleshooting.md"),
    ReuseOutcome.EXPIRED: (
        "decode's retained turn was (nearly) freed", "yes after a pause longer than the TTLs",
        "the time between turns exceeded decoder_kv_blocks_ttl or the router's conversation_ttl"),
    ReuseOutcome.REFUSED: (
        "the stored params name no known engine, lack a field, or decode was ejected or evicted the turn since",
        "yes after an engine fault or under memory pressure",
        "a decode engine restarted or was ejected (the router's log), or decode evicted retained turns for room"),
    ReuseOutcome.DISABLED: ("the client sent `X-TurnKV-Reuse: off`", "yes", ""),
    ReuseOutcome.STORE_ERROR: (
        "the conversation store was down or slower than `store_timeout_ms`: the request went on without reuse", "no",
        "the router's store (Valkey) and store_timeout_ms"),
    ReuseOutcome.NONE: (
        "nothing to look up: a first turn, `n > 1`, a list of prompts, a token prompt, a completion without a "
        "session hint", "yes",
        "is the URL a turnkv router? it saw no earlier turn to look up"),
}


def outcome_advice(outcome: str) -> str:
    """What an outcome means and where to look, for a person (``OUTCOME_DOCS``)."""
    try:
        meaning, _, advice = OUTCOME_DOCS[ReuseOutcome(outcome)]
    except ValueError:
        return f"{outcome!r} is no turnkv outcome: is the URL a turnkv router?"
    return f"{outcome!r}: {meaning}." + (f" Check: {advice}." if advice else "")


# -- upstream's kv_transfer_params keys (vLLM 0.32's NIXL connector) ---------------------------------
# Named here so the router, the connector and the fake engine spell each one once; the strings are upstream's,
# read and written by ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` (pull_scheduler, push_scheduler,
# base_scheduler, metadata), and must not change.

#: Prefill is asked to keep its blocks for decode to read (step 1 of the pull protocol; decode's offer in
#: bi-directional mode).
DO_REMOTE_DECODE = "do_remote_decode"
#: The engine is to read the KV from the named remote engine (decode in step 2; prefill given a decode offer).
DO_REMOTE_PREFILL = "do_remote_prefill"
#: The remote engine's block ids, one list per KV cache group.
REMOTE_BLOCK_IDS = "remote_block_ids"
#: The remote engine's id (its NIXL agent's engine id).
REMOTE_ENGINE_ID = "remote_engine_id"
#: The request id the remote engine holds the blocks under.
REMOTE_REQUEST_ID = "remote_request_id"
#: The remote engine's NIXL side-channel host and port.
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
#: The remote engine's tensor-, decode-context- and pipeline-parallel sizes (upstream's defaults: 1).
TP_SIZE = "tp_size"
DCP_SIZE = "dcp_size"
PP_SIZE = "pp_size"
#: Tokens the remote blocks hold.
REMOTE_NUM_TOKENS = "remote_num_tokens"
#: The remote engine's expiry of the blocks on its own ``time.perf_counter`` (meaningless on another host).
REMOTE_BLOCKS_EXPIRY_TIME = "remote_blocks_expiry_time"
#: ``"pull"`` or ``"push"``: which NIXL connector answered.
TRANSFER_MODE = "transfer_mode"
#: The remote engine's KV block size, where it differs from this engine's (read by upstream's metadata).
REMOTE_BLOCK_SIZE = "remote_block_size"
#: Set by upstream's pull scheduler once a request's remote blocks were handled (not sent on the wire).
REMOTE_BLOCKS_PROCESSED = "_remote_blocks_processed"
#: Prompt tokens prefill did not compute (its prefix cache plus the pulled ones): vLLM's scheduler adds it to
#: prefill's answer (``vllm/v1/core/sched/scheduler.py``; turnkv's connector adds it on releases that do not).
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"
#: Push mode: the id one dispatch gives both legs (the router sends it, the fake engine matches the legs on it;
#: vLLM's NIXL connector does not read it, its Mooncake and MoRIIO connectors do).
TRANSFER_ID = "transfer_id"

#: Upstream's keys of a decode offer (what ``request_finished`` returns in bi-directional mode), in its order.
UPSTREAM_OFFER_KEYS = (
    DO_REMOTE_PREFILL, DO_REMOTE_DECODE, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_REQUEST_ID, REMOTE_HOST,
    REMOTE_PORT, TP_SIZE, DCP_SIZE, PP_SIZE, REMOTE_NUM_TOKENS, REMOTE_BLOCKS_EXPIRY_TIME, TRANSFER_MODE,
)
#: Every upstream key named above (``tests/unit/test_wire_keys.py`` keeps them out of other modules as literals).
UPSTREAM_KEYS = (*UPSTREAM_OFFER_KEYS, REMOTE_BLOCK_SIZE, REMOTE_BLOCKS_PROCESSED, REMOTE_PREFILL_CACHED_TOKENS,
                 TRANSFER_ID)

# -- kv_transfer_params keys turnkv adds -------------------------------------------------------------

#: Decode's per-block token digests (``connector.token_proof``).
TOKEN_PROOF = "turnkv_token_proof"
#: Fingerprint of the decode process (NIXL agent) that holds the blocks (``connector.boot``).
BOOT = "turnkv_boot"
#: Decode's wall-clock (Unix) instant after which the blocks may be gone; lease renewal moves it.
EXPIRES_AT = "turnkv_expires_at"
#: Fingerprint of the model decode computed the KV with (a different checkpoint never matches).
MODEL = "turnkv_model"
#: HMAC over the offer (see ``offer_mac``).
SIGNATURE = "turnkv_sig"
#: Set by the router on a decode request whose KV the next turn will pull (retain on demand).
RETAIN = "turnkv_retain"
#: Set by the router beside ``RETAIN``: the tenant the turn is retained for, as an opaque tag (at most
#: ``TENANT_MAX`` characters; the router may send a digest). Decode shares its retention room among tenants by it
#: (``connector.retention``) and signs it into its offer; prefill reads a tenant's offer only under a clearance for
#: the same tenant (``CLEARED_TENANT``).
TENANT = "turnkv_tenant"
TENANT_MAX = 64
#: Prompt tokens prefill found in its own prefix cache (added to prefill's answer; upstream's
#: ``remote_prefill_cached_tokens`` counts them together with the tokens pulled from decode).
PREFILL_LOCAL_TOKENS = "turnkv_prefill_local_tokens"
#: Prefill's verdict on the offer it was given (router metrics).
VERDICT = "turnkv_proof_verdict"
#: Added by the router when it replays an offer (not stored): the wall-clock instant after which prefill must
#: not start reading it. Bounds how long after the router last checked decode's evictions feed the blocks can be
#: read (decode frees an evicted turn ``retention_eviction_grace`` after announcing it).
READ_BY = "turnkv_read_by"
#: turnkv's connector's ``kv_connector_extra_config`` key, set by ``turnkv.engine_args.multi_connector`` when a
#: sibling connector stores computed blocks (vLLM's OffloadingConnector): no pull is read inline there
#: (``connector.inline.refusal``).
OFFLOAD_SIBLING_KEY = "turnkv_offload_sibling"
#: The router's MAC over the offer's signature and ``READ_BY`` (see ``clear_offer``): a router cleared this replay.
CLEARANCE = "turnkv_clearance"
#: Where decode holds an offer's blocks when not in its device KV cache: ``{"tier": "host", "bases": [pool base
#: address per tensor-parallel rank], "blocks": pool blocks}`` (``connector.host_tier``); the offer's
#: ``remote_block_ids`` are then slots of that pool. Signed with the rest of the offer. Prefill reads a host-tier
#: offer only when a router cleared it, and a router clears one only once decode's feed lists its copy as done.
HOST_TIER = "turnkv_host_tier"
#: Seconds decode keeps a turn readable after its first read (``fork_window``): forks of one history (parallel
#: samples, subagents, retries) may each read it until then. Signed with the rest of the offer; absent (or 0): the
#: offer is single use, as upstream's (decode frees the blocks on the first read).
FORK_WINDOW = "turnkv_fork_window"
#: A fork's replay must be read by ``fork_until`` (the first read + the fork window, router clock) plus this many
#: seconds: the router clears fork replays with ``read_by`` at most that instant, so decode may free a read turn
#: this long (plus ``expiry_skew_margin``, the hosts' clocks) after its own fork window ends, instead of after the
#: full eviction grace (which covers a router that has not read the evictions feed yet).
FORK_READ_SLACK = 2.0
#: Added by the router to each replay of a fork-readable offer (not stored): a nonce inside the clearance, so each
#: reader's replay is a distinct single-use clearance (prefill's replay guard is per reader, not per offer).
READER = "turnkv_reader"
#: Added by the router with the clearance (not stored), inside its MAC: the tenant the replay is dispatched for.
#: Prefill refuses (``uncleared``) a clearance whose tenant is not the offer's signed ``TENANT``.
CLEARED_TENANT = "turnkv_cleared_tenant"
#: Added by the router with the clearance where it knows the target prefill engine's NIXL engine id (the engine's
#: ``engine_id`` attribute in the router's engine list), inside its MAC: any other engine refuses it (``uncleared``).
CLEARED_FOR = "turnkv_cleared_for"
#: Why prefill refused an offer, as its ``VERDICT`` names it (each one a ``vllm:turnkv_offers_<reason>`` counter).
OFFER_REFUSALS = ("unsigned", "forged", "expired", "uncleared", "late", "replayed", "unsealed")
#: Prefill reads only cleared offers unless this is "0" (another proxy in front of the engines, which does not
#: read the evictions feed, can then replay offers; evicted turns are then read until their expiry).
REQUIRE_CLEARED_ENV = "TURNKV_REQUIRE_CLEARED_OFFERS"

#: Set (signed) in decode's offer when decode seals the turn's KV bytes (``connector.fingerprint``): its workers publish
#: each block's digest on the evictions feed, under a MAC bound to this offer's signature. Prefill reads such an
#: offer only with the seal (``SEALS``), and checks every block a READ brought against it.
SEALED = "turnkv_sealed"
#: Added by the router to a replay of a ``SEALED`` offer, from decode's feed: ``[[rank, digests, mac], ...]``, one
#: entry per decode tensor-parallel rank (``connector.fingerprint.encode``; ``seal_mac``, bound to ``seal_identity``:
#: the turn, not the signature, which a lease renewal re-signs).
SEALS = "turnkv_seals"
#: Keys of decode's returned params that a router may store and replay to prefill.
OFFER_KEYS = (TOKEN_PROOF, BOOT, EXPIRES_AT, MODEL, SIGNATURE, HOST_TIER, FORK_WINDOW, TENANT, SEALED)

# -- the engine's lease route ---------------------------------------------------------------------

#: ``POST`` on a decode engine's API server: ``{"offers": [params, ...], "ttl": seconds}``. Each offer
#: must be a valid signed offer of that engine (capability: whoever holds a signed offer may extend it).
LEASE_ROUTE = "/turnkv/v1/leases"
#: Most offers one lease call may name (the route is bounded).
LEASE_MAX_OFFERS = 64
#: Longest lease one call may ask for.
LEASE_MAX_TTL = 3600

# -- the engine's evictions feed ------------------------------------------------------------------

#: ``GET`` on a decode engine's API server, ``?since=SEQ``: the retained turns it evicted (to stay under
#: ``retained_kv_share``) after announcement SEQ, as ``{"epoch": E, "seq": N, "evicted": [[request id,
#: offer expiry], ...]}``. Their blocks are freed ``retention_eviction_grace`` after the announcement; a
#: router refuses to replay an announced offer. ``epoch`` changes when the engine restarts (SEQ starts over).
EVICTIONS_ROUTE = "/turnkv/v1/evictions"
#: Most announcements one feed call returns (the caller asks again from the returned ``seq``).
EVICTIONS_MAX = 4096

# -- the deployment's offer secret ------------------------------------------------------------------

#: The secret itself (tests), or a file holding it (``turnkv local up`` writes one into the state dir; on
#: AWS the node's user data writes the deployment's Secrets Manager secret into the file).
OFFER_SECRET_ENV = "TURNKV_OFFER_SECRET"
OFFER_SECRET_FILE_ENV = "TURNKV_OFFER_SECRET_FILE"
#: Where an engine node keeps the secret unless told otherwise.
DEFAULT_OFFER_SECRET_FILE = "/etc/turnkv/offer-secret"
#: Override of the model fingerprint (e.g. the checkpoint's digest, where the config alone is ambiguous).
MODEL_FINGERPRINT_ENV = "TURNKV_MODEL_FINGERPRINT"

# v2: the host tier is signed too; v3: the fork window; v4: parallel sizes, block size, transfer mode, tenant;
# v5: whether decode seals the KV bytes (SEALED)
_VERSION = b"turnkv-offer-v5"
_SEAL_VERSION = b"turnkv-seal-v1"
_CLEARANCE_VERSION = b"turnkv-clearance-v2"  # v2: the tenant and the target prefill


def offer_secret(env: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's offer secret from the environment, or None (offers are then neither signed nor read)."""
    env = os.environ if env is None else env
    if env.get(OFFER_SECRET_ENV):
        return env[OFFER_SECRET_ENV].strip().encode()  # as the file is read
    path = env.get(OFFER_SECRET_FILE_ENV)
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError:
            return None
        return value or None
    return None


def model_fingerprint(fields: Mapping[str, Any], env: Mapping[str, str] | None = None) -> str:
    """Digest of what makes two engines' KV interchangeable (model, revision, dtype, architecture...)."""
    env = os.environ if env is None else env
    if env.get(MODEL_FINGERPRINT_ENV):
        return env[MODEL_FINGERPRINT_ENV]
    raw = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _signed_part(params: Mapping[str, Any]) -> bytes:
    proof = params.get(TOKEN_PROOF)
    return orjson.dumps([
        params.get(REMOTE_ENGINE_ID), params.get(BOOT), params.get(REMOTE_REQUEST_ID),
        params.get(REMOTE_HOST), params.get(REMOTE_PORT), params.get(REMOTE_BLOCK_IDS),
        params.get(REMOTE_NUM_TOKENS), params.get(EXPIRES_AT), params.get(MODEL),
        orjson.dumps(proof, option=orjson.OPT_SORT_KEYS).decode() if proof is not None else None,
        orjson.dumps(host, option=orjson.OPT_SORT_KEYS).decode() if (host := params.get(HOST_TIER)) is not None
        else None,
        params.get(FORK_WINDOW),
        params.get(TP_SIZE), params.get(DCP_SIZE), params.get(PP_SIZE), params.get(REMOTE_BLOCK_SIZE),
        params.get(TRANSFER_MODE), params.get(TENANT), params.get(SEALED),
    ])


def offer_mac(secret: bytes, params: Mapping[str, Any]) -> str:
    return hmac.new(secret, _VERSION + _signed_part(params), hashlib.sha256).hexdigest()


def seal_identity(params: Mapping[str, Any]) -> str:
    """The retained turn an offer names: decode's engine, request and process (boot). A seal is bound to it, so it
    cannot be moved to another turn, and stays valid when a lease renewal re-signs the offer."""
    return orjson.dumps([params.get(REMOTE_ENGINE_ID), params.get(REMOTE_REQUEST_ID), params.get(BOOT)]).decode()


def seal_mac(secret: bytes, identity: str, rank: int, digests: str) -> str:
    """Decode's MAC over one rank's block digests of one retained turn (``seal_identity``): a seal cannot be moved
    to another turn or rank, or edited on its way through the feed and the router."""
    message = orjson.dumps([identity, int(rank), digests])
    return hmac.new(secret, _SEAL_VERSION + message, hashlib.sha256).hexdigest()


def seal_digests(secret: bytes | None, params: Mapping[str, Any], ranks: int) -> list[str] | None:
    """Each decode rank's digests (``connector.fingerprint.encode``) from a replay's ``SEALS``, in rank order, when
    every rank's entry is there with a valid MAC for the turn this offer names; None otherwise."""
    seals = params.get(SEALS)
    if secret is None or not isinstance(seals, list) or ranks <= 0:
        return None
    identity = seal_identity(params)
    by_rank: dict[int, str] = {}
    for entry in seals:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and isinstance(entry[1], str) and isinstance(entry[2], str)):
            return None
        rank, digests, mac = entry
        if not hmac.compare_digest(mac, seal_mac(secret, identity, rank, digests)):
            return None
        by_rank[rank] = digests
    if sorted(by_rank) != list(range(ranks)):
        return None
    return [by_rank[r] for r in range(ranks)]


def sign_offer(secret: bytes, params: dict[str, Any], expires_at: float, model: str) -> dict[str, Any]:
    """Stamp ``params`` (decode's returned offer) with its wall-clock expiry and model, and sign it."""
    params[EXPIRES_AT] = round(float(expires_at), 3)
    params[MODEL] = model
    params[SIGNATURE] = offer_mac(secret, params)
    return params


def check_offer(secret: bytes | None, params: Mapping[str, Any], model: str, now: float, skew: float) -> str:
    """``"ok"``, or why prefill must not read this offer: ``"unsigned"`` (no secret here or no MAC),
    ``"forged"`` (MAC mismatch: edited, another deployment, or another model), ``"expired"`` (past the
    offer's expiry minus ``skew`` on this host's wall clock)."""
    signature = params.get(SIGNATURE)
    if secret is None or not isinstance(signature, str):
        return "unsigned"
    if params.get(MODEL) != model or not hmac.compare_digest(signature, offer_mac(secret, params)):
        return "forged"
    expires_at = params.get(EXPIRES_AT)
    if not isinstance(expires_at, (int, float)) or lifetime.offer_expired(now, float(expires_at), skew):
        return "expired"
    return "ok"


def neutralize(params: dict[str, Any]) -> None:
    """Turn a refused offer into a plain prefill request in place: nothing is read, no peer is contacted."""
    for key in (REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID, REMOTE_HOST, REMOTE_PORT, REMOTE_REQUEST_ID):
        params[key] = None
    params[REMOTE_NUM_TOKENS] = 0


def fork_window(params: Mapping[str, Any]) -> float:
    """Seconds after its first read that decode keeps an offer's blocks for further readers (0: single use)."""
    window = params.get(FORK_WINDOW)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or window <= 0:
        return 0.0
    return float(window)


def clearance_mac(secret: bytes, signature: str, read_by: float, reader: str | None = None,
                  tenant: str | None = None, prefill: str | None = None) -> str:
    # The instant as fixed-point text: 1796177453.0 and 1796177453 (a JSON layer may turn one into the other) agree.
    # reader: one reader's replay of a fork-readable offer; tenant and prefill: whom and where it was dispatched to.
    message = orjson.dumps([signature, f"{float(read_by):.3f}", reader, tenant, prefill])
    return hmac.new(secret, _CLEARANCE_VERSION + message, hashlib.sha256).hexdigest()


def clear_offer(secret: bytes | None, params: Mapping[str, Any], read_by: float, reader: str | None = None, *,
                tenant: str | None = None, prefill: str | None = None) -> dict[str, Any]:
    """A copy of a stored offer as a router replays it: prefill may start reading it until ``read_by`` (Unix
    time), and, with the deployment's secret, the clearance that proves a router (which reads the evictions feed)
    set that instant. Without a secret only the read-by instant is added (prefill then recomputes unless it was
    told not to require clearance). ``reader``: a nonce naming this replay of a fork-readable offer (``READER``);
    ``tenant``: the tenant the replay is dispatched for (``CLEARED_TENANT``; must be the offer's ``TENANT``);
    ``prefill``: the NIXL engine id of the prefill engine it is sent to (``CLEARED_FOR``), where known."""
    out = dict(params)
    out[READ_BY] = round(float(read_by), 3)
    for key, value in ((READER, reader), (CLEARED_TENANT, tenant), (CLEARED_FOR, prefill)):
        out.pop(key, None)
        if value is not None:
            out[key] = value
    signature = out.get(SIGNATURE)
    if secret is not None and isinstance(signature, str):
        out[CLEARANCE] = clearance_mac(secret, signature, out[READ_BY], reader, tenant, prefill)
    else:
        out.pop(CLEARANCE, None)
    return out


def check_clearance(secret: bytes | None, params: Mapping[str, Any], now: float, *, required: bool,
                    engine_id: str | None = None) -> str:
    """For a signed offer that passed ``check_offer``: ``"ok"``, ``"uncleared"`` (no valid clearance for this read,
    and one is ``required``) or ``"late"`` (its read-by instant has passed). A clearance is for this read only when
    it names the offer's tenant (both none for an offer retained without one) and, if it names a prefill engine,
    ``engine_id`` (this engine). Without ``required`` an uncleared read-by instant, if any, is still honoured (it
    can only make prefill read less)."""
    read_by = params.get(READ_BY)
    clearance = params.get(CLEARANCE)
    instant = isinstance(read_by, (int, float)) and not isinstance(read_by, bool)
    tenant, target = params.get(CLEARED_TENANT), params.get(CLEARED_FOR)
    cleared = (secret is not None and instant and isinstance(clearance, str)
               and isinstance(params.get(SIGNATURE), str)
               and all(_tag_ok(v) for v in (params.get(READER), tenant, target))
               and hmac.compare_digest(clearance, clearance_mac(secret, params[SIGNATURE], read_by,
                                                                params.get(READER), tenant, target))
               and tenant == params.get(TENANT)
               and (target is None or target == engine_id))
    if required and not cleared:
        return "uncleared"
    if read_by is None:
        return "ok"
    return "late" if not instant or now >= float(read_by) else "ok"


def read_deadline(params: Mapping[str, Any], skew: float) -> float | None:
    """The wall-clock instant from which prefill must not start a READ of an admitted offer (None: none known). The
    earlier of its signed expiry less ``skew`` (as ``check_offer``) and the router's read-by instant (as
    ``check_clearance``). The read-by is where an eviction's deadline and a fork window's end reach prefill: a router
    clears a replay to be read within ``replay_window`` of its last look at decode's evictions feed (decode frees an
    evicted turn ``retention_eviction_grace`` after announcing it, longer than that) and a fork's replay by the fork
    window's end plus ``FORK_READ_SLACK`` (decode frees a read turn that plus ``expiry_skew_margin`` after its own
    window). Checked at every look of prefill's scheduler and by the worker right before the READ is posted (pure)."""
    instants = []
    expires_at = params.get(EXPIRES_AT)
    if isinstance(expires_at, (int, float)) and not isinstance(expires_at, bool):
        instants.append(float(expires_at) - skew)
    read_by = params.get(READ_BY)
    if isinstance(read_by, (int, float)) and not isinstance(read_by, bool):
        instants.append(float(read_by))
    return min(instants) if instants else None


def _tag_ok(tag: Any) -> bool:
    return tag is None or (isinstance(tag, str) and 0 < len(tag) <= TENANT_MAX)


def replay_key(params: Mapping[str, Any]) -> str:
    """What prefill's replay guard remembers of a read offer: its signature (single use), or for a fork-readable
    offer the signature and the router's reader nonce (single use per replay; decode keeps the blocks for the
    fork window)."""
    signature = str(params.get(SIGNATURE))
    reader = params.get(READER)
    if fork_window(params) > 0 and isinstance(reader, str):
        return f"{signature}/{reader}"
    return signature


def offer_verdict(secret: bytes | None, params: Mapping[str, Any], model: str, now: float, skew: float, *,
                  require_cleared: bool, engine_id: str | None = None) -> str:
    """Everything prefill checks on an offer before a READ except single use (which needs its memory):
    ``"ok"`` or the reason it is refused (``check_offer``, then ``check_clearance`` for engine ``engine_id``)."""
    reason = check_offer(secret, params, model, now, skew)
    if reason != "ok":
        return reason
    return check_clearance(secret, params, now, required=require_cleared, engine_id=engine_id)


def tenant_tag(params: Mapping[str, Any] | None) -> str | None:
    """The tenant a retain request names (``TENANT``), or None when absent or malformed (pure)."""
    tag = (params or {}).get(TENANT)
    return tag if isinstance(tag, str) and 0 < len(tag) <= TENANT_MAX else None


def lease_offer_ok(params: Mapping[str, Any], engine_id: str | None) -> bool:
    """Whether a (validly signed) offer sent to a decode engine's lease route names that engine: the deployment's
    engines share one secret, so a signature alone does not say whose offer it is (pure)."""
    return engine_id is not None and params.get(REMOTE_ENGINE_ID) == engine_id


# -- a typed view of one kv_transfer_params dict --------------------------------------------------------


def _count(value: Any, default: int) -> int:
    """``int(value or default)``: how every reader of these params has counted (None, 0 and "" are the default)."""
    return int(value or default)


class KVParams:
    """Typed, read-only view of one ``kv_transfer_params`` dict (upstream's keys and turnkv's), in the spirit of
    vLLM's typed connector metadata, for the fields the router, the connector and the fake engine read.

    The dict stays the wire format: the view wraps it without copying or normalizing, unknown keys included, and
    ``to_params`` gives it back as it came (same keys, same order, same values: the same JSON bytes). Writers
    (decode stamping its offer, prefill trimming one) still write the dict, through the key constants above.
    """

    __slots__ = ("_params",)

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = params

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> KVParams:
        """A view of ``params`` (None, as a request without params carries: an empty view)."""
        return cls(params if params is not None else {})

    def to_params(self) -> dict[str, Any]:
        """The params as they came, as a new dict (every key, in order)."""
        return dict(self._params)

    def get(self, key: str, default: Any = None) -> Any:
        """Any key, typed or not (the view never drops one)."""
        return self._params.get(key, default)

    def __repr__(self) -> str:
        return f"KVParams({dict(self._params)!r})"

    # -- upstream's fields --

    @property
    def do_remote_decode(self) -> bool:
        return bool(self._params.get(DO_REMOTE_DECODE))

    @property
    def do_remote_prefill(self) -> bool:
        return bool(self._params.get(DO_REMOTE_PREFILL))

    @property
    def block_ids(self) -> Any:
        """``remote_block_ids`` as sent: a list of block-id lists (one per KV cache group), or None."""
        return self._params.get(REMOTE_BLOCK_IDS)

    @property
    def engine_id(self) -> Any:
        """``remote_engine_id`` as sent (a string, or None in a fresh prefill request)."""
        return self._params.get(REMOTE_ENGINE_ID)

    @property
    def request_id(self) -> Any:
        """``remote_request_id`` as sent (a string, or None)."""
        return self._params.get(REMOTE_REQUEST_ID)

    @property
    def host(self) -> Any:
        """``remote_host`` as sent (a string, or None)."""
        return self._params.get(REMOTE_HOST)

    @property
    def port(self) -> int:
        return _count(self._params.get(REMOTE_PORT), 0)

    @property
    def tp_size(self) -> int:
        return _count(self._params.get(TP_SIZE), 1)

    @property
    def pp_size(self) -> int:
        return _count(self._params.get(PP_SIZE), 1)

    @property
    def num_tokens(self) -> int:
        """Tokens the remote blocks hold (0 when absent)."""
        return _count(self._params.get(REMOTE_NUM_TOKENS), 0)

    @property
    def transfer_mode(self) -> Any:
        """``"pull"``, ``"push"``, or None (an engine that does not say)."""
        return self._params.get(TRANSFER_MODE)

    @property
    def transfer_id(self) -> Any:
        return self._params.get(TRANSFER_ID)

    @property
    def prefill_cached_tokens(self) -> int:
        """Upstream's ``remote_prefill_cached_tokens``: prompt tokens prefill did not compute (0 when absent)."""
        return _count(self._params.get(REMOTE_PREFILL_CACHED_TOKENS), 0)

    # -- turnkv's fields --

    @property
    def expires_at(self) -> float | None:
        """Decode's signed wall-clock expiry (``EXPIRES_AT``), or None when absent or not a number."""
        value = self._params.get(EXPIRES_AT)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return None
