"""Real vLLM CPU engines (1 prefill + 1 decode) and the router, pull mode: one stack for the package (conftest)."""

from turnkv import params

ACME, GLOBEX = "acme-key-0123456789", "globex-key-0123456789"  # the keyed router's two tenants' API keys
# A short TTL: a decode engine holding retained blocks keeps a core busy until they expire.
# A 64 MiB host tier on decode (64 slots of the tiny model's 1 MiB blocks; allocated at start, so set here):
# tests/e2e/test_host_tier.py uses it, the other modules leave the device share room enough not to need it.
TUNABLES = {"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45, "host_kv_budget_mib": 64}
#: What a module that hot-reloads decode's retention writes back when it ends: the stack's values (a file without
#: them would leave decode at the last values it read).
STACK_RETENTION = {"retained_kv_share": params.BY_NAME["retained_kv_share"].default,
                   "host_kv_budget_mib": TUNABLES["host_kv_budget_mib"],
                   "decoder_kv_blocks_ttl": TUNABLES["decoder_kv_blocks_ttl"]}
