"""The production router against real engines (own stacks: 2P+2D, push). A package of its own so that
the shared spine stack of tests/e2e is stopped before these start (memory on a 24 GiB machine)."""
