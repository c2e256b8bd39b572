"""OpenStack Swift on one node with its S3 API: the local stack's durable object store.

Why Swift: the stack needs an S3-compatible server that keeps objects on disk and installs
from the registries we reach. MinIO, SeaweedFS and Garage have no package there; moto keeps
objects in memory. Swift is a production object store (PyPI ``swift``, also in Debian), its
``s3api`` middleware speaks the S3 API that boto3, pyarrow and the MLflow server use
(signature v4, multipart uploads, ListObjectsV2), and one replica on one device is its
documented all-in-one layout.

Layout under ``ROOT`` (the stack's ``STATE/swift``): ``swift.conf`` (hash prefix and suffix,
written once: objects are placed by them), the account/container/object rings (built once,
with the three storage servers' ports), one config per server, and ``node/d1``, the device
that holds every object. Nothing outside ``ROOT`` is read or written.

``python -m services.swift ROOT`` runs the proxy and the three storage servers as children
and exits when any of them does. Swift's servers call ``setsid`` when they start, which takes
them out of the launcher's process group, so the launcher stops them itself on SIGTERM and the
kernel kills them (parent-death signal) if the launcher is killed outright.
"""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.net import HOST, free_port
from services.private_files import write_private
from services.s3 import Credentials

ACCOUNT = "proxydml"  # Swift account AUTH_proxydml holds every bucket; the S3 access key is ACCOUNT:USER
STORAGE_SERVERS = ("account", "container", "object")
SERVERS = (*STORAGE_SERVERS, "proxy")
_PR_SET_PDEATHSIG = 1


def tool(name: str) -> str | None:
    """A Swift executable: beside this Python (the venv's ``swift`` package), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def installed() -> bool:
    """Whether the Swift servers and ring builder can be run."""
    return all(tool(f"swift-{n}-server") for n in SERVERS) and tool("swift-ring-builder") is not None


def generate_credentials() -> Credentials:
    """S3 keys Swift's tempauth accepts: the access key names the account and a user."""
    return Credentials(f"{ACCOUNT}:{secrets.token_hex(4)}", secrets.token_urlsafe(24))


def check_credentials(creds: Credentials) -> None:
    """Swift's S3 access key is ``ACCOUNT:USER``; other keys would be refused with a 403."""
    account, sep, user = creds.access_key.partition(":")
    if account != ACCOUNT or not sep or not user.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"the Swift S3 server takes access keys of the form {ACCOUNT}:USER (letters, digits, "
                         f"- or _), got {creds.access_key!r}")


def prepare(root: Path, port: int, creds: Credentials) -> None:
    """Write Swift's configuration under ``root`` for an S3 endpoint on 127.0.0.1:``port``.

    The hash prefix/suffix and the rings are created on the first call only (objects are
    placed by them, so changing them would lose every object); the server configs are
    rewritten every time, so new keys or a new port take effect at the next start.
    """
    check_credentials(creds)
    root.mkdir(parents=True, exist_ok=True)
    (root / "node" / "d1").mkdir(parents=True, exist_ok=True)
    ports_file = root / "ring-ports.json"
    if not (root / "swift.conf").exists():
        (root / "swift.conf").write_text(
            "[swift-hash]\n"
            f"swift_hash_path_suffix = {secrets.token_hex(16)}\n"
            f"swift_hash_path_prefix = {secrets.token_hex(16)}\n\n"
            "[storage-policy:0]\nname = Policy-0\ndefault = yes\n"
        )
    if not ports_file.exists():
        ports = {name: free_port() for name in STORAGE_SERVERS}
        builder = tool("swift-ring-builder") or "swift-ring-builder"
        for name, ring_port in ports.items():
            ring = str(root / f"{name}.builder")
            # 2^8 partitions, 1 replica, min 1 h between moves: the all-in-one layout.
            for args in (["create", "8", "1", "1"], ["add", f"r1z1-{HOST}:{ring_port}/d1", "1"], ["rebalance"]):
                subprocess.run([builder, ring, *args], check=True, capture_output=True, cwd=root)
        ports_file.write_text(json.dumps(ports) + "\n")  # last: a half-built ring set is rebuilt
    ports = json.loads(ports_file.read_text())
    user = pwd.getpwuid(os.getuid()).pw_name
    common = (
        "[DEFAULT]\n"
        f"bind_ip = {HOST}\n"
        "workers = 0\n"  # one process per server: a one-node store on a small machine
        f"swift_dir = {root}\n"
        f"devices = {root / 'node'}\n"
        "mount_check = false\n"
        f"user = {user}\n"
        "log_level = WARNING\n"
        # No syslog: a missing socket path makes Swift log to its console (our log file) only.
        f"log_address = {root / 'no-syslog'}\n"
    )
    for name in STORAGE_SERVERS:
        (root / f"{name}-server.conf").write_text(
            common + f"bind_port = {ports[name]}\n\n"
            f"[pipeline:main]\npipeline = {name}-server\n\n[app:{name}-server]\nuse = egg:swift#{name}\n"
        )
    user_key = creds.access_key.partition(":")[2]
    # Section name -> Swift's entry point for each plain filter of the pipeline.
    filters = {"catch_errors": "catch_errors", "gatekeeper": "gatekeeper", "healthcheck": "healthcheck",
               "proxy-logging": "proxy_logging", "listing_formats": "listing_formats", "copy": "copy",
               "slo": "slo", "dlo": "dlo"}
    # The proxy's config holds the secret key: mode 0600 from creation on.
    write_private(
        root / "proxy-server.conf",
        common + f"bind_port = {port}\n\n"
        "[pipeline:main]\n"
        # s3api authenticates S3 requests against tempauth's users; slo serves multipart uploads.
        "pipeline = catch_errors gatekeeper healthcheck proxy-logging listing_formats s3api tempauth "
        "copy slo dlo proxy-logging proxy-server\n\n"
        "[app:proxy-server]\nuse = egg:swift#proxy\naccount_autocreate = true\n\n"
        f"[filter:s3api]\nuse = egg:swift#s3api\nlocation = {creds.region}\n\n"
        f"[filter:tempauth]\nuse = egg:swift#tempauth\nuser_{ACCOUNT}_{user_key} = {creds.secret_key} .admin\n\n"
        + "".join(f"[filter:{section}]\nuse = egg:swift#{egg}\n\n" for section, egg in filters.items())
    )


def ring_ports(root: Path) -> dict[str, int]:
    """The storage servers' ports, fixed in the rings when they were built."""
    try:
        return {k: int(v) for k, v in json.loads((root / "ring-ports.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


def command(root: Path) -> list[str]:
    """The launcher's command line (no secret on it: keys live in the 0600 proxy config)."""
    return [sys.executable, "-m", "services.swift", str(root)]


def _die_with_parent() -> None:
    # The kernel sends SIGKILL to the child when the launcher dies, even by SIGKILL.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(root: str) -> int:
    """Run the four servers until one exits or SIGTERM/SIGINT arrives; stop the rest."""
    base = Path(root)
    children = [
        subprocess.Popen([tool(f"swift-{name}-server") or f"swift-{name}-server", str(base / f"{name}-server.conf"),
                          "--verbose"], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL)
        for name in SERVERS
    ]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        exited = [c for c in children if c.poll() is not None]
        if exited:
            code = exited[0].returncode or 1
            print(f"swift: {exited[0].args[0]} exited with code {exited[0].returncode}; stopping", flush=True)
            break
        time.sleep(0.2)
    for c in children:
        if c.poll() is None:
            c.terminate()
    deadline = time.monotonic() + 10
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
