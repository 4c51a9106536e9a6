"""Fixtures for the console tests."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture
def closed_port() -> int:
    """A 127.0.0.1 port with nothing listening on it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
