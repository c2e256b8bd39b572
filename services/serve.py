"""Search over HTTP: what one replica of ``proxydml serve`` does, with no web framework in it.

A :class:`SearchService` answers for one registered model. It holds the :class:`Searcher`
(model and index, downloaded and sha256-checked) of the version ``serving`` points at, and a
small cache of other versions a request names. A thread polls the alias every ``poll_s``
seconds; when it moves, the new version is loaded first and then swapped in with one
assignment, so a request either runs wholly on the old searcher or wholly on the new one:
the embedding and the index of an answer always come from the version the answer names.

:meth:`SearchService.handle` maps (method, path, query, body) to a :class:`Reply`;
``services/runtime.py`` (the only module that imports Ray) runs it in Ray Serve replicas. Routes:

- ``POST /search?k=10[&alias=A | &version=V][&exclude=ID]`` -- the body is the image file;
  JSON: model, version, alias, k and the hits (id, path, class, score).
- ``GET /`` -- the page: pick a gallery image or upload one, see ``serving`` and a second
  version side by side, thumbnails marked right or wrong when the query's class is known.
- ``GET /info``, ``GET /examples``, ``GET /image?version=V&id=I`` -- what the page reads.

A request that is wrong gets 400 (not an image, a bad k) or 404 (another model, an unknown
alias or version, a version without an index), each with a one-line ``error``.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services import registry
from services.aliases import PREVIOUS, SERVING
from services.index import IndexBuildError, ModelRef, NotFound, Searcher, open_searcher, resolve_version

log = logging.getLogger(__name__)

MAX_K = 100  # neighbours one request may ask for
MAX_UPLOAD_BYTES = 20 * 1024 * 1024
CACHED_VERSIONS = 4  # searchers kept besides the serving one (challengers the page compares)
PAGE = Path(__file__).with_name("serve_page.html")


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes

    @staticmethod
    def json(payload: Any, status: int = 200) -> Reply:
        return Reply(status, "application/json", json.dumps(payload).encode())

    @staticmethod
    def error(status: int, message: str) -> Reply:
        return Reply.json({"error": message}, status)


class BadRequest(ValueError):
    """The request is malformed (HTTP 400)."""


class SearchService:
    """Answers search requests for model ``name`` with the version its ``alias`` points at.

    ``client`` is an ``MlflowClient`` (a reader's login is enough: serving never writes);
    ``challenger`` is what the page compares with (an alias or a version number).
    """

    def __init__(self, client: Any, name: str, *, alias: str = SERVING, challenger: str = PREVIOUS,
                 poll_s: float = 1.0, cache: Path | None = None) -> None:
        self.client, self.name, self.alias, self.challenger = client, name, alias, challenger
        self.poll_s, self.cache = poll_s, cache
        self._lock = threading.Lock()
        self._others: OrderedDict[str, Searcher] = OrderedDict()
        # Fails (NotFound) at start when the model, the alias or its index is missing.
        self.current: Searcher = open_searcher(client, ModelRef(name, alias, None), cache)
        threading.Thread(target=self._poll, name="serving-alias-poller", daemon=True).start()

    # -- versions ------------------------------------------------------------------------------
    def _poll(self) -> None:
        while True:
            time.sleep(self.poll_s)
            try:
                self.refresh()
            except Exception as exc:  # the registry is away or the new index is bad: keep serving
                log.warning("serving alias poll: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def refresh(self) -> str:
        """Re-read the alias; when it moved, load that version, then swap it in. Returns the
        version now answering."""
        version = registry.aliases_of(self.client, self.name).get(self.alias)
        if version and version != self.current.version:
            searcher = self._searcher_of(version)  # loaded before the swap: no request waits on it
            log.info("%s: %s moved to version %s", self.name, self.alias, version)
            self.current = searcher
        return self.current.version

    def _searcher_of(self, version: str) -> Searcher:
        with self._lock:
            if version == self.current.version:
                return self.current
            if version in self._others:
                self._others.move_to_end(version)
                return self._others[version]
            searcher = open_searcher(self.client, ModelRef(self.name, None, version), self.cache)
            self._others[version] = searcher
            while len(self._others) > CACHED_VERSIONS:
                self._others.popitem(last=False)
            return searcher

    def searcher_for(self, alias: str | None = None, version: str | None = None) -> Searcher:
        """The searcher of a version number, an alias, or (neither) the one now serving."""
        if version is not None:
            if not version.isdigit():
                raise BadRequest(f"version must be a number, got {version!r}")
            return self._searcher_of(version)
        if alias is None or alias == self.alias:
            return self.current  # one read: the whole answer uses this searcher
        return self._searcher_of(str(resolve_version(self.client, ModelRef(self.name, alias, None)).version))

    # -- requests ------------------------------------------------------------------------------
    def search(self, image: bytes, *, k: int, alias: str | None = None, version: str | None = None,
               exclude: int | None = None, name: str = "upload") -> dict[str, Any]:
        """One query image's top ``k`` (``exclude``: a gallery id left out, as a gallery image
        searched for itself)."""
        if not image:
            raise BadRequest("the request has no image: POST the image file as the body")
        searcher = self.searcher_for(alias, version)
        try:
            vector = searcher.embed_images([(name, image)])
        except IndexBuildError as exc:
            raise BadRequest(str(exc)) from exc
        hits = searcher.query(vector, k + (exclude is not None))[0]
        hits = [h for h in hits if h["id"] != exclude][:k]
        return {"model": self.name, "version": searcher.version, "alias": alias or (None if version else self.alias),
                "k": k, "hits": hits}

    def info(self) -> dict[str, Any]:
        challenger: dict[str, Any] = {"ref": self.challenger}
        try:
            ref = {"version": self.challenger} if self.challenger.isdigit() else {"alias": self.challenger}
            challenger["version"] = self.searcher_for(**ref).version
        except (NotFound, registry.RegistryError) as exc:
            challenger["error"] = str(exc)
        return {"model": self.name, "alias": self.alias, "version": self.current.version, "challenger": challenger}

    def examples(self, n: int = 12) -> list[dict[str, Any]]:
        """Up to ``n`` gallery images of the serving version, one per class first."""
        searcher, seen, picked = self.current, set(), []
        for gid, (path, cls) in sorted(searcher.meta.items()):
            if path and cls not in seen:
                seen.add(cls)
                picked.append({"id": gid, "class": cls, "path": path})
            if len(picked) == n:
                break
        return picked

    def image(self, version: str, gid: int) -> tuple[bytes, str]:
        """The gallery file of id ``gid`` in ``version``'s index (only files that index lists)."""
        path = self.searcher_for(version=version).meta.get(gid, ("", ""))[0]
        if not path or not Path(path).is_file():
            raise NotFound(f"version {version} has no gallery file with id {gid}")
        return Path(path).read_bytes(), mimetypes.guess_type(path)[0] or "application/octet-stream"

    def handle(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> Reply:
        """One HTTP request -> its reply (never raises for a client's mistake)."""
        try:
            return self._route(method, path.rstrip("/") or "/", query, body)
        except BadRequest as exc:
            return Reply.error(400, str(exc))
        except (NotFound, registry.RegistryError) as exc:
            return Reply.error(404, str(exc))

    def _route(self, method: str, path: str, query: Mapping[str, str], body: bytes) -> Reply:
        if "model" in query and query["model"] != self.name:
            raise NotFound(f"model {query['model']!r} is not served here (this server serves {self.name!r})")
        if (method, path) == ("POST", "/search"):
            if len(body) > MAX_UPLOAD_BYTES:
                raise BadRequest(f"the image is {len(body)} bytes; at most {MAX_UPLOAD_BYTES} are accepted")
            k = _int(query.get("k", "10"), "k")
            if not 1 <= k <= MAX_K:
                raise BadRequest(f"k must be between 1 and {MAX_K}, got {k}")
            exclude = _int(query["exclude"], "exclude") if query.get("exclude") else None
            return Reply.json(self.search(body, k=k, alias=query.get("alias"), version=query.get("version"),
                                          exclude=exclude, name=query.get("name", "upload")))
        if method != "GET":
            return Reply.error(405, f"{method} {path}: only POST /search and GET pages are served")
        if path == "/":
            return Reply(200, "text/html; charset=utf-8", PAGE.read_bytes())
        if path == "/info":
            return Reply.json(self.info())
        if path == "/examples":
            return Reply.json(self.examples())
        if path == "/image":
            data, ctype = self.image(query.get("version", self.current.version), _int(query.get("id", ""), "id"))
            return Reply(200, ctype, data)
        if path == "/healthz":
            return Reply.json({"ok": True, "version": self.current.version})
        raise NotFound(f"no page {path}: POST /search, GET /, /info, /examples, /image")


def open_service(tracking_uri: str, name: str, *, alias: str = SERVING, challenger: str = PREVIOUS,
                 poll_s: float = 1.0) -> SearchService:
    """The service of model ``name`` on the tracking server at ``tracking_uri`` (what each
    replica builds; the login comes from its environment)."""
    from mlflow.tracking import MlflowClient

    return SearchService(MlflowClient(tracking_uri), name, alias=alias, challenger=challenger, poll_s=poll_s)


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {text!r}") from None
