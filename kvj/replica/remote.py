"""Object storage access for the replica: one small door over obstore, errors mapped to kvj's.

A replica lives under ``s3://bucket/prefix``. Credentials, region and endpoint come from
the usual AWS environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``) and,
when boto3 is installed, from its credential chain (``~/.aws`` profiles, SSO, instance
roles). Conditional writes: create-only (``If-None-Match: *``) and compare-and-swap
(``If-Match``); a 412 and a 409 ``ConditionalRequestConflict`` both mean "lost the race".
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, InvalidPathError, NotFoundError, PreconditionError

from kvj.errors import CorruptionError, FormatError, KvjError
from kvj.untrusted import printable

#: Every request may take this long, plus the time its bytes take at ``MIN_RATE``; a
#: download also fails once this long passes without a byte arriving.
DEFAULT_TIMEOUT = 30.0
#: An upload slower than this (bytes/s) counts as stalled. S3 clients' time limits are per
#: request, so a fixed one would fail every upload of an object too large to send in it,
#: round after round: a replica that never catches up.
MIN_RATE = 256 << 10
#: Requests moving up to this many bytes get the plain ``timeout``; reads are streamed in
#: pieces of this size, so no more than the bytes expected (plus one piece) is ever read.
CHUNK = 1 << 20


class LostRace(KvjError):
    """A conditional write found the object changed (HTTP 412, or 409 ConditionalRequestConflict)."""


class RemoteUnavailable(OSError):
    """The object store could not be reached or refused the request (retry later)."""


class UnexpectedSize(CorruptionError):
    """An object is larger than it may be, or of another size than declared: refused before
    its body is read. ``etag`` is its ETag, for a conditional replacement."""

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
    """An object's bytes, ETag and last-modified time (Unix seconds), as one GET returned them."""

    data: bytes
    etag: Optional[str]
    mtime: float


def _conflict(exc: BaseException) -> bool:
    text = str(exc)
    return "ConditionalRequestConflict" in text or "409 Conflict" in text or "status code: 409" in text


def _unavailable(exc: BaseException, what: str) -> RemoteUnavailable:
    first = " ".join(str(exc).split("Debug source")[0].split())
    return RemoteUnavailable(errno.EIO, f"object store: {what}: {first[:300]}")


def md5_etag(data: Any) -> str:
    """The ETag S3 gives a single-part upload of ``data`` (its quoted MD5)."""
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


class Remote:
    """A replica's objects, addressed by paths relative to the replica's prefix.

    ``make_store(total, idle)`` makes an obstore store whose requests fail after ``total``
    seconds, and (``idle`` not None) once ``idle`` seconds pass without a byte of the answer
    arriving. A request moving ``n`` bytes gets ``timeout`` plus ``n / MIN_RATE`` in all (``n``
    rounded up to a power of two, so a few clients serve every size); a download also fails
    after ``timeout`` without a byte, which tells a stalled connection from a slow one.
    """

    def __init__(self, url: str, make_store: Callable[[float, Optional[float]], Any],
                 timeout: float = DEFAULT_TIMEOUT):
        self.url = url
        self.timeout = timeout
        self._make_store = make_store
        self._stores: Dict[Tuple[int, bool], Any] = {}
        self._lock = threading.Lock()

    def store(self, nbytes: int = 0, download: bool = False) -> Any:
        """The store to use for a request that moves ``nbytes`` (or downloads at most that)."""
        key = (1 << (nbytes - 1).bit_length() if nbytes > CHUNK else 0, download)
        with self._lock:
            if key not in self._stores:
                self._stores[key] = self._make_store(self.timeout + key[0] / MIN_RATE,
                                                     self.timeout if download else None)
            return self._stores[key]

    # -- reads ------------------------------------------------------------------------

    def get(self, path: str, limit: int, exact: bool = False) -> Optional[Fetched]:
        """``path`` as one GET returns it, or None when it does not exist.

        At most ``limit`` bytes are read: an object the store says is larger (or, with
        ``exact``, of any other size than ``limit``) is ``UnexpectedSize`` before its body
        is read, and a body that runs past ``limit`` is cut off there.
        """
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
        """The ``size`` bytes of ``path``, as a manifest or journal declares them; a missing
        object, or one of another size, is an error naming it (and is not read)."""
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

    # -- writes -----------------------------------------------------------------------

    def put_create(self, path: str, data: Any) -> Optional[str]:
        """Create ``path`` only if absent (If-None-Match: *); its ETag, or None if it existed."""
        try:
            return obstore.put(self.store(len(data)), path, data, mode="create")["e_tag"]
        except (AlreadyExistsError, PreconditionError):
            return None
        except BaseError as exc:
            if _conflict(exc):
                return None
            raise _unavailable(exc, f"writing {path}") from None

    def put_if_match(self, path: str, data: bytes, etag: Optional[str],
                     unacked: Optional[bytes] = None) -> Optional[str]:
        """Replace ``path`` if its ETag is still ``etag`` (create it if ``etag`` is None); new ETag.

        A write whose answer was lost (the connection dropped after the store applied it, and
        the client's retry then failed its precondition) is recognised by reading the object
        back: holding ``data``, the write landed. ``unacked`` is an earlier body this writer
        sent over ``etag`` without learning whether it landed: if the object holds that, the
        object is still this writer's, and ``data`` replaces it. Else ``LostRace``: another
        writer changed (or created) it first.
        """
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

    def _put(self, path: str, data: bytes, etag: Optional[str]) -> Optional[str]:
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
    """The replica at ``url`` (``s3://bucket/prefix``), configured from the environment;
    ``timeout`` is what a request moving little data may take (see ``Remote``)."""
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
