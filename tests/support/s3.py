"""A real S3 endpoint on 127.0.0.1 for the replica tests: moto's server, and a TCP relay in
front of it that a test can take down (resetting every connection, refusing new ones) and
bring back on the same port, like an endpoint killed and restarted mid-upload."""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import Dict, List, Optional


class MotoEndpoint:
    """moto's threaded S3 server on a free port of 127.0.0.1 (any non-empty credentials work)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, url: Optional[str] = None):  # -> boto3 S3 client
        import boto3

        return boto3.client("s3", endpoint_url=url or self.url, region_name="us-east-1",
                            aws_access_key_id="kvj-test", aws_secret_access_key="kvj-test")

    def new_bucket(self) -> str:
        name = f"kvj-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.server.stop()


def s3_env(endpoint: str) -> Dict[str, str]:
    """The environment a replicator needs to reach ``endpoint`` (as a user would set it)."""
    return {"AWS_ACCESS_KEY_ID": "kvj-test", "AWS_SECRET_ACCESS_KEY": "kvj-test", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true"}


class Relay:
    """Forwards 127.0.0.1:<port> to ``target_port``; ``down()`` kills it, ``up()`` restarts it.
    ``rate`` (bytes/s) slows each direction of each connection to that, as a slow link would;
    ``received`` counts the bytes the endpoint sent back to clients."""

    def __init__(self, target_port: int, rate: Optional[float] = None):
        self.target_port = target_port
        self.rate = rate
        self.port = 0
        self._lock = threading.Lock()
        self._conns: List[socket.socket] = []
        self._listener: Optional[socket.socket] = None
        self.connections = 0
        self.received = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and reset every open one (an upload in flight is cut)."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._conns += [client, server]
                self.connections += 1
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, a is server), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 14 if self.rate else 1 << 16)
                if not data:
                    break
                if to_client:
                    with self._lock:
                        self.received += len(data)
                if self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def set_env(monkeypatch, endpoint: str) -> None:
    for name, value in s3_env(endpoint).items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    os.environ.pop("AWS_DEFAULT_PROFILE", None)
