"""Every address the platform talks to is checked by one probe, net.require_reachable: a dead
port fails in seconds with the caller's own words and fix, a listening one passes."""

from __future__ import annotations

import socket
import time

import pytest

from gem_platform.errors import ClusterError, GemError, TrackingError
from gem_platform.launch import check_address
from gem_platform.net import require_reachable
from gem_platform.remote import check_jobs_server
from gem_platform.tracking_uri import check_reachable
from tests.conftest import free_port


def test_a_listening_port_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        require_reachable("127.0.0.1", server.getsockname()[1], "a test server", "start it")


@pytest.mark.parametrize("check, address, error, words", [
    (check_address, "127.0.0.1:{port}", ClusterError, "Ray cluster at 127.0.0.1:{port}"),
    (check_jobs_server, "http://127.0.0.1:{port}", ClusterError,
     "Ray Jobs server at http://127.0.0.1:{port}"),
    (check_reachable, "http://u:pw@127.0.0.1:{port}", TrackingError,
     "MLflow tracking server http://u:***@127.0.0.1:{port}"),
])
def test_each_caller_names_its_dead_address_in_seconds(check, address, error, words):
    port = free_port()
    start = time.monotonic()
    with pytest.raises(error) as info:
        check(address.format(port=port))
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert f"{words.format(port=port)} is unreachable (" in message
    assert "pw" not in message


def test_the_probe_raises_the_callers_error_with_its_fix():
    with pytest.raises(GemError) as info:
        require_reachable("127.0.0.1", free_port(), "The thing", "Start the thing.",
                          TrackingError, timeout=1.0)
    assert isinstance(info.value, TrackingError)
    assert "The thing is unreachable (" in str(info.value)
    assert "Start the thing." in str(info.value)
