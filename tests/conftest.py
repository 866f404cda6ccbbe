"""Fixtures shared by every test folder."""

from __future__ import annotations

import itertools
import random
import socket

import pytest

#: Ports tests listen on: below the kernel's ephemeral range (32768-60999 by default), which the outgoing
#: connections of every test and engine draw their local ports from. A port the kernel handed out as free could be
#: taken by such a connection before the test bound it (CI once failed with "address already in use"); these are
#: never handed to a connection. Above the suites' fixed ports (8000s, 15600s, 18000s) and below 25600 (the e2e
#: routers' side channels and 28000s).
TEST_PORTS = range(20000, 25000)
_next_port = itertools.count(random.randrange(len(TEST_PORTS)))  # a random start: two processes rarely meet


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, from ``TEST_PORTS``: each call takes the next one
    (so two engines picked before either binds never share one), skipping any that is in use."""
    for _ in range(len(TEST_PORTS)):
        port = TEST_PORTS[next(_next_port) % len(TEST_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


@pytest.fixture(scope="module")
def moto_url():
    """moto in server mode over HTTP on 127.0.0.1 (one per test module, stopped afterwards)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
