"""The replica's object store: one small door over obstore (S3), its errors mapped to kvj's.

Credentials, region and endpoint come from the AWS environment variables or, with boto3
installed, its credential chain. Conditional writes are create-only (``If-None-Match: *``)
and compare-and-swap (``If-Match``); a 412 and a 409 both mean "lost the race".
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, InvalidPathError, NotFoundError, PreconditionError

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.untrusted import printable

#: A request may take this long plus the time its bytes take at ``MIN_RATE``; a download
#: also fails once this long passes without a byte arriving.
DEFAULT_TIMEOUT = 30.0
#: An upload slower than this (bytes/s) counts as stalled: a fixed time limit per request
#: would fail every upload of a large object, round after round.
MIN_RATE = 256 << 10
#: Requests moving up to this many bytes get the plain timeout; reads stream in pieces of it.
CHUNK = 1 << 20


class LostRace(KvjError):
    """A conditional write found the object changed (HTTP 412, or 409 ConditionalRequestConflict)."""


class RemoteUnavailable(OSError):
    """The object store could not be reached or refused the request (retry later)."""


class UnexpectedSize(CorruptionError):
    """An object of another size than it may have: refused before its body is read (``etag``
    kept for a conditional replacement)."""

    def __init__(self, path: str, reason: str, etag: Optional[str]):
        super().__init__(path, None, reason)
        self.etag = etag


@dataclass(frozen=True)
class ObjectInfo:
    path: str
    size: int
    mtime: float  # last modified, Unix seconds


@dataclass(frozen=True)
class Fetched:
    """An object's bytes, ETag and last-modified time (Unix seconds), from one GET."""

    data: bytes
    etag: Optional[str]
    mtime: float


def _conflict(exc: BaseException) -> bool:
    text = str(exc)
    return "ConditionalRequestConflict" in text or "409 Conflict" in text or "status code: 409" in text


def _unavailable(exc: BaseException, what: str) -> RemoteUnavailable:
    first = " ".join(str(exc).split("Debug source")[0].split())
    return RemoteUnavailable(errno.EIO, f"object store: {what}: {first[:300]}")


