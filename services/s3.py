"""S3 and S3-compatible storage (MinIO, moto): the one place that builds S3 clients.

- :func:`endpoint_from_env`: the endpoint of an S3-compatible server, from
  $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL (None: AWS itself).
- :func:`s3_client`: a boto3 client; keys given explicitly (the local stack's) or, when none
  are, from the environment or the AWS profile -- never from a config that gets logged.
- :func:`retrying_s3_filesystem`: a pyarrow ``S3FileSystem`` whose requests ride out ~25 s of
  an unreachable server (:data:`S3_MAX_ATTEMPTS`), also in the processes it is pickled to.
- :func:`ray_storage`: the ``(storage_path, filesystem)`` pair Ray Train's RunConfig takes.

Used by ``services/runtime.py`` (checkpoint storage), ``services/snapshots.py`` (data
snapshots) and ``services/stack.py`` (the local dev servers). Nothing here imports Ray, and
boto3 and pyarrow are imported on first use (``proxydml stack`` never needs pyarrow).
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import pyarrow.fs

DEFAULT_REGION = "us-east-1"
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# Attempts per S3 request: pyarrow's AwsDefaultS3RetryStrategy waits 25 ms x 2^k between
# them, so 10 attempts ride out ~25 s of an unreachable server (measured: 25.6 s against a
# refused port; 3 attempts, pyarrow's default, give up after ~0.5 s).
S3_MAX_ATTEMPTS = 10
# Attempts per boto3 request (botocore's legacy retry mode).
BOTO_MAX_ATTEMPTS = 3


class S3SetupError(RuntimeError):
    """What S3 storage needs is missing (keys, bucket); the message says which."""


@dataclass(frozen=True)
class Credentials:
    """S3 keys. ``repr`` hides the secret so it never lands in a log."""

    access_key: str
    secret_key: str
    region: str = DEFAULT_REGION

    def __repr__(self) -> str:
        return f"Credentials(access_key={self.access_key!r}, secret_key='***', region={self.region!r})"

    def env(self) -> dict[str, str]:
        """The AWS SDK variables (boto3, pyarrow, the MLflow server all read these)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Credentials | None:
        """The keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, if both are set."""
        env = os.environ if environ is None else environ
        key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            return None
        return cls(key, secret, env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or DEFAULT_REGION)

    @classmethod
    def generate(cls) -> Credentials:
        """Fresh test keys; lengths satisfy MinIO (user >= 3, password >= 8 characters)."""
        return cls("proxydml-" + secrets.token_hex(4), secrets.token_urlsafe(24))


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """$AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL (an S3-compatible server), else None (AWS)."""
    env = os.environ if environ is None else environ
    return next((env[k] for k in ENDPOINT_ENV if env.get(k)), None)


def s3_client(endpoint: str | None = None, credentials: Credentials | None = None) -> Any:
    """A boto3 S3 client with path-style addressing (no DNS name per bucket).

    ``endpoint``: the server (``http://127.0.0.1:9000``), else :func:`endpoint_from_env`, else
    AWS. ``credentials``: explicit keys, else boto3's own lookup (environment, AWS profile).
    """
    import boto3
    from botocore.config import Config as BotoConfig

    endpoint = endpoint or endpoint_from_env()
    if endpoint:
        # An S3-compatible server: never let the SDK fall back to the cloud metadata address
        # (not loopback).
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    keys: dict[str, str] = {}
    if credentials is not None:
        keys = {"aws_access_key_id": credentials.access_key, "aws_secret_access_key": credentials.secret_key,
                "region_name": credentials.region}
    # A session of its own: boto3's default session keeps the first keys it resolved for the
    # life of the process, so a later change of $AWS_ACCESS_KEY_ID (another stack, a rotated
    # key) would sign with the old one.
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint or None, **keys,
        config=BotoConfig(s3={"addressing_style": "path"}, retries={"max_attempts": BOTO_MAX_ATTEMPTS}),
    )


def list_keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    """Every object key of ``bucket`` under ``prefix``, all pages (``client``: :func:`s3_client`)."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def ray_storage(
    endpoint: str,
    bucket: str,
    prefix: str = "ray",
    credentials: Credentials | None = None,
) -> tuple[str, pyarrow.fs.S3FileSystem]:
    """``(storage_path, filesystem)`` for Ray Train's RunConfig on the S3 server ``endpoint``.

    The path is ``"bucket/prefix"`` without a scheme: Ray rejects an ``s3://`` URI together
    with a filesystem object (docs/operations.md). Keys: ``credentials``, else
    $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY.
    """
    credentials = credentials or Credentials.from_env()
    if credentials is None:
        raise S3SetupError("ray_storage: no S3 credentials given and none in AWS_ACCESS_KEY_ID")
    if not bucket:
        raise S3SetupError("ray_storage: no bucket given")
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    # With explicit keys and region the AWS SDK has no reason to ask the metadata address,
    # but an unset region lookup still may: keep it off (not loopback).
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    fs = retrying_s3_filesystem(
        access_key=credentials.access_key, secret_key=credentials.secret_key,
        region=credentials.region, endpoint_override=parts.netloc, scheme=parts.scheme or "http",
    )
    path = f"{bucket}/{prefix.strip('/')}" if prefix.strip("/") else bucket
    return path, fs


def retrying_s3_filesystem(max_attempts: int = S3_MAX_ATTEMPTS, **options: Any) -> pyarrow.fs.S3FileSystem:
    """A pyarrow ``S3FileSystem(**options)`` whose requests retry ``max_attempts`` times, also
    in the processes it is pickled to.

    Why: Ray ships the RunConfig's filesystem to its Train controller and to every worker by
    pickling, and pyarrow's pickling drops ``retry_strategy`` (pyarrow 25): the copies fell
    back to 3 quick attempts, and one S3 blip while the controller wrote its checkpoint
    snapshot failed the whole run (a ControllerError, which FailureConfig does not retry).
    The deterministic default strategy (no jitter, no retry quota) keeps the outage it
    covers predictable.
    """
    return _retrying_s3_class()(max_attempts=max_attempts, **options)


@functools.cache
def _retrying_s3_class() -> type:
    # Built on first use: importing pyarrow costs ~0.25 s that ``proxydml stack`` never needs.
    import pyarrow.fs

    class RetryingS3FileSystem(pyarrow.fs.S3FileSystem):
        def __init__(self, *, max_attempts: int, **options: Any) -> None:
            super().__init__(retry_strategy=pyarrow.fs.AwsDefaultS3RetryStrategy(max_attempts=max_attempts),
                             **options)
            self._rebuild_args = (max_attempts, options)

        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return _rebuild_retrying_s3, self._rebuild_args

    return RetryingS3FileSystem


def _rebuild_retrying_s3(max_attempts: int, options: dict[str, Any]) -> pyarrow.fs.S3FileSystem:
    return retrying_s3_filesystem(max_attempts, **options)
