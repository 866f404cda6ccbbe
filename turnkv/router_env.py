"""The router's ports and environment variables, defined once (the router-side mirror of ``turnkv/node_env.py``).

Who reads and who writes them: the router process (``router/config.py``, ``router/state/valkey.py``), the CDK
router stack that sets its container's environment and port (``infra/stacks/router.py``), the local stack and the
CLI that start it on 127.0.0.1 (``turnkv/local/stack.py``, ``turnkv/commands/``), and bench's default URLs.
``router/Dockerfile`` cannot import Python: ``tests/unit/test_router_env.py`` ties its port to :data:`PORT`.

Pure: names and numbers only.
"""

from __future__ import annotations

from turnkv import node_env, wire

#: The router's listening port (the CLI's and the container's default; the ALB's target port).
PORT = 8000
#: The local stack on 127.0.0.1: router, first prefill engine, first decode engine (prefill + 100), and the first
#: NIXL side-channel port (vLLM's default, as on a node).
LOCAL_HOST = "127.0.0.1"
LOCAL_PREFILL_PORT = 8100
DECODE_PORT_OFFSET = 100
LOCAL_DECODE_PORT = LOCAL_PREFILL_PORT + DECODE_PORT_OFFSET
LOCAL_SIDE_CHANNEL_BASE = node_env.DEFAULT_SIDE_CHANNEL_PORT
#: Where bench and the CLI find a router started with the defaults.
LOCAL_URL = f"http://{LOCAL_HOST}:{PORT}"

#: Environment variables the router reads.
#: Deployment name (SSM paths /turnkv/<deployment>/..., EMF dimension): the same variable as a node's node.env.
DEPLOYMENT = node_env.DEPLOYMENT
REGION = node_env.REGION
#: API keys (JSON, see router.auth) and the conversation-key HMAC secret.
API_KEYS = "TURNKV_API_KEYS"
KEY_SECRET = "TURNKV_KEY_SECRET"
#: RBAC credentials of the Valkey store (an ElastiCache user group's user): from the environment, never on a
#: command line.
STORE_USERNAME = "TURNKV_STORE_USERNAME"
STORE_PASSWORD = "TURNKV_STORE_PASSWORD"
#: Hosts media URLs may name (comma-separated exact names; the engines' ``--allowed-media-domains``): empty, any
#: internet host (router.media).
MEDIA_DOMAINS = node_env.MEDIA_DOMAINS
#: The CloudWatch namespace of the router's EMF lines.
METRICS_NAMESPACE = "TURNKV_METRICS_NAMESPACE"
#: USD per prefill engine-hour (the prefill pool's instance price in turnkv.plan.hardware over its engines per
#: instance): the router prices the prefill time reuse saves (router.savings). Unset: seconds only.
PREFILL_PRICE = "TURNKV_PREFILL_ENGINE_PRICE_PER_HOUR"
#: The engines' offer secret (turnkv.wire): the router clears each offer it replays with it.
OFFER_SECRET = wire.OFFER_SECRET_ENV
