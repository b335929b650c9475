"""The two inputs of a build: scanning the EXL3 checkpoint and the Engram release, and the build fingerprint.

Every input file is listed, every safetensors header read once (``pack_tools.st.read_header``), the download
receipt (``.pack-tools-input.json``) checked against the files' sizes, and the Engram tables checked against the
text config. Nothing here writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from pack_tools import v41
from pack_tools.config import PackConfig
from pack_tools.errors import PackError
from pack_tools.manifest import INDEX_NAME, hash_file
from pack_tools.st import Header, read_header

__all__ = ["INPUT_RECEIPT", "BuildInputs", "ScannedDir", "fingerprint_inputs", "read_inputs"]

#: Written by ``pack-tools download`` (and ``synth``) into an input directory: where the files came from and
#: their sizes and sha256 where known.
INPUT_RECEIPT = ".pack-tools-input.json"


@dataclasses.dataclass
class ScannedDir:
    """One input directory: its files, the headers of its safetensors shards, its download receipt."""

    root: Path
    files: list[str]  # relative POSIX paths, hidden files excluded
    headers: dict[str, Header]
    receipt: dict[str, Any] | None


@dataclasses.dataclass
class BuildInputs:
    """Everything ``build_pack`` reads before it writes anything."""

    source_cfg: dict[str, Any]  # the EXL3 checkpoint's config.json
    tc: Any  # its text config (``v41.text_config``)
    ex: ScannedDir  # the EXL3 checkpoint
    where: dict[str, str]  # tensor name -> EXL3 shard (relative path)
    en: ScannedDir  # the Engram release (headers of the shards holding the tables only)
    engram_keys: dict[str, str]  # Engram table tensor name -> Engram shard (relative path)


def scan(root: Path, what: str, only: set[str] | None = None) -> ScannedDir:
    """List ``root`` (hidden files excluded), read the headers of its shards (those in ``only`` when given)."""
    if not root.is_dir():
        raise PackError(f"{root}: {what} input is not a directory")
    files: list[str] = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(root)
        for n in sorted(names):
            if not n.startswith("."):
                files.append((rel_dir / n).as_posix())
    receipt = None
    rp = root / INPUT_RECEIPT
    if rp.exists():
        try:
            receipt = json.loads(rp.read_text())
        except ValueError as e:
            raise PackError(f"{rp}: not valid JSON ({e})") from None
    headers: dict[str, Header] = {}
    for rel in files:
        if rel.endswith(".safetensors") and (only is None or rel in only):
            headers[rel] = read_header(root / rel, display=f"{root.name}/{rel}")
    if receipt:
        for rel, meta in receipt.get("files", {}).items():
            p = root / rel
            if p.exists() and isinstance(meta, dict) and isinstance(meta.get("size"), int):
                if p.stat().st_size != meta["size"]:
                    raise PackError(
                        f"{root.name}/{rel}: size {p.stat().st_size} bytes, the download receipt says "
                        f"{meta['size']} (incomplete or damaged download; rerun pack-tools download)"
                    )
    return ScannedDir(root, files, headers, receipt)


def read_json(p: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``p``; PackError naming the file when it is missing or not a JSON object."""
    if not p.is_file():
        raise PackError(f"{p}: missing ({what})")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PackError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise PackError(f"{p}: expected a JSON object")
    return obj


def read_inputs(exl3: Path, engram: Path) -> BuildInputs:
    """Scan and check both inputs: duplicate tensors, the checkpoint's index, the Engram tables' layout."""
    source_cfg = read_json(exl3 / "config.json", "the EXL3 checkpoint's config.json")
    tc = v41.text_config(source_cfg)
    ex = scan(exl3, "EXL3 checkpoint")
    if not ex.headers:
        raise PackError(f"{exl3}: no *.safetensors shards in the EXL3 checkpoint")
    where: dict[str, str] = {}
    for rel, h in ex.headers.items():
        for name in h.tensors:
            if name in where:
                raise PackError(f"{exl3.name}/{rel}: {name}: also in {where[name]} (duplicate tensor)")
            where[name] = rel
    src_index = exl3 / INDEX_NAME
    if src_index.exists():
        for name, rel in read_json(src_index, "index")["weight_map"].items():
            if where.get(name) != rel:
                found = f"found in {where[name]}" if name in where else "in no shard"
                raise PackError(f"{exl3.name}/{rel}: {name}: named by {INDEX_NAME} but {found}")
    engram_index = read_json(engram / INDEX_NAME, "the Engram release's index")
    en_map: dict[str, str] = engram_index.get("weight_map", {})
    engram_keys = {n: f for n, f in en_map.items() if v41.ENGRAM_TABLE_RE.match(n)}
    en = scan(engram, "Engram", only=set(engram_keys.values()))
    check_engram(tc, engram, en, engram_keys)
    return BuildInputs(source_cfg, tc, ex, where, en, engram_keys)


