"""``verify_pack``: every problem of a pack, one line each, naming the file and the tensor.

Checks, in order: the directory is a finished pack (not a ``*.partial-*`` build directory, has a valid
manifest); every manifest entry (links point where recorded and resolve, sizes, header hashes, generated
files' whole and per-tensor hashes; with ``deep`` also linked files' whole content where its hash is known);
no untracked files; every safetensors header is self-consistent and inside its file (a truncated shard);
every tensor the index names is in its shard with the manifest's dtype and shape; every EXL3 linear has a
consistent tensor set; Engram tables have the real layout; the host plan names existing experts.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from pack_tools import v41
from pack_tools.errors import PackError
from pack_tools.manifest import INDEX_NAME, MANIFEST_NAME, hash_file, hash_safetensors, iter_pack_files, load_manifest
from pack_tools.st import Header, header_problems, read_header

__all__ = ["verify_pack"]

_PARTIAL_RE = re.compile(r"\.partial-[^/]*$")
_MARKER_VALUES = {"mcg": -877912083, "mul1": -2082680531}


def verify_pack(path: str | os.PathLike[str], *, deep: bool = False, max_lines_per_file: int = 20) -> list[str]:
    """Check a pack; return ``[]`` when it is valid, else one message per problem.

    Parameters
    ----------
    path : the pack directory.
    deep : also hash the whole content of linked input files whose sha256 the manifest records
        (hundreds of GB for the real inputs); without it, input shards are checked through their headers
        and sizes, and generated files through their whole content.
    max_lines_per_file : cap on the per-tensor lines of one file for one kind of problem (a truncated shard
        damages every tensor after the cut); one more line counts the rest.

    Returns
    -------
    list of ``"<file>: <tensor>: <problem>"`` / ``"<file>: <problem>"`` messages.
    """
    return _Verifier(Path(path), deep, max_lines_per_file).run()


def _index_by_file(pack: Path) -> dict[str, list[str]]:
    try:
        wm = json.loads((pack / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        out: dict[str, list[str]] = defaultdict(list)
        for name, file in wm.items():
            out[str(file)].append(name)
        return dict(out)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # reported by check_index


class _Verifier:
    def __init__(self, pack: Path, deep: bool, cap: int) -> None:
        self.pack = pack
        self.deep = deep
        self.cap = cap
        self.problems: list[str] = []
        self.headers: dict[str, Header | None] = {}
        self.bad_files: set[str] = set()  # missing / unreadable: no per-tensor lines for them
        self.indexed: dict[str, list[str]] = {}  # file -> tensors the index names in it
        self.fds: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        """A read-only descriptor of a pack file, opened once (closed at the end of run)."""
        if rel not in self.fds:
            self.fds[rel] = os.open(self.pack / rel, os.O_RDONLY)
        return self.fds[rel]

    def add(self, msg: str) -> None:
        self.problems.append(msg)

    def header(self, rel: str) -> Header | None:
        if rel not in self.headers:
            try:
                self.headers[rel] = read_header(self.pack / rel, display=rel)
            except PackError as e:
                self.headers[rel] = None
                if rel not in self.bad_files:
                    self.add(str(e))
                self.bad_files.add(rel)
        return self.headers[rel]

    # ------------------------------------------------------------------------------------------ run

    def run(self) -> list[str]:
        try:
            return self._run()
        finally:
            for fd in self.fds.values():
                os.close(fd)

    def _run(self) -> list[str]:
        pack = self.pack
        if not pack.exists():
            return [f"{pack}: does not exist"]
        if not pack.is_dir():
            return [f"{pack}: not a directory"]
        if _PARTIAL_RE.search(pack.name):
            self.add(f"{pack.name}: unfinished build directory (*.partial-*); rerun pack-tools build to finish it")
        try:
            manifest = load_manifest(pack)
        except PackError as e:
            self.add(str(e))
            manifest = None
        listed: dict[str, Any] = manifest["files"] if manifest else {}
        self.indexed = _index_by_file(pack)
        for rel, entry in listed.items():
            self.check_entry(rel, entry)
        if manifest is not None:
            for rel in iter_pack_files(pack):
                if rel not in listed:
                    self.add(f"{rel}: not listed in {MANIFEST_NAME} (untracked file)")
        present = [r for r in iter_pack_files(pack) if r.endswith(".safetensors") and (pack / r).is_file()]
        for rel in present:
            if rel in self.bad_files:
                continue
            h = self.header(rel)
            if h is not None:
                self.problems.extend(header_problems(h, rel, limit=self.cap))
        weight_map = self.check_index(listed)
        self.check_structure(weight_map, present)
        self.check_host_plan(weight_map)
        self.check_config()
        return self.problems

    # ------------------------------------------------------------------------------------ manifest

    def check_entry(self, rel: str, e: dict[str, Any]) -> None:
        full = self.pack / rel
        if not os.path.lexists(full):
            self.bad_files.add(rel)
            what = "link to an input file" if e["kind"] == "link" else "generated file"
            self.add(f"{rel}: missing ({what} listed in {MANIFEST_NAME}){self.tensors_of(rel)}")
            return
        if e["kind"] == "link":
            if not full.is_symlink():
                self.add(f"{rel}: expected a link to {e['target']}, found a regular file (copied input?)")
            else:
                target = os.readlink(full)
                if target != e["target"]:
                    self.add(f"{rel}: link points to {target}, {MANIFEST_NAME} says {e['target']}")
                if not full.exists():
                    self.bad_files.add(rel)
                    self.add(f"{rel}: dangling link -> {target} (target does not exist){self.tensors_of(rel)}")
                    return
            if e.get("dir"):
                return
        elif full.is_symlink():
            self.add(f"{rel}: expected a generated file, found a link to {os.readlink(full)}")
        size = full.stat().st_size
        if size != e["size"]:
            kind = "truncated" if size < e["size"] else "grown"
            self.add(f"{rel}: size {size} bytes, {MANIFEST_NAME} says {e['size']} ({kind} file)")
        if rel.endswith(".safetensors"):
            self.check_safetensors_entry(rel, e)
        elif "sha256" in e and (e["kind"] == "file" or size <= (64 << 20) or self.deep):
            if hash_file(full) != e["sha256"]:
                self.add(f"{rel}: sha256 mismatch (content differs from {MANIFEST_NAME})")

    def check_safetensors_entry(self, rel: str, e: dict[str, Any]) -> None:
        h = self.header(rel)
        if h is None:
            return
        spec: dict[str, Any] = e.get("tensors", {})
        tensor_lines = self.compare_specs(rel, h, spec)
        if e["kind"] == "link":
            if e.get("header_sha256") and h.sha256 != e["header_sha256"] and not tensor_lines:
                self.add(f"{rel}: safetensors header changed (sha256 {h.sha256[:12]}, {MANIFEST_NAME} says "
                         f"{e['header_sha256'][:12]})")  # fmt: skip
            if self.deep and "sha256" in e and hash_file(self.pack / rel) != e["sha256"]:
                self.add(f"{rel}: content sha256 mismatch (flipped or corrupted bytes in the input shard)")
            return
        if hash_file(self.pack / rel) == e["sha256"]:
            return
        _, per = hash_safetensors(self.pack / rel, display=rel)  # locate the damage per tensor
        bad = [n for n, s in spec.items() if n in per and "sha256" in s and per[n] != s["sha256"]]
        for n in bad[: self.cap]:
            self.add(f"{rel}: {n}: data sha256 mismatch (corrupted bytes)")
        if len(bad) > self.cap:
            self.add(f"{rel}: ... and {len(bad) - self.cap} more tensors with corrupted data")
        if not bad and not tensor_lines:
            self.add(f"{rel}: sha256 mismatch (header or padding bytes differ from {MANIFEST_NAME})")

    def tensors_of(self, rel: str) -> str:
        names = self.indexed.get(rel)
        if not names:
            return ""
        return f"; {len(names)} indexed tensors unavailable, e.g. {min(names)}"

    def compare_specs(self, rel: str, h: Header, spec: dict[str, Any]) -> list[str]:
        lines: list[str] = []
        for n, s in spec.items():
            t = h.tensors.get(n)
            if t is None:
                lines.append(f"{rel}: {n}: missing from the shard ({MANIFEST_NAME} lists it)")
            elif t.dtype != s.get("dtype"):
                lines.append(f"{rel}: {n}: dtype {t.dtype}, {MANIFEST_NAME} says {s.get('dtype')}")
            elif list(t.shape) != list(s.get("shape", [])):
                lines.append(f"{rel}: {n}: shape {list(t.shape)}, {MANIFEST_NAME} says {s.get('shape')}")
        self.problems.extend(lines[: self.cap])
        if len(lines) > self.cap:
            self.add(f"{rel}: ... and {len(lines) - self.cap} more tensors differing from {MANIFEST_NAME}")
        return lines

    # --------------------------------------------------------------------------------------- index

    def check_index(self, listed: dict[str, Any]) -> dict[str, str] | None:
        p = self.pack / INDEX_NAME
        if not p.exists():
            if INDEX_NAME in listed:
                return None  # already reported missing
            return None
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
            wm = doc["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.add(f"{INDEX_NAME}: cannot read weight_map ({e})")
            return None
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, file in wm.items():
            by_file[str(file)].append(name)
        for file, names in sorted(by_file.items()):
            full = self.pack / file
            if file in self.bad_files:
                if file not in listed:  # not already reported by the manifest check
                    self.add(f"{file}: shard unreadable ({len(names)} indexed tensors, e.g. {names[0]})")
                continue
            if not os.path.lexists(full):
                self.bad_files.add(file)
                self.add(f"{file}: missing shard ({len(names)} tensors named by {INDEX_NAME}, e.g. {names[0]})")
                continue
            if not full.exists():
                self.bad_files.add(file)
                self.add(f"{file}: dangling link -> {os.readlink(full)} ({len(names)} indexed tensors, "
                         f"e.g. {names[0]})")  # fmt: skip
                continue
            h = self.header(file)
            if h is None:
                continue
            absent = [n for n in names if n not in h.tensors]
            for n in absent[: self.cap]:
                self.add(f"{file}: {n}: named by {INDEX_NAME} but not in the shard")
            if len(absent) > self.cap:
                self.add(f"{file}: ... and {len(absent) - self.cap} more indexed tensors not in the shard")
        total = doc.get("metadata", {}).get("total_size") if isinstance(doc.get("metadata"), dict) else None
        if isinstance(total, int):
            got = 0
            for name, file in wm.items():
                h = self.headers.get(file)
                if h is None or name not in h.tensors:
                    got = -1
                    break
                got += h.tensors[name].nbytes
            if got >= 0 and got != total:
                self.add(f"{INDEX_NAME}: metadata.total_size {total} but the indexed tensors hold {got} bytes")
        return {str(k): str(v) for k, v in wm.items()}

    # ----------------------------------------------------------------------------------- structure

    def check_structure(self, weight_map: dict[str, str] | None, present: list[str]) -> None:
        """EXL3 tensor sets and Engram table layouts over the indexed tensors (every tensor without an index)."""
        where: dict[str, str] = {}
        if weight_map is not None:
            where = {n: f for n, f in weight_map.items() if f not in self.bad_files and self.headers.get(f)}
        else:
            for rel in present:
                h = self.headers.get(rel)
                if h is not None:
                    for n in h.tensors:
                        where.setdefault(n, rel)

        def info(name: str) -> Any:
            h = self.headers[where[name]]
            return h.tensors.get(name) if h else None

        count = 0
        for prefix, parts in sorted(v41.exl3_modules(where).items()):
            msgs = self.exl3_problems(prefix, parts, where, info)
            for msg in msgs:
                if count < 4 * self.cap:
                    self.add(msg)
                count += 1
        if count > 4 * self.cap:
            self.add(f"... and {count - 4 * self.cap} more EXL3 tensor-set problems")
        rows: dict[str, dict[str, tuple[str, Any]]] = defaultdict(dict)
        for name in where:
            m = v41.ENGRAM_TABLE_RE.match(name)
            if not m:
                continue
            t = info(name)
            if t is None:
                continue
            try:
                v41.check_engram_table_shape(name, t.dtype, t.shape, where[name])
            except PackError as e:
                self.add(str(e))
                continue
            rows[m["layer"]][m["part"]] = (where[name], t)
        for layer, table in sorted(rows.items()):
            if "weight" in table and "scale" in table:
                (_fw, w), (fs, s) = table["weight"], table["scale"]
                if s.shape[0] != w.shape[0] or s.shape[1] * 32 != w.shape[1]:
                    self.add(f"{fs}: layers.{layer}.engram.embed.scale: shape {list(s.shape)} does not match "
                             f"table {list(w.shape)} (one scale per 32 columns per row)")  # fmt: skip
            else:
                missing = "scale" if "weight" in table else "weight"
                f = next(iter(table.values()))[0]
                self.add(f"{f}: layers.{layer}.engram.embed.{missing}: missing (the index names only its partner)")

    def exl3_problems(self, prefix: str, parts: set[str], where: dict[str, str], info: Any) -> list[str]:
        out: list[str] = []
        tname = f"{prefix}.trellis"
        t = info(tname)
        if t is None:
            return out
        f = where[tname]
        if t.dtype != "I16" or len(t.shape) != 3:
            return [f"{f}: {tname}: EXL3 trellis must be I16 [k/16, n/16, 16*K], got {t.dtype} {list(t.shape)}"]
        words = t.shape[2]
        if words % 8 or (words / 16) not in (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8):
            out.append(f"{f}: {tname}: last dimension {words} is not 16*K for a supported K")
        k, n = 16 * t.shape[0], 16 * t.shape[1]
        for part, length in (("suh", k), ("svh", n)):
            name = f"{prefix}.{part}"
            if part not in parts:
                legacy = part[:-1]
                if legacy not in parts:
                    out.append(f"{f}: {name}: missing (EXL3 linear {prefix} has a trellis)")
                continue
            s = info(name)
            if s is not None and (s.dtype != "F16" or list(s.shape) != [length]):
                out.append(f"{where[name]}: {name}: must be F16 [{length}], got {s.dtype} {list(s.shape)}")
        markers = [m for m in ("mcg", "mul1") if m in parts]
        if len(markers) > 1:
            out.append(f"{f}: {prefix}: conflicting codebook markers {markers}")
        for m in markers:
            name = f"{prefix}.{m}"
            s = info(name)
            if s is not None and (s.dtype != "I32" or s.shape != ()):
                out.append(f"{where[name]}: {name}: codebook marker must be I32 [], got {s.dtype} {list(s.shape)}")
            elif s is not None:
                h = self.headers[where[name]]
                assert h is not None
                val = int.from_bytes(os.pread(self.fd(where[name]), 4, h.data_start + s.begin), "little", signed=True)
                if val != _MARKER_VALUES[m]:
                    out.append(f"{where[name]}: {name}: marker value {val}, expected {_MARKER_VALUES[m]}")
        return out

    # ----------------------------------------------------------------------------- plan and config

    def check_host_plan(self, weight_map: dict[str, str] | None) -> None:
        p = self.pack / "host-plan.json"
        if not p.exists() or weight_map is None:
            return
        try:
            plan = json.loads(p.read_text())
            if not isinstance(plan, dict):
                raise TypeError("not an object")
        except (OSError, ValueError, TypeError) as e:
            self.add(f"host-plan.json: cannot read ({e})")
            return
        experts = v41.moe_layers(weight_map)
        serving = {"model." + m if not m.startswith("model.") else m: ids for m, ids in experts.items()}
        for layer, ids in plan.items():
            have = serving.get(layer.removesuffix(".experts"))
            if have is None:
                self.add(f"host-plan.json: {layer}: no such MoE layer in {INDEX_NAME}")
                continue
            if not isinstance(ids, list) or any(not isinstance(i, int) for i in ids):
                self.add(f"host-plan.json: {layer}: expert list must be a list of integers")
                continue
            bad = sorted(set(ids) - have)
            if bad:
                self.add(f"host-plan.json: {layer}: experts {bad[:8]} not in {INDEX_NAME}")

    def check_config(self) -> None:
        p = self.pack / "config.json"
        if not p.exists():
            return
        try:
            cfg = json.loads(p.read_text())
            if not isinstance(cfg, dict):
                raise TypeError("not an object")
        except (OSError, ValueError, TypeError) as e:
            self.add(f"config.json: cannot read ({e})")
            return
        if not isinstance(cfg.get("architectures"), list) or not cfg["architectures"]:
            self.add("config.json: architectures: missing or empty")
