"""Inline pulls: read a short tail from decode inside the step that computes the request (pure, no I/O).

Upstream's NIXL pull is an asynchronous KV load: the scheduler parks the request (``WAITING_FOR_REMOTE_KVS``), the
worker posts the READ after that step's forward, sees it done at the end of the next step, and the request is
computed in the step after that. On a busy prefill those are two whole steps of the running batch (the "admit+poll"
of ``bench.pull_cost``: 3.8 ms one request at a time, a whole batch's step under load), which recomputing a short
tail inside the current step never pays: with prefill's own prefix cache on, a pull brings only the reply decode
computed (~100-600 tokens), and the wait made pulling slower than recomputing it.

vLLM also knows synchronous KV loads: ``get_num_new_matched_tokens`` answers ``load_async=False``, the request is
scheduled in this step, the worker's ``start_load_kv`` runs *before* the forward (``has_sync_kv_loads``) and must
leave the blocks filled when it returns; a load that fails reports its blocks (``invalid_block_ids``) and the
scheduler rolls the request back and recomputes them (``kv_load_failure_policy: recompute``). turnkv reads a pull
that way when the READ is predicted short enough to hold the whole step for it (``inline_pull_max_ms``), from an
engine whose handshake is done and whose blocks need no conversion after the READ (same block size and layout: no
post-processing that upstream runs after the forward). Anything else stays asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnkv import metric_names as mn

#: The longest a worker holds a step for inline READs before it gives up on them (they then count as failed: the
#: scheduler recomputes their blocks). A READ normally ends in milliseconds; this covers a handshake redone after
#: decode restarted (upstream's handshake runs in a background thread, ~2 s on GPUs) and a stalled progress thread.
WAIT_LIMIT_S = 10.0
#: Pause between polls of the READs' state while the step waits (NIXL's progress thread moves the bytes).
POLL_S = 0.0002


@dataclass(frozen=True)
class Plan:
    """Why a pull is read inline or not (one Prometheus label value: ``reason``)."""

    inline: bool
    reason: str


#: Every reason a plan can give: the label values of ``vllm:turnkv_inline_plans_total``.
REASONS = mn.INLINE_REASONS


def plan(tokens: int, remaining: int, predicted_s: float | None, max_ms: float, engine_ready: bool,
         refused: str | None = None) -> Plan:
    """Read ``tokens`` inline? ``remaining``: prompt tokens not in prefill's own cache (the scheduler must still
    compute at least one token in the step, so a pull of all of them stays asynchronous, as upstream handles it);
    ``predicted_s``: the cost model's READ time for them; ``engine_ready``: handshaken, laid out alike;
    ``refused``: why this engine never reads inline (:func:`refusal`), if it does not."""
    if max_ms <= 0:
        return Plan(False, "off")
    if refused:
        return Plan(False, refused)
    if not engine_ready:
        return Plan(False, "engine")
    if tokens >= remaining:
        return Plan(False, "whole-prompt")
    if predicted_s is None:
        return Plan(False, "no-estimate")
    if predicted_s * 1000 > max_ms:
        return Plan(False, "slow")
    return Plan(True, "inline")


def refusal(uses_v2_model_runner: bool, offload_sibling: bool) -> str | None:
    """Why an engine reads no pull inline (a plan reason), or None. A failed inline READ reports its blocks after the
    forward that computed with them, and relies on the scheduler rolling the request back:

    - ``runner``: vLLM's Model Runner V2 (the default on CUDA whenever Triton is present, vLLM 0.32) writes the
      rolled-back computed-token count only to its CPU copy (upstream issue #49250, open; fixes #49252 and #53298
      not in 0.32): the recompute would run from the wrong offset and leave garbage KV under cached block hashes.
      Only inline pulls reach that path (upstream's own are asynchronous). Until a failure-injected GPU run shows the
      rollback correct, inline is off under V2 (``VLLM_USE_V2_MODEL_RUNNER=0`` pins V1, where it is on).
    - ``offload``: vLLM's OffloadingConnector beside turnkv's builds its store jobs when the step is scheduled and
      submits them before the recompute, never cancelled: the CPU tier would keep a failed READ's blocks under the
      prompt's hashes. An asynchronous pull is computed only after its READ succeeded or its blocks were marked
      for recompute, so nothing unfilled is stored."""
    if uses_v2_model_runner:
        return "runner"
    if offload_sibling:
        return "offload"
    return None


def same_layout(local_block_size: int, remote_block_size: int, local_layout: str | None, remote_layout: str | None,
                local_physical_per_logical: int, remote_physical_per_logical: int, converts: bool) -> bool:
    """Whether a READ from this remote lands ready to use: upstream converts blocks after the forward otherwise
    (block-size ratio, layout permutation, heterogeneous attention, a host buffer), too late for an inline read."""
    return (not converts and local_block_size == remote_block_size and local_layout == remote_layout
            and local_physical_per_logical == remote_physical_per_logical)
