"""Where the durable tier keeps its checkpoints: a directory (a local disk, an FSx/Lustre or NFS mount) or an S3
bucket and prefix (s3://bucket/prefix, or any S3-compatible store through AWS_ENDPOINT_URL).

Why checked at start (`open_store`): a fallback_dir that cannot work - an unknown scheme, a missing bucket,
credentials the store refuses, the extra not installed - must end the job before its first step with one line
naming the fix (CheckpointStoreError / MissingDependencyError: exit 2 in a launched worker), not surface hours
later as a checkpoint that was never written. A URL is never taken as a relative path: `s3://ckpt/run` once
made a local directory named `s3:`.

Why boto3 (the AWS SDK itself) rather than s3fs or obstore: it finds credentials exactly as every other AWS
tool does (environment, shared profile, SSO, instance and pod roles, AWS_ENDPOINT_URL for S3-compatible
stores), its transfer manager uploads large objects in parallel multipart pieces from a stream (bounded
memory), and it has no pinned-version coupling (s3fs pins aiobotocore, which pins botocore). The upload and
download rates against a loopback server are in BENCHMARKS.md ("Durable tier").

Keys are relative to the store's root ("step_000000000006/manifest.json"); objects are written whole or not
at all (a temporary file and a rename on a filesystem, a single or completed multipart upload on S3).
"""
from __future__ import annotations

import io
import logging
import os
import re
from typing import Any, Iterable, Iterator, Protocol, Sequence, Union

from hyperpodrun.errors import CheckpointStoreError, MissingDependencyError
from hyperpodrun.launch import settings
from hyperpodrun.safe_fs import open_private, private_dir

log = logging.getLogger("hyperpodrun.runtime")

#: the parts an S3 object is uploaded in, and how many at once (host memory: about their product)
PART_BYTES = 16 << 20
PARTS_IN_FLIGHT = 4
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


class Store(Protocol):
    """What the durable tier needs of a place to keep objects."""

    url: str

    def put(self, key: str, chunks: Iterable[bytes]) -> None:
        """Write the object `key` from `chunks`, whole or not at all."""

    def get(self, key: str, limit: int) -> bytes:
        """The object `key`; CheckpointStoreError when it is larger than `limit` bytes."""

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under `prefix`."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these objects (missing ones are not an error)."""


def open_store(location: Union[str, "os.PathLike[str]"]) -> Store:
    """The store `location` names, checked now: CheckpointStoreError or MissingDependencyError with one line
    naming the problem and the fix."""
    text = os.fspath(location)
    if not isinstance(text, str) or not text:
        raise CheckpointStoreError(f"CheckpointManager(fallback_dir={location!r}): give a directory or "
                                   "s3://bucket/prefix")
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.\-]*):", text)
    if scheme and (scheme.group(1).lower() == "s3" or "://" in text):
        if scheme.group(1).lower() != "s3" or not text[3:].startswith("//"):
            raise CheckpointStoreError(f"CheckpointManager(fallback_dir={text!r}): only s3://bucket/prefix URLs "
                                       "and directories are supported; for a mounted filesystem give its path")
        return S3Store(text)
    return DirStore(text)


