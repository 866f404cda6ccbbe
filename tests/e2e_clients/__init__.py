"""Unmodified third-party clients against the router on real engines (own stack: 1P+1D, API keys)."""