def _md5_etag(data: Any) -> str:
    """The ETag S3 gives a single-part upload of ``data`` (its quoted MD5)."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


class Remote:
    """A replica's objects, by paths relative to its prefix. ``make_store(total, idle)`` makes an
    obstore store whose requests fail after ``total`` seconds and (``idle`` not None) after
    ``idle`` seconds without a byte; a request moving ``n`` bytes gets ``timeout + n / MIN_RATE``
    (``n`` rounded up to a power of two, so a few stores serve every size)."""

    def __init__(self, url: str, make_store: Callable[[float, Optional[float]], Any],
                 timeout: float = DEFAULT_TIMEOUT):
        self.url = url
        self.timeout = timeout
        self._make_store = make_store
        self._stores: Dict[Tuple[int, bool], Any] = {}
        self._lock = threading.Lock()

    def store(self, nbytes: int = 0, download: bool = False) -> Any:
        """The store for a request that moves ``nbytes`` (or downloads at most that)."""
        key = (1 << (nbytes - 1).bit_length() if nbytes > CHUNK else 0, download)
        with self._lock:
            if key not in self._stores:
                self._stores[key] = self._make_store(self.timeout + key[0] / MIN_RATE,
                                                     self.timeout if download else None)
            return self._stores[key]

    def get(self, path: str, limit: int, exact: bool = False) -> Optional[Fetched]:
        """``path`` as one GET returns it, None when there is none. An object said to be larger
        than ``limit`` (with ``exact``, of any other size) is ``UnexpectedSize``, unread; a body
        running past ``limit`` is cut off there."""
        where = f"{self.url}/{path}"
        try:
            result = obstore.get(self.store(limit, download=True), path)
            size = int(result.meta["size"])
            if (size != limit) if exact else (size > limit):
                raise UnexpectedSize(where, f"the object holds {size} bytes, " +
                                     (f"{limit} are declared" if exact else f"more than the {limit} it may hold") +
                                     " (not read)", result.meta.get("e_tag"))
            pieces: List[Any] = []
            got = 0
            for piece in result.stream(min_chunk_size=min(limit + 1, CHUNK)):
                got += len(piece)
                if got > limit:
                    raise CorruptionError(where, None, f"the object sends more than the {size} bytes the store "
                                          f"says it holds (cut off after {got})")
                pieces.append(piece)
        except (NotFoundError, FileNotFoundError):
            return None
        except BaseError as exc:
            raise _unavailable(exc, f"reading {path}") from None
        if got != size:
            raise RemoteUnavailable(errno.EIO, f"object store: reading {path}: {got} of {size} bytes arrived")
        return Fetched(b"".join(pieces), result.meta.get("e_tag"), result.meta["last_modified"].timestamp())

    def read(self, path: str, size: int) -> bytes:
        """The ``size`` bytes of ``path``, as declared; missing or of another size is an error, unread."""
        found = self.get(path, size, exact=True)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "missing object in the replica", f"{self.url}/{path}")
        return found.data

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a folder such as ``segments/``)."""
        try:
            for batch in obstore.list(self.store(), prefix):
                for meta in batch:
                    yield ObjectInfo(meta["path"], meta["size"], meta["last_modified"].timestamp())
        except InvalidPathError as exc:  # a name with "..": nothing kvj writes, and the listing stops at it
            reason = " ".join(str(exc).split("Debug source")[0].split())
            raise CorruptionError(f"{self.url}/{prefix}", None, f"holds an object kvj did not write, whose name "
                                  f"is not a path ({printable(reason, 300)}); remove it") from None
        except BaseError as exc:
            raise _unavailable(exc, f"listing {prefix}") from None

    def put_create(self, path: str, data: Any) -> Optional[str]:
        """Create ``path`` only if absent (If-None-Match: *); its ETag, or None if it existed."""
        try:
            return self._put(path, data, None)
        except LostRace:
            return None

    def put_once(self, path: str, data: Any, verify: bool = True) -> None:
        """Create ``path`` holding ``data``; an object already there must hold the same bytes,
        and with ``verify`` a plain MD5 ETag must be ``data``'s (else ``CorruptionError``)."""
        etag = self.put_create(path, data)
        if etag is None:
            try:
                same = self.read(path, len(data)) == bytes(data)
            except UnexpectedSize:
                same = False
            if not same:
                raise CorruptionError(f"{self.url}/{path}", None, "the replica holds different bytes under this name")
        elif verify and re.fullmatch("[0-9a-f]{32}", etag.strip('"')) and etag != _md5_etag(data):
            raise CorruptionError(f"{self.url}/{path}", None, f"the object store stored other bytes than were sent "
                                  f"(ETag {etag})")

    def put_if_match(self, path: str, data: bytes, etag: Optional[str],
                     unacked: Optional[bytes] = None) -> Optional[str]:
        """Replace ``path`` if its ETag is still ``etag`` (create it if None); its new ETag, else
        ``LostRace``. A write whose answer was lost (the retry then failed its precondition) is
        recognised by reading the object back: holding ``data``, it landed; holding ``unacked``
        (an earlier body this writer sent over ``etag`` unanswered), it is still this writer's."""
        try:
            return self._put(path, data, etag)
        except LostRace:
            try:
                found = self.get(path, max(len(data), len(unacked or b"")))
            except UnexpectedSize:
                found = None  # larger than anything this writer sent: another writer's
            if found is not None and found.data == data:
                return found.etag
            if found is not None and unacked is not None and found.data == unacked:
                return self._put(path, data, found.etag)
            raise

    def _put(self, path: str, data: Any, etag: Optional[str]) -> Optional[str]:
        mode: Any = "create" if etag is None else {"e_tag": etag}
        try:
            return obstore.put(self.store(len(data)), path, data, mode=mode)["e_tag"]
        except (AlreadyExistsError, PreconditionError):
            raise LostRace(f"{self.url}/{path} changed under us") from None
        except BaseError as exc:
            if _conflict(exc):
                raise LostRace(f"{self.url}/{path} changed under us (409)") from None
            raise _unavailable(exc, f"writing {path}") from None

    def delete(self, path: str) -> None:
        """Remove ``path`` (no error when it is already gone)."""
        try:
            obstore.delete(self.store(), path)
        except (NotFoundError, FileNotFoundError):
            return
        except BaseError as exc:
            raise _unavailable(exc, f"deleting {path}") from None


def open_remote(url: str, *, retries: int = 3, timeout: float = DEFAULT_TIMEOUT) -> Remote:
    """The replica at ``url`` (``s3://bucket/prefix``), configured from the environment."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise FormatError(f"{url!r} is not a replica URL: use s3://bucket/prefix")
    from obstore.store import S3Store

    kwargs: dict = {}
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        try:  # ~/.aws profiles, SSO and instance roles, as the AWS CLI finds them
            import boto3
            from obstore.auth.boto3 import Boto3CredentialProvider

            session = boto3.Session()
            if session.get_credentials() is not None:
                kwargs["credential_provider"] = Boto3CredentialProvider(session)
        except ImportError:
            pass
    client: dict = {"connect_timeout": timedelta(seconds=min(timeout, 10))}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
        client["allow_http"] = True
    prefix = parsed.path.strip("/") or None

    def make_store(total: float, idle: Optional[float]) -> Any:
        limits = {"timeout": timedelta(seconds=total)}
        if idle is not None:
            limits["read_timeout"] = timedelta(seconds=idle)
        return S3Store(parsed.netloc, prefix=prefix, client_options={**client, **limits},
                       retry_config={"max_retries": retries, "retry_timeout": timedelta(seconds=total)}, **kwargs)

    return Remote(url.rstrip("/"), make_store, timeout)
