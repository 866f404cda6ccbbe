"""Unmodified third-party clients against the router on real engines (one stack for the package: 1P+1D, API keys)."""

ACME, GLOBEX = "acme-key-0123456789", "globex-key-0123456789"  # the two tenants' API keys