def check_engram(tc: Any, engram: Path, en: ScannedDir, keys: dict[str, str]) -> None:
    """The Engram tables: one weight + scale pair per ``engram_layer_ids`` entry, shapes and row counts."""
    layers = tc.get("engram_layer_ids")
    want_rows = tc.get("engram_num_embeddings")
    found: dict[int, dict[str, str]] = defaultdict(dict)
    for name, file in keys.items():
        m = v41.ENGRAM_TABLE_RE.match(name)
        assert m is not None
        found[int(m["layer"])][m["part"]] = name
        if file not in en.headers:
            raise PackError(f"{engram.name}/{file}: missing Engram shard (the index names {name} in it)")
        t = en.headers[file].tensors.get(name)
        if t is None:
            raise PackError(f"{engram.name}/{file}: {name}: named by {INDEX_NAME} but not in the shard")
        v41.check_engram_table_shape(name, t.dtype, t.shape, f"{engram.name}/{file}")
    if layers is None:
        layers = sorted(found)
    if sorted(found) != sorted(layers) or any(set(found[i]) != {"weight", "scale"} for i in layers):
        raise PackError(
            f"{engram.name}/{INDEX_NAME}: expected layers.N.engram.embed.{{weight,scale}} for engram_layer_ids "
            f"{list(layers)}, found {sorted(keys)}"
        )
    for i, layer in enumerate(layers):
        wname, sname = found[layer]["weight"], found[layer]["scale"]
        w = en.headers[keys[wname]].tensors[wname]
        s = en.headers[keys[sname]].tensors[sname]
        if s.shape[0] != w.shape[0] or s.shape[1] * 32 != w.shape[1]:
            raise PackError(f"{engram.name}/{keys[sname]}: {sname}: shape {list(s.shape)} does not match table "
                            f"{list(w.shape)} (one scale per 32 columns)")  # fmt: skip
        if want_rows is not None and i < len(want_rows) and w.shape[0] != want_rows[i]:
            raise PackError(
                f"{engram.name}/{keys[wname]}: {wname}: {w.shape[0]} rows, config engram_num_embeddings[{i}] "
                f"says {want_rows[i]}"
            )


def fingerprint_inputs(exl3: Path, engram: Path, config: PackConfig) -> str:
    """The build's identity: tool version, configuration, and every input file's size and header/content hash.

    Two builds with the same fingerprint produce the same pack, so a partial build directory named after it
    can be resumed.
    """
    from pack_tools import __version__

    ex = scan(exl3, "EXL3 checkpoint")
    en = scan(engram, "Engram")
    return fingerprint(ex, en, config, __version__)


def fingerprint(ex: ScannedDir, en: ScannedDir, config: PackConfig, version: str) -> str:
    """``fingerprint_inputs`` over already scanned inputs."""
    h = hashlib.sha256()
    h.update(json.dumps({"tool": version, "config": dataclasses.asdict(config)}, sort_keys=True).encode())
    for tag, inp in (("exl3", ex), ("engram", en)):
        for rel in inp.files:
            p = inp.root / rel
            size = p.stat().st_size
            if rel in inp.headers:
                ident = inp.headers[rel].sha256
            elif size <= (64 << 20):
                ident = hash_file(p)
            else:
                ident = f"mtime:{p.stat().st_mtime_ns}"
            h.update(f"{tag}\0{rel}\0{size}\0{ident}\n".encode())
    return h.hexdigest()


def input_info(inp: ScannedDir) -> dict[str, Any]:
    """What ``pack.json`` records of one input directory."""
    r = inp.receipt or {}
    return {
        "dir": inp.root.name,
        "repo_id": r.get("repo_id"),
        "revision": r.get("revision"),
        "source": r.get("source"),
        "files": len(inp.files),
        "bytes": sum((inp.root / f).stat().st_size for f in inp.files),
    }


def known_input_sha256(
    inputs: BuildInputs, link_names: dict[str, Path], engram_links: dict[str, str]
) -> dict[str, str]:
    """Pack link name -> sha256 of its target, for every input file whose download receipt lists one."""
    known: dict[str, str] = {}
    for tag, inp in (("exl3", inputs.ex), ("engram", inputs.en)):
        files = (inp.receipt or {}).get("files", {})
        for rel, meta in files.items():
            if isinstance(meta, dict) and isinstance(meta.get("sha256"), str):
                link = engram_links.get(rel) if tag == "engram" else (rel if rel in link_names else None)
                if link:
                    known[link] = meta["sha256"]
    return known
