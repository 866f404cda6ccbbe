"""The router keeps idle client connections open for ``--keepalive-timeout`` seconds (the CDK stack sets it
beyond the ALB's idle timeout: a load balancer reusing a connection the target already closed returns 502)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port

REQUEST = b"GET /health HTTP/1.1\r\nHost: router\r\nConnection: keep-alive\r\n\r\n"


def _get(sock: socket.socket) -> bytes:
    sock.sendall(REQUEST)
    return sock.recv(65536)


def _serve(keepalive: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TURNKV_API_KEYS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "turnkv.cli", "router", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                             "--no-emf", "--keepalive-timeout", keepalive],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("the router did not start")


def test_idle_connections_live_for_the_keepalive_timeout():
    proc, port = _serve("3")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert b" 200 " in _get(sock).split(b"\r\n", 1)[0]
            time.sleep(1.5)  # idle, well inside the timeout: the same connection still serves
            assert b" 200 " in _get(sock).split(b"\r\n", 1)[0]
            time.sleep(4.5)  # past it: the router has closed the connection
            sock.settimeout(2)
            try:
                sock.sendall(REQUEST)
                closed = sock.recv(65536) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            assert closed
    finally:
        proc.terminate()
        proc.wait(timeout=10)
