"""Running on a Ray cluster: is the named cluster there, and may this run use more than one node.

Nothing here imports Ray: ``services/runtime.py`` asks Ray for the address and the node count
and calls these checks, so that a bad address or a node-local setting fails with one line
before any worker starts and before any MLflow run is opened.
"""

from __future__ import annotations

import socket

from pipelines.config import Config, ConfigError
from pipelines.data import FILE_DATASETS

# Seconds to wait for a TCP connection to the cluster's GCS before calling it unreachable.
PROBE_TIMEOUT_S = 5.0


class ClusterError(RuntimeError):
    """The Ray cluster named by ``--address`` / $RAY_ADDRESS cannot be reached, or has no room
    for what a command asks of it; the message (one line) names the cluster or the ask and what
    to do."""


def host_port(address: str) -> tuple[str, int]:
    """``host:port`` of a Ray address (``ray://`` / ``http://`` schemes and paths stripped)."""
    bare = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterError(f"Ray address {address!r} is not host:port (or auto)")
    return host.strip("[]"), int(port)


def probe(address: str, *, named_by: str = "--address", timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`ClusterError` unless something accepts connections at ``address``.

    Why: ``ray.init`` on an address where no cluster runs retries for minutes (measured with
    Ray 2.60: still retrying after 5 min) and then ends in a traceback; a TCP connect answers
    at once. ``named_by`` says where the address came from in the message.
    """
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster at {address} ({named_by}): {exc.strerror or exc}; start one with "
            "`ray start --head` or fix the address (without --address a fresh local instance starts)"
        ) from exc


def is_local_tracking(uri: str) -> bool:
    """A tracking URI that is a store on this machine (sqlite file, file store, a plain path)."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    return scheme in ("", "file", "sqlite")


def node_local_settings(cfg: Config, tracking_uri: str) -> list[str]:
    """What in ``cfg`` would keep state on one node of a multi-node cluster, each with its fix.

    Checkpoints in a local folder (each node would write and look for its own), a local
    tracking store (rank 0 may run on another node and log into that node's file), a local
    data folder (every node would need its own copy at the same path). A local folder passes
    when ``tracking.shared_storage`` declares it mounted on every node (NFS); a sqlite store
    never does (its locking is unsafe over NFS).
    """
    shared = cfg.tracking.shared_storage
    problems = []
    storage = cfg.tracking.storage_path or "runs"
    if not storage.startswith("s3://") and not shared:
        problems.append(
            f"tracking.storage_path={storage} is a folder on one node (a worker restarted on another node "
            "would find no checkpoint): set tracking.storage_path=s3://BUCKET/PREFIX, or "
            "tracking.shared_storage=true if every node mounts it at the same path (NFS)"
        )
    if is_local_tracking(tracking_uri):
        problems.append(
            f"tracking.tracking_uri={tracking_uri} is a store on one node (rank 0 may run on another node and "
            "log into that node's copy): set tracking.tracking_uri (or $MLFLOW_TRACKING_URI) to an MLflow "
            "server, e.g. http://HOST:5000 (`proxydml stack up` starts one)"
        )
    if cfg.data.name in FILE_DATASETS and "://" not in cfg.data.root and not shared:
        root = cfg.data.root or f"./data/{cfg.data.name}"
        problems.append(
            f"data.root={root} is a folder on one node (workers elsewhere would not find it): upload it with "
            f"`proxydml data push {root} s3://BUCKET/PREFIX` and set data.root=s3://BUCKET/PREFIX, or "
            "tracking.shared_storage=true if every node mounts it at the same path"
        )
    return problems


def require_shared_state(cfg: Config, tracking_uri: str, nodes: int) -> None:
    """Raise :class:`ConfigError` (one line, every problem with its fix) when the cluster has
    more than one node and ``cfg`` keeps checkpoints, tracking or data on one of them."""
    if nodes <= 1:
        return
    problems = node_local_settings(cfg, tracking_uri)
    if problems:
        raise ConfigError(f"the Ray cluster has {nodes} nodes and " + "; and ".join(problems))
