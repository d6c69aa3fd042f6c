"""What the client libraries under :class:`~casstore.store.FsspecStore` each need: s3fs's
upload options and bodies, the errors by which s3fs says a create-only write found the object,
one aiobotocore session per process, and whether two filesystems reach one service (for
server-side copies)."""

from __future__ import annotations

import functools
import inspect
import io

import fsspec
from fsspec.asyn import AsyncFileSystem

S3FS_SINGLE_PUT_BYTES = 100 << 20  # s3fs sends smaller objects in one PutObject
S3_COPY_OBJECT_BYTES = 5 << 30  # S3's CopyObject copies objects up to 5 GiB


def put_options(fs: fsspec.AbstractFileSystem) -> dict:
    """Keyword arguments of every upload: on s3fs, with awscrt installed, the CRC32C checksum
    (``ChecksumAlgorithm="CRC32C"``) instead of botocore's default CRC32.

    The store checks either against the body and refuses a changed byte (``BadDigest``), and
    botocore checks every download against the checksum the store keeps. awscrt computes
    CRC32C at about 27 GiB/s on one core of the 2-core machine, where zlib's CRC32 runs at
    3.9 GiB/s (and awscrt's at 2.8): both checks run on fsspec's one event-loop thread.
    Without awscrt botocore cannot compute CRC32C, so uploads keep its CRC32; and a client
    whose ``request_checksum_calculation`` is not botocore's default ``"when_supported"``
    (set for a store that refuses checksums it does not know) gets no checksum forced on it.
    """
    if not hasattr(fs, "call_s3"):
        return {}
    try:
        import awscrt.checksums  # noqa: F401

        calculation = fs.s3.meta.config.request_checksum_calculation
    except (ImportError, RuntimeError, AttributeError):  # no awscrt; an asynchronous fs
        return {}
    return {"ChecksumAlgorithm": "CRC32C"} if calculation == "when_supported" else {}


def no_tls_setup(options: dict) -> None:
    """Sets ``client_kwargs["verify"] = False`` in s3fs ``options`` whose endpoint is plain
    ``http://`` and that say nothing of ``verify``: such a client makes no TLS connection, yet
    aiobotocore loads the CA bundle into an SSL context for each client it makes, 30-66 ms of
    CPU on the 2-core machine (a copy between two S3 stores makes two; every CLI command one).
    An ``https://`` endpoint, or none (AWS), keeps botocore's verification."""
    client = dict(options.get("client_kwargs") or {})
    endpoint = options.get("endpoint_url") or client.get("endpoint_url") or ""
    if endpoint.lower().startswith("http://") and "verify" not in client:
        options["client_kwargs"] = {**client, "verify": False}


def is_exists_error(exc: BaseException) -> bool:
    """True if ``exc`` says a create-only write found the object present.

    s3fs raises FileExistsError on moto and AWS; on SeaweedFS it raises OSError(EINVAL) whose
    cause is a botocore ClientError with code ``PreconditionFailed`` (TESTING-SERVERS.md).
    """
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause else None
    return code in ("PreconditionFailed", "412")


def same_service(a: fsspec.AbstractFileSystem, b: fsspec.AbstractFileSystem) -> bool:
    """Whether ``a`` and ``b`` reach one service as one user: one filesystem, or the same
    class of async filesystem with the same options but for client settings (timeouts,
    retries, pools: s3fs's ``config_kwargs``, gcsfs's ``requests_timeout``) and, for s3fs, the
    same aiobotocore session object (a session may hold its own credentials)."""
    client = ("config_kwargs", "requests_timeout", "skip_instance_cache")
    same = lambda o: {k: v for k, v in o.items() if k not in client}  # noqa: E731
    return a is b or (type(a) is type(b) and isinstance(a, AsyncFileSystem)
                      and same(a.storage_options) == same(b.storage_options))


@functools.cache
def shared_aio_session():
    """One aiobotocore session for every S3 store this process opens. A session caches the
    JSON models botocore parses for each new client (the endpoints, the S3 API and its rules:
    0.08-0.24 s of CPU a client on the 2-core machine), so only the first S3 store pays it.
    Keys and endpoints given in the storage options are each client's own; credentials found
    in the environment or config files are resolved once per process (and refreshed when they
    expire), as boto3's default session does. Pass ``session=None`` for a store of its own."""
    import aiobotocore.session

    return aiobotocore.session.AioSession()


