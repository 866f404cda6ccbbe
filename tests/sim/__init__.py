"""A seeded simulation that searches interleavings of P/D turns for reads of KV that is not the request's own (#50).

``model`` and ``fabric`` are the pure parts (labelled blocks, the oracle, a fake NIXL fabric), ``upstream`` the
vLLM slices the connector's mixins run over, ``adapters`` every touch of connector state beyond the hooks vLLM
calls, ``world`` one schedule, ``runner`` many; ``python -m tests.sim --help`` and README.md say how to run them.
"""