# ------------------------------------------------------------------------------------------ directories
class DirStore:
    """Objects as files under a directory (0700 directories, 0600 files; a rename makes each one appear)."""

    def __init__(self, root: str) -> None:
        self.root = self.url = os.path.abspath(root)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise CheckpointStoreError(f"CheckpointManager(fallback_dir={root!r}): cannot create it ({exc.strerror}); "
                                       "give a directory this user can write") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CheckpointStoreError(f"CheckpointManager(fallback_dir={root!r}): this user cannot write there; "
                                       "give a directory this user can write")

    def _path(self, key: str, make: bool = False) -> str:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise CheckpointStoreError(f"{key!r} is not a plain key")
        d = self.root
        for part in parts[:-1]:
            d = os.path.join(d, part)
            if make:
                private_dir(d)
        return os.path.join(d, parts[-1])

    def put(self, key: str, chunks: Iterable[bytes]) -> None:
        path = self._path(key, make=True)
        tmp = path + ".tmp"
        with os.fdopen(open_private(tmp), "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def get(self, key: str, limit: int) -> bytes:
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            raise CheckpointStoreError(f"{self.url}/{key}: larger than the {limit} bytes it may have")
        return data

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for d, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(d, self.root)
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and not name.endswith(".tmp"):
                    out.append(key)
        return out

    def delete(self, keys: Sequence[str]) -> None:
        dirs = set()
        for key in keys:
            path = self._path(key)
            for p in (path, path + ".tmp"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            dirs.add(os.path.dirname(path))
        for d in sorted(dirs, reverse=True):
            try:
                os.rmdir(d)
            except OSError:
                pass


# ------------------------------------------------------------------------------------------ S3
class _Chunks(io.RawIOBase):
    """A read-only stream over an iterator of byte chunks (what the transfer manager uploads from)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not self._left:
            try:
                self._left = memoryview(next(self._it)).cast("B")
            except StopIteration:
                return 0
        n = min(len(buf), len(self._left))
        buf[:n] = self._left[:n]
        self._left = self._left[n:]
        return n


class S3Store:
    """Objects in an S3 bucket under a prefix, through boto3 (credentials and endpoint as the AWS SDK finds
    them)."""

    def __init__(self, url: str) -> None:
        rest = url[len("s3://"):]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise CheckpointStoreError(f"CheckpointManager(fallback_dir={url!r}): {bucket!r} is not an S3 bucket "
                                       "name; give s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:
            raise MissingDependencyError(f"CheckpointManager(fallback_dir={url!r}) needs the AWS SDK: "
                                         "pip install 'hyperpodrun[s3]'") from None
        self._errors = botocore.exceptions
        timeout = settings.current().durable_timeout_s
        config = botocore.config.Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=timeout,
                                        read_timeout=timeout, max_pool_connections=2 * PARTS_IN_FLIGHT)
        from boto3.s3.transfer import TransferConfig
        self._transfer = TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                                        max_concurrency=PARTS_IN_FLIGHT, use_threads=True)
        self.client: Any = boto3.session.Session().client("s3", config=config)
        self._check()

    def _check(self) -> None:
        """The bucket exists and these credentials may use it (HeadBucket: s3:ListBucket)."""
        endpoint = getattr(self.client.meta, "endpoint_url", "")
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self._errors.NoCredentialsError:
            raise CheckpointStoreError(f"fallback_dir {self.url}: no AWS credentials found; set AWS_PROFILE or "
                                       "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or run with an instance or pod role"
                                       ) from None
        except self._errors.ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchBucket") or status == 404:
                raise CheckpointStoreError(f"fallback_dir {self.url}: bucket {self.bucket!r} does not exist at "
                                           f"{endpoint}; create it or fix the URL") from None
            raise CheckpointStoreError(f"fallback_dir {self.url}: the store refused these credentials ({code or status}"
                                       f"{': ' + str(err.get('Message')) if err.get('Message') else ''}); check "
                                       "AWS_PROFILE / AWS_ACCESS_KEY_ID and the IAM policy (docs/checkpointless-"
                                       "state.md, 'The durable tier')") from None
        except self._errors.BotoCoreError as exc:
            raise CheckpointStoreError(f"fallback_dir {self.url}: cannot reach the S3 endpoint {endpoint} ({exc}); "
                                       "check AWS_ENDPOINT_URL / AWS_REGION and the network") from None

    def put(self, key: str, chunks: Iterable[bytes]) -> None:
        # buffered: read(n) then returns n bytes until the end (the transfer manager takes a short read for the
        # last part, and S3 refuses a multipart upload whose other parts are under 5 MiB)
        stream = io.BufferedReader(_Chunks(chunks), buffer_size=1 << 20)
        self.client.upload_fileobj(stream, self.bucket, self.prefix + key, Config=self._transfer)

    def get(self, key: str, limit: int) -> bytes:
        got = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        if int(got.get("ContentLength", 0)) > limit:
            got["Body"].close()
            raise CheckpointStoreError(f"{self.url}/{key}: larger than the {limit} bytes it may have")
        data: bytes = got["Body"].read(limit + 1)
        if len(data) > limit:
            raise CheckpointStoreError(f"{self.url}/{key}: larger than the {limit} bytes it may have")
        return data

    def keys(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
        for page in pages:
            out += [obj["Key"][len(self.prefix):] for obj in page.get("Contents", ())]
        return out

    def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": self.prefix + k} for k in keys[i:i + 1000]], "Quiet": True})

