"""One reachability probe for every address the platform talks to (Ray, Jobs API, MLflow):
a TCP connect with a short timeout, so a wrong address fails in seconds, not after the
clients' own minutes of retries."""

from __future__ import annotations

import socket


def connect_error(host: str, port: int, timeout: float = 3.0) -> OSError | None:
    """None if a TCP connection to host:port opens within ``timeout``, else the error."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return err
