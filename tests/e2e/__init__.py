"""Real vLLM CPU engines (1 prefill + 1 decode) and the router, pull mode: one stack for the package (conftest)."""

ACME, GLOBEX = "acme-key-0123456789", "globex-key-0123456789"  # the keyed router's two tenants' API keys
# A short TTL: a decode engine holding retained blocks keeps a core busy until they expire.
TUNABLES = {"decoder_kv_blocks_ttl": 60, "conversation_ttl": 45}
