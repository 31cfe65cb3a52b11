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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Optional, Tuple
from urllib.parse import urlparse

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError

from kvj.errors import FormatError, KvjError


class LostRace(KvjError):
    """A conditional write found the object changed (HTTP 412, or 409 ConditionalRequestConflict)."""


class RemoteUnavailable(OSError):
    """The object store could not be reached or refused the request (retry later)."""


@dataclass(frozen=True)
class ObjectInfo:
    path: str
    size: int
    mtime: float  # last modified, Unix seconds


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
    """A replica's objects, addressed by paths relative to the replica's prefix."""

    def __init__(self, store: Any, url: str):
        self.store = store
        self.url = url

    # -- reads ------------------------------------------------------------------------

    def get(self, path: str) -> Optional[Tuple[bytes, Optional[str]]]:
        """(bytes, ETag) of ``path``, or None when it does not exist."""
        try:
            result = obstore.get(self.store, path)
            data = bytes(result.bytes())
        except (NotFoundError, FileNotFoundError):
            return None
        except BaseError as exc:
            raise _unavailable(exc, f"reading {path}") from None
        return data, result.meta.get("e_tag")

    def read(self, path: str) -> bytes:
        """The bytes of ``path``; a missing object is an error naming it."""
        found = self.get(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "missing object in the replica", f"{self.url}/{path}")
        return found[0]

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (a folder such as ``segments/``)."""
        try:
            for batch in obstore.list(self.store, prefix):
                for meta in batch:
                    yield ObjectInfo(meta["path"], meta["size"], meta["last_modified"].timestamp())
        except BaseError as exc:
            raise _unavailable(exc, f"listing {prefix}") from None

    # -- writes -----------------------------------------------------------------------

    def put_create(self, path: str, data: Any) -> Optional[str]:
        """Create ``path`` only if absent (If-None-Match: *); its ETag, or None if it existed."""
        try:
            return obstore.put(self.store, path, data, mode="create")["e_tag"]
        except (AlreadyExistsError, PreconditionError):
            return None
        except BaseError as exc:
            if _conflict(exc):
                return None
            raise _unavailable(exc, f"writing {path}") from None

    def put_if_match(self, path: str, data: bytes, etag: Optional[str]) -> Optional[str]:
        """Replace ``path`` if its ETag is still ``etag`` (create it if ``etag`` is None); new ETag.

        Raises ``LostRace`` when another writer changed (or created) it first.
        """
        mode: Any = "create" if etag is None else {"e_tag": etag}
        try:
            return obstore.put(self.store, path, data, mode=mode)["e_tag"]
        except (AlreadyExistsError, PreconditionError):
            raise LostRace(f"{self.url}/{path} changed under us") from None
        except BaseError as exc:
            if _conflict(exc):
                raise LostRace(f"{self.url}/{path} changed under us (409)") from None
            raise _unavailable(exc, f"writing {path}") from None

    def delete(self, path: str) -> None:
        """Remove ``path`` (no error when it is already gone)."""
        try:
            obstore.delete(self.store, path)
        except (NotFoundError, FileNotFoundError):
            return
        except BaseError as exc:
            raise _unavailable(exc, f"deleting {path}") from None


def open_remote(url: str, *, retries: int = 3, timeout: float = 30.0) -> Remote:
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
    client: dict = {"timeout": timedelta(seconds=timeout), "connect_timeout": timedelta(seconds=min(timeout, 10))}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
        client["allow_http"] = True
    retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout)}
    prefix = parsed.path.strip("/") or None
    store = S3Store(parsed.netloc, prefix=prefix, client_options=client, retry_config=retry, **kwargs)
    return Remote(store, url.rstrip("/"))