class Body(io.BytesIO):
    """An upload's body for s3fs: a BytesIO holding its own copy of the bytes, which knows
    its length (s3fs's ``pipe_file`` asks). Given bytes, botocore wraps them in a BytesIO that
    shares them, and aiohttp unshares it (a copy of the whole object on fsspec's one
    event-loop thread); given a bytearray, aiohttp sends the object in one write, which
    Python 3.11's asyncio joins with the headers and buffers (two more copies there). This
    one is copied once, in the uploading thread, and sent in 64 KiB pieces. botocore computes
    the upload's checksum from it and seeks back."""

    def __init__(self, data: bytes | memoryview):
        super().__init__()
        self.write(data)
        self.seek(0)

    def __len__(self) -> int:
        return self.getbuffer().nbytes


async def s3_head(fs, path: str, nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of S3 object ``path`` (all of it if it is no longer), in one
    GET without a range: its body is read whole only if its Content-Length is at most
    ``nbytes`` (botocore then checks it against the checksum the store keeps, which S3 sends
    for no ranged GET), else only its first ``nbytes`` bytes, and the response is closed."""
    bucket, key, version = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                 **({"VersionId": version} if version else {}))
    body = response["Body"]
    try:
        if response.get("ContentLength", 0) <= nbytes:
            return await body.read()
        parts, got = [], 0
        while got < nbytes and (part := await body.read(nbytes - got)):
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        body.close()


# fsspec's AbstractFileSystem options, which every filesystem takes
FSSPEC_OPTIONS = {"use_listings_cache", "listings_expiry_time", "max_paths",
                  "skip_instance_cache", "asynchronous", "loop"}


def unknown_storage_options(protocol: str, options: dict) -> str | None:
    """A message naming the ``options`` that the filesystem of ``protocol`` does not take (it
    takes fsspec's common ones and every named parameter of its class's ``__init__`` along its
    class hierarchy), or None. s3fs and gcsfs pass the others on to fsspec, which ignores
    them: a misspelt ``endpoint_url`` went to AWS.

    Raises:
      ValueError, ImportError: fsspec knows no such protocol, or cannot import its package.
    """
    cls = fsspec.get_filesystem_class(protocol)
    known = set(FSSPEC_OPTIONS)
    for klass in cls.__mro__:
        if (init := klass.__dict__.get("__init__")) is not None:
            known |= {p.name for p in inspect.signature(init).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    unknown = sorted(set(options) - known)
    if not unknown:
        return None
    return (f"unknown storage option(s) {', '.join(unknown)} for {protocol}:// "
            f"({cls.__name__}); it takes {', '.join(sorted(known))}")


def checked_options(url: str, options: dict, *timeouts: float) -> dict:
    """``options`` as :meth:`FsspecStore.from_url` gives them to fsspec, ``url`` and they
    checked first.

    Raises:
      ValueError: the path holds an empty segment (``a//b``): servers differ on it (SeaweedFS
        and GCS store ``a/b``, moto ``a//b``), and a listing of one would not find the steps
        saved there; on S3 or GCS, a ``.`` or ``..`` segment (moto stores it as written,
        fake-gcs-server resolves it, SeaweedFS refuses it), or an option the client library
        does not take, which it would ignore (:func:`unknown_storage_options`); a timeout
        that is not a positive number.
    """
    protocol, _, path = url.partition("://")
    if "//" in path.rstrip("/"):
        raise ValueError(f"{url!r} has an empty path segment ('//'); object stores differ "
                         "on such keys, so casstore refuses them: use one '/'")
    if protocol in ("s3", "s3a", "gs", "gcs") and {".", ".."} & set(path.split("/")):
        raise ValueError(f"{url!r} has a '.' or '..' path segment; object stores differ on "
                         "such keys (one stores them as written, another resolves them, "
                         "another refuses them), so casstore refuses them: write the path "
                         "without them")
    if protocol in ("s3", "s3a", "gs", "gcs") and (problem := unknown_storage_options(
            protocol, options)):
        raise ValueError(problem)
    for name, value in zip(("request_timeout_s", "operation_timeout_s"), timeouts):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name}={value!r}: a positive number of seconds")
    if protocol in ("gs", "gcs") and isinstance(options.get("endpoint_url"), str):
        # gcsfs joins "//storage/v1" to one ending in "/": 404s, read as "no repository"
        options = {**options, "endpoint_url": options["endpoint_url"].rstrip("/")}
    return options
