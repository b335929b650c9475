"""``manifest.json``: what a finished pack holds, so that ``verify`` can prove it is intact.

Every file of the pack except ``manifest.json`` itself and hidden files (names starting with ``.``) has an
entry keyed by its path relative to the pack (POSIX separators):

* a generated file (regular file): ``{"kind": "file", "size", "sha256"}``; a generated safetensors file also
  lists its tensors with dtype, shape and the sha256 of each tensor's data bytes, so a flipped byte is
  reported against the tensor that holds it;
* a link to an input file: ``{"kind": "link", "target", "size"}`` plus, for safetensors,
  ``"header_sha256"``, ``"header_bytes"`` and the dtype and shape of each tensor the index names from it
  (all of them when the pack has no index); for other small files the whole-file ``"sha256"``. A link's
  whole-content ``"sha256"`` is recorded only when known (download receipt) or asked for (``hash_links``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pack_tools.errors import PackError
from pack_tools.st import atomic_write_json, read_header

__all__ = [
    "INDEX_NAME",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "hash_file",
    "hash_safetensors",
    "iter_pack_files",
    "load_manifest",
    "write_manifest",
]

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_FORMAT = "pack-tools-manifest"
MANIFEST_VERSION = 1

#: Linked non-safetensors files up to this size are hashed whole (tokenizers, configs, code).
SMALL_LINK_BYTES = 64 << 20
_CHUNK = 8 << 20


def hash_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a whole file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_safetensors(path: str | os.PathLike[str], display: str | None = None) -> tuple[str, dict[str, str]]:
    """sha256 of the whole file and of each tensor's data bytes, in one streamed pass."""
    hdr = read_header(path, display=display)
    whole = hashlib.sha256()
    per: dict[str, str] = {}
    with open(path, "rb") as f:
        whole.update(f.read(hdr.data_start))
        pos = 0
        for name, t in sorted(hdr.tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
            if t.begin > pos:  # a gap (not produced by safetensors, but hash it so the file hash is exact)
                whole.update(f.read(t.begin - pos))
                pos = t.begin
            h = hashlib.sha256()
            left = t.end - t.begin
            if t.begin < pos:  # overlapping tensors: hash from the file directly
                f.seek(hdr.data_start + t.begin)
                h.update(f.read(left))
                f.seek(hdr.data_start + pos)
                per[name] = h.hexdigest()
                continue
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                h.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
            pos = t.end
            per[name] = h.hexdigest()
        while chunk := f.read(_CHUNK):
            whole.update(chunk)
    return whole.hexdigest(), per


def iter_pack_files(pack_dir: Path) -> list[str]:
    """Relative POSIX paths of every file or link of the pack that a manifest covers, sorted."""
    out: list[str] = []
    for root, dirs, files in os.walk(pack_dir, followlinks=False):
        rel_root = Path(root).relative_to(pack_dir)
        keep_dirs = []
        for d in dirs:
            full = Path(root) / d
            if d.startswith("."):
                continue
            if full.is_symlink():  # a link to a directory is recorded as a link, not walked
                out.append((rel_root / d).as_posix())
            else:
                keep_dirs.append(d)
        dirs[:] = keep_dirs
        for f in files:
            if f.startswith("."):
                continue
            rel = (rel_root / f).as_posix()
            if rel == MANIFEST_NAME:
                continue
            out.append(rel)
    return sorted(out)


def _indexed_names(pack_dir: Path) -> dict[str, set[str]] | None:
    p = pack_dir / INDEX_NAME
    if not p.exists():
        return None
    try:
        wm = json.loads(p.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PackError(f"{INDEX_NAME}: cannot read weight_map ({e})") from None
    per: dict[str, set[str]] = defaultdict(set)
    for name, file in wm.items():
        per[file].add(name)
    return per


def write_manifest(
    pack_dir: Path,
    *,
    known_sha256: Mapping[str, str] | None = None,
    hash_links: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``pack_dir/manifest.json`` over everything in the pack, atomically.

    Parameters
    ----------
    pack_dir : the pack directory.
    known_sha256 : whole-content sha256 of linked files, by relative path (from a download receipt);
        recorded as the link's ``"sha256"`` so ``verify --deep`` can check data bytes.
    hash_links : hash the whole content of linked safetensors files that have no known hash (slow).
    extra : more top-level fields (e.g. ``"pack"`` build facts); must be JSON-serialisable.

    Returns
    -------
    The manifest's path.

    Raises
    ------
    PackError naming the file for a dangling link or an unreadable safetensors header.
    """
    pack_dir = Path(pack_dir)
    if not pack_dir.is_dir():
        raise PackError(f"{pack_dir}: not a directory")
    from pack_tools import __version__

    indexed = _indexed_names(pack_dir)
    known = dict(known_sha256 or {})
    files: dict[str, Any] = {}
    for rel in iter_pack_files(pack_dir):
        full = pack_dir / rel
        is_st = rel.endswith(".safetensors")
        if full.is_symlink():
            target = os.readlink(full)
            if not full.exists():
                raise PackError(f"{rel}: dangling link -> {target} (target does not exist)")
            if full.is_dir():
                files[rel] = {"kind": "link", "target": target, "dir": True}
                continue
            entry: dict[str, Any] = {"kind": "link", "target": target, "size": full.stat().st_size}
            if is_st:
                hdr = read_header(full, display=rel)
                entry["header_sha256"] = hdr.sha256
                entry["header_bytes"] = hdr.data_start
                names = indexed.get(rel, set()) if indexed is not None else set(hdr.tensors)
                entry["tensors"] = {
                    n: {"dtype": hdr.tensors[n].dtype, "shape": list(hdr.tensors[n].shape)}
                    for n in sorted(names)
                    if n in hdr.tensors
                }
                if rel in known:
                    entry["sha256"] = known[rel]
                elif hash_links:
                    entry["sha256"] = hash_file(full)
            elif rel in known:
                entry["sha256"] = known[rel]
            elif entry["size"] <= SMALL_LINK_BYTES or hash_links:
                entry["sha256"] = hash_file(full)
            files[rel] = entry
        else:
            entry = {"kind": "file", "size": full.stat().st_size}
            if is_st:
                digest, per = hash_safetensors(full, display=rel)
                hdr = read_header(full, display=rel)
                entry["sha256"] = digest
                entry["tensors"] = {
                    n: {"dtype": t.dtype, "shape": list(t.shape), "sha256": per[n]}
                    for n, t in sorted(hdr.tensors.items())
                }
            else:
                entry["sha256"] = hash_file(full)
            files[rel] = entry
    doc: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "created_by": f"pack-tools {__version__}",
        "files": files,
    }
    if extra:
        for k, v in extra.items():
            if k in doc:
                raise ValueError(f"write_manifest: extra field {k!r} would overwrite a manifest field")
            doc[k] = v
    return atomic_write_json(pack_dir / MANIFEST_NAME, doc, indent=1)


def load_manifest(pack_dir: Path) -> dict[str, Any]:
    """Read and check the shape of ``pack_dir/manifest.json``; PackError naming the field at fault."""
    p = Path(pack_dir) / MANIFEST_NAME
    if not p.is_file():
        raise PackError(f"{MANIFEST_NAME}: missing (not a finished pack)")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise PackError(f"{MANIFEST_NAME}: not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise PackError(f"{MANIFEST_NAME}: format field is not {MANIFEST_FORMAT!r}")
    if doc.get("version") != MANIFEST_VERSION:
        raise PackError(f"{MANIFEST_NAME}: version {doc.get('version')!r} not supported (expected {MANIFEST_VERSION})")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise PackError(f"{MANIFEST_NAME}: files field is missing or not an object")
    for rel, e in files.items():
        if not isinstance(e, dict) or e.get("kind") not in ("file", "link"):
            raise PackError(f"{MANIFEST_NAME}: files[{rel!r}]: kind must be 'file' or 'link'")
        if e["kind"] == "link" and not isinstance(e.get("target"), str):
            raise PackError(f"{MANIFEST_NAME}: files[{rel!r}]: link without a target")
        if not e.get("dir") and not isinstance(e.get("size"), int):
            raise PackError(f"{MANIFEST_NAME}: files[{rel!r}]: size missing")
        if e["kind"] == "file" and not isinstance(e.get("sha256"), str):
            raise PackError(f"{MANIFEST_NAME}: files[{rel!r}]: sha256 missing")
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise PackError(f"{MANIFEST_NAME}: files[{rel!r}]: path escapes the pack")
    return doc
