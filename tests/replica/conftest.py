"""The S3 endpoint the replica tests run against: moto's server on 127.0.0.1, started here."""

from __future__ import annotations

import logging

import pytest
from support.s3 import MotoEndpoint, Relay, set_env


@pytest.fixture(scope="session")
def moto():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    endpoint = MotoEndpoint()
    yield endpoint
    endpoint.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    """A fresh bucket; the environment points the AWS variables at the endpoint. Yields its URL."""
    set_env(monkeypatch, moto.url)
    return f"s3://{moto.new_bucket()}/replica"


@pytest.fixture
def relay(moto, monkeypatch):
    """A relay in front of the endpoint that the test can take down and bring back."""
    r = Relay(moto.port)
    set_env(monkeypatch, r.url)
    yield r
    r.down()
