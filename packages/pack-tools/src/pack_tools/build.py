"""``build_pack``: the overlay pack the server loads, from the EXL3 checkpoint and the Engram shards.

The pack (reference-system.md section 8, our own implementation):

* links (never copies) to every file of the EXL3 checkpoint except its config, quantization config and index,
  and to the two Engram shards (``engram-model-000NN-of-00048.safetensors``);
* ``woa-<root>.safetensors``: the grouped ``attn.wo_a`` projections of each layer and MTP stage,
  reconstructed from their EXL3 slices to FP16 ``[o_groups * o_lora_rank, heads * head_dim / o_groups]``
  with ``cpu_tier.exl3`` (no GPU);
* ``native-dense.safetensors``: the projections that bypass the quantized path (compressor ``wkv`` /
  ``wgate``, indexer ``wk``; ``PackConfig.predecode``) decoded to FP16 ``[out, in]``;
* ``config.json`` (text-only architecture, EXL3 quantization config at the top level and in
  ``text_config``), ``quantization_config.json``;
* ``model.safetensors.index.json``: every tensor the server loads, merged over the linked shards and the
  generated files (vision tensors, the ``wo_a`` slices and the pre-decoded EXL3 sources are left out);
* ``host-plan.json``: the host-resident (pinned RAM) routed experts per MoE layer;
* ``pack.json``: what was built from what; ``manifest.json``: hashes of everything (written last).

The build runs in ``<out>.partial-<fingerprint>`` beside ``out`` and is renamed to ``out`` only when complete.
An interrupted build leaves only the partial directory (which ``verify`` rejects); running the same build
again resumes it, keeping every decoded file whose recorded hash still matches.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from pack_tools import v41
from pack_tools.config import PackConfig
from pack_tools.decode import reconstruct_fp16
from pack_tools.errors import PackError
from pack_tools.manifest import INDEX_NAME, MANIFEST_NAME, hash_file, write_manifest
from pack_tools.st import Header, atomic_write_json, read_header, write_safetensors

__all__ = ["INPUT_RECEIPT", "build_pack", "fingerprint_inputs"]

#: Written by ``pack-tools download`` (and ``synth``) into an input directory: where the files came from and
#: their sizes and sha256 where known.
INPUT_RECEIPT = ".pack-tools-input.json"
STATE_NAME = ".build-state.json"
PACK_INFO = "pack.json"
NATIVE_DENSE = "native-dense.safetensors"
_NOT_LINKED = {"config.json", "quantization_config.json", INDEX_NAME}

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


# ------------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class _Input:
    root: Path
    files: list[str]  # relative POSIX paths, hidden files excluded
    headers: dict[str, Header]
    receipt: dict[str, Any] | None


def _scan(root: Path, what: str, only: set[str] | None = None) -> _Input:
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
    return _Input(root, files, headers, receipt)


def _read_json(p: Path, what: str) -> dict[str, Any]:
    if not p.is_file():
        raise PackError(f"{p}: missing ({what})")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PackError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise PackError(f"{p}: expected a JSON object")
    return obj


def fingerprint_inputs(exl3: Path, engram: Path, config: PackConfig) -> str:
    """The build's identity: tool version, configuration, and every input file's size and header/content hash.

    Two builds with the same fingerprint produce the same pack, so a partial build directory named after it
    can be resumed.
    """
    from pack_tools import __version__

    ex = _scan(exl3, "EXL3 checkpoint")
    en = _scan(engram, "Engram")
    return _fingerprint(ex, en, config, __version__)


def _fingerprint(ex: _Input, en: _Input, config: PackConfig, version: str) -> str:
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


# ---------------------------------------------------------------------------------------- decoding


class _Reader:
    """safe_open handles over the input shards, opened once each."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self.root = root
        self.stack = stack
        self.handles: dict[str, Any] = {}

    def get(self, rel: str) -> Any:
        if rel not in self.handles:
            self.handles[rel] = self.stack.enter_context(safe_open(str(self.root / rel), framework="numpy"))
        return self.handles[rel]


class _PrefixView:
    """The tensors of one EXL3 linear, gathered from whichever shards hold them (``keys`` / ``get_tensor``)."""

    def __init__(self, reader: _Reader, where: dict[str, str], prefix: str) -> None:
        self.reader = reader
        self.names = {n: f for n, f in where.items() if n.startswith(prefix + ".")}

    def keys(self) -> list[str]:
        return list(self.names)

    def get_tensor(self, name: str) -> np.ndarray:
        return self.reader.get(self.names[name]).get_tensor(name)


def _decode_linear(reader: _Reader, where: dict[str, str], prefix: str) -> np.ndarray:
    """Reconstruct one EXL3 linear to FP16 ``[out, in]`` (the ``nn.Linear.weight`` orientation).

    The tensor set is read and validated by ``cpu_tier.exl3.Exl3Tensor``; the weight is
    ``pack_tools.decode.reconstruct_fp16`` (cpu_tier's bit-exact decode + an exact Hadamard).
    """
    from cpu_tier.exl3 import Exl3Tensor

    file = where[prefix + ".trellis"]
    names = {f"{prefix}.{p}": where[f"{prefix}.{p}"] for p in v41.EXL3_PARTS if f"{prefix}.{p}" in where}
    try:
        t = Exl3Tensor.from_safetensors(_PrefixView(reader, names, prefix), prefix)
        return reconstruct_fp16(t.trellis, t.suh, t.svh, t.codebook)
    except ValueError as e:
        msg = str(e)
        raise PackError(f"{file}: {msg if msg.startswith(prefix) else f'{prefix}: {msg}'}") from None


def _subset(where: dict[str, str], prefixes: Any) -> dict[str, str]:
    """The ``where`` entries of the EXL3 tensors of ``prefixes`` (small enough to send to a worker)."""
    out: dict[str, str] = {}
    for prefix in prefixes:
        for part in v41.EXL3_PARTS:
            name = f"{prefix}.{part}"
            if name in where:
                out[name] = where[name]
    return out


def _decode_one(exl3: Path, where: dict[str, str], prefix: str) -> np.ndarray:
    with ExitStack() as stack:
        return _decode_linear(_Reader(exl3, stack), where, prefix)


def _make_woa(
    exl3: Path, where: dict[str, str], root: str, prefixes: list[str], dims: tuple[Any, ...], path: Path
) -> list[int]:
    """Reconstruct one root's grouped ``wo_a`` (slices concatenated along dim 0) and write its file."""
    with ExitStack() as stack:
        reader = _Reader(exl3, stack)
        w = np.concatenate([_decode_linear(reader, where, p) for p in prefixes], axis=0)
    _check_woa_shape(dims, root, w, where[prefixes[0] + ".trellis"])
    write_safetensors(path, {f"{root}.attn.wo_a.weight": w}, {"format": "pt"})
    return list(w.shape)


def _root_key(root: str) -> tuple[int, int, str]:
    m = re.match(r"^(layers|mtp)\.(\d+)$", root)
    if m:
        return (0 if m[1] == "layers" else 1, int(m[2]), "")
    return (2, 0, root)


# -------------------------------------------------------------------------------------- build state


class _State:
    """``.build-state.json`` of a partial build: the generated files finished so far, with their sha256."""

    def __init__(self, partial: Path, fingerprint: str) -> None:
        self.path = partial / STATE_NAME
        self.fingerprint = fingerprint
        self.done: dict[str, str] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                if doc.get("fingerprint") == fingerprint:
                    self.done = dict(doc.get("done", {}))
            except ValueError:
                self.done = {}

    def is_done(self, rel: str) -> bool:
        p = self.path.parent / rel
        return rel in self.done and p.is_file() and hash_file(p) == self.done[rel]

    def mark(self, rel: str) -> None:
        self.done[rel] = hash_file(self.path.parent / rel)
        atomic_write_json(self.path, {"fingerprint": self.fingerprint, "done": self.done})


# ------------------------------------------------------------------------------------------- build


def build_pack(
    exl3_dir: str | os.PathLike[str],
    engram_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    config: PackConfig | None = None,
    force: bool = False,
    jobs: int = 1,
    progress: bool = False,
    log: Log | None = None,
) -> Path:
    """Build the pack ``out`` from the EXL3 checkpoint ``exl3_dir`` and the Engram release ``engram_dir``.

    Parameters
    ----------
    exl3_dir : directory of the EXL3 checkpoint (config.json, shards, tokenizer files).
    engram_dir : directory holding the original release's ``model.safetensors.index.json`` and the shards with
        the Engram tables.
    out : the pack directory to create.
    config : build settings (:class:`PackConfig`).
    force : replace an existing ``out`` (atomically: the old pack stays in place until the new one is done).
    jobs : worker processes for the EXL3 -> FP16 decoding (one task per ``wo_a`` root or dense module); the
        output does not depend on it.
    progress : show a progress bar on stderr.
    log : receives one line per build step.

    Returns
    -------
    ``out`` as a Path.

    Raises
    ------
    PackError naming the file, tensor or field at fault for any bad input, or when ``out`` exists and
    ``force`` is false.
    """
    from pack_tools import __version__

    cfg = config or PackConfig()
    say = log or _quiet
    if jobs < 1:
        raise PackError(f"jobs: must be at least 1, got {jobs}")
    exl3 = Path(exl3_dir).resolve()
    engram = Path(engram_dir).resolve()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out = out.parent.resolve() / out.name  # physical paths on both sides, so relative links resolve
    if out.exists() and not force:
        raise PackError(f"{out}: already exists (use --force to rebuild it)")

    # ---- inputs
    source_cfg = _read_json(exl3 / "config.json", "the EXL3 checkpoint's config.json")
    tc = v41.text_config(source_cfg)
    ex = _scan(exl3, "EXL3 checkpoint")
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
        for name, rel in _read_json(src_index, "index")["weight_map"].items():
            if where.get(name) != rel:
                found = f"found in {where[name]}" if name in where else "in no shard"
                raise PackError(f"{exl3.name}/{rel}: {name}: named by {INDEX_NAME} but {found}")
    engram_index = _read_json(engram / INDEX_NAME, "the Engram release's index")
    en_map: dict[str, str] = engram_index.get("weight_map", {})
    engram_keys = {n: f for n, f in en_map.items() if v41.ENGRAM_TABLE_RE.match(n)}
    en = _scan(engram, "Engram", only=set(engram_keys.values()))
    _check_engram(tc, engram, en, engram_keys)
    fp = _fingerprint(ex, en, cfg, __version__)

    # ---- partial directory (resume when the fingerprint matches)
    partial = out.parent / f"{out.name}.partial-{fp[:16]}"
    for stale in out.parent.glob(f"{glob_escape(out.name)}.partial-*"):
        if stale != partial and stale.is_dir():
            say(f"removing stale partial build {stale.name} (different inputs or settings)")
            shutil.rmtree(stale)
    if partial.exists():
        say(f"resuming {partial.name}")
    partial.mkdir(exist_ok=True)
    state = _State(partial, fp)

    # ---- links
    link_names: dict[str, Path] = {}
    for rel in ex.files:
        if rel not in _NOT_LINKED:
            link_names[rel] = exl3 / rel
    engram_links: dict[str, str] = {}
    for file in sorted(set(engram_keys.values())):
        name = cfg.engram_link_prefix + Path(file).name
        if name in link_names:
            raise PackError(f"{exl3.name}/{name}: collides with the Engram link name; choose another prefix")
        link_names[name] = engram / file
        engram_links[file] = name
    for name, target in link_names.items():
        _link(partial / name, target, cfg.link_mode)
    say(f"linked {len(link_names)} input files")

    # ---- what gets decoded
    modules = v41.exl3_modules(where)
    slices: dict[str, dict[int, str]] = defaultdict(dict)
    dense_predecode: list[str] = []
    for prefix in modules:
        if (r := v41.woa_slice_root(prefix)) is not None:
            slices[r[0]][r[1]] = prefix
        elif not v41.EXPERT_RE.match(prefix + ".trellis") and any(re.search(p, prefix) for p in cfg.predecode):
            dense_predecode.append(prefix)
    dense_predecode.sort()
    roots = sorted(slices, key=_root_key)
    o_groups = tc.get("o_groups")
    for root in roots:
        groups = sorted(slices[root])
        if groups != list(range(len(groups))) or (o_groups is not None and len(groups) != o_groups):
            raise PackError(
                f"{where[slices[root][groups[0]] + '.trellis']}: {root}.attn.wo_a.slice: groups {groups}, "
                f"expected 0..{(o_groups or len(groups)) - 1} (o_groups)"
            )
    woa_files = {root: f"woa-{root.replace('.', '-')}.safetensors" for root in roots}
    generated_st = set(woa_files.values()) | ({NATIVE_DENSE} if dense_predecode else set())
    clash = generated_st & set(link_names)
    if clash:
        raise PackError(f"{exl3.name}/{min(clash)}: input file name collides with a generated file")

    # ---- decode (in this process, or in `jobs` worker processes: one task per wo_a root / dense module)
    dims = tuple(tc.get(k) for k in ("num_attention_heads", "head_dim", "o_groups", "o_lora_rank"))
    woa_todo = [r for r in roots if not state.is_done(woa_files[r])]
    dense_todo = [] if not dense_predecode or state.is_done(NATIVE_DENSE) else dense_predecode
    bar = _progress(len(woa_todo) + len(dense_todo), progress)
    woa_args = {
        r: (exl3, _subset(where, slices[r].values()), r, [slices[r][g] for g in sorted(slices[r])], dims,
            partial / woa_files[r])
        for r in woa_todo
    }  # fmt: skip
    dense_out: dict[str, np.ndarray] = {}

    def woa_done(root: str, shape: list[int]) -> None:
        state.mark(woa_files[root])
        say(f"wrote {woa_files[root]} {shape} fp16")
        bar.update(1)

    if jobs <= 1:
        for root in woa_todo:
            woa_done(root, _make_woa(*woa_args[root]))
        with ExitStack() as stack:
            reader = _Reader(exl3, stack)
            for prefix in dense_todo:
                dense_out[prefix] = _decode_linear(reader, where, prefix)
                bar.update(1)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            try:
                futs = {pool.submit(_make_woa, *woa_args[r]): ("woa", r) for r in woa_todo}
                futs.update({pool.submit(_decode_one, exl3, _subset(where, [p]), p): ("dense", p) for p in dense_todo})
                for fut in as_completed(futs):
                    kind, key = futs[fut]
                    if kind == "woa":
                        woa_done(key, fut.result())
                    else:
                        dense_out[key] = fut.result()
                        bar.update(1)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    if dense_todo:
        write_safetensors(
            partial / NATIVE_DENSE, {f"{p}.weight": dense_out[p] for p in dense_predecode}, {"format": "pt"}
        )
        state.mark(NATIVE_DENSE)
        say(f"wrote {NATIVE_DENSE} ({len(dense_predecode)} tensors)")
    bar.close()

    # ---- index
    predecoded_sources = set(dense_predecode)
    for root in roots:
        predecoded_sources.update(slices[root].values())
    weight_map: dict[str, str] = {}
    for name, rel in where.items():
        prefix = name.rpartition(".")[0]
        if v41.is_vision(name) or prefix in predecoded_sources:
            continue
        weight_map[name] = rel
    for root in roots:
        weight_map[f"{root}.attn.wo_a.weight"] = woa_files[root]
    for prefix in dense_predecode:
        weight_map[f"{prefix}.weight"] = NATIVE_DENSE
    for name, file in engram_keys.items():
        if name in weight_map:
            raise PackError(f"{exl3.name}/{where[name]}: {name}: the EXL3 checkpoint also has this Engram tensor")
        weight_map[name] = engram_links[file]
    total = 0
    for name, rel in weight_map.items():
        if rel in engram_links.values():
            src = next(f for f, n in engram_links.items() if n == rel)
            total += en.headers[src].tensors[name].nbytes
        elif rel in ex.headers:
            total += ex.headers[rel].tensors[name].nbytes
        else:
            total += read_header(partial / rel, display=rel).tensors[name].nbytes
    atomic_write_json(
        partial / INDEX_NAME,
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )

    # ---- config, quantization config, host plan
    quant = _quant_config(source_cfg, tc, modules, where, ex.headers, predecoded_sources)
    new_cfg = copy.deepcopy(source_cfg)
    new_cfg["architectures"] = [cfg.text_architecture]
    new_cfg.pop("vision_config", None)  # text-only: the vision tower is left out of the pack
    new_cfg["quantization_config"] = quant
    if isinstance(new_cfg.get("text_config"), dict) and new_cfg["text_config"]:
        new_cfg["text_config"]["quantization_config"] = quant
        if "architectures" in new_cfg["text_config"]:
            new_cfg["text_config"]["architectures"] = [cfg.text_architecture]
    atomic_write_json(partial / "config.json", new_cfg)
    atomic_write_json(partial / "quantization_config.json", quant)
    n_layers = tc.get("num_hidden_layers")
    plan: dict[str, list[int]] = {}
    if cfg.host_experts == "all":
        for moe, ids in sorted(v41.moe_layers(weight_map).items(), key=lambda kv: _natural(kv[0])):
            m = re.match(r"^layers\.(\d+)\.", moe + ".")
            if m and (n_layers is None or int(m[1]) < n_layers):
                plan[f"model.{moe}.experts"] = sorted(ids)
    atomic_write_json(partial / "host-plan.json", plan)

    # ---- pack.json (what was built from what), then the manifest, then the rename
    info = {
        "format": "pack-tools-pack",
        "version": 1,
        "built_by": f"pack-tools {__version__}",
        "fingerprint": fp,
        "config": dataclasses.asdict(cfg),
        "inputs": {
            "exl3": _input_info(ex),
            "engram": _input_info(en),
        },
        "counts": {
            "indexed_tensors": len(weight_map),
            "linked_files": len(link_names),
            "dense_exl3_modules": len(quant["non_routed_exl3"]["layers"]),
            "woa_roots": len(roots),
            "native_dense_tensors": len(dense_predecode),
            "host_plan_layers": len(plan),
        },
        "generated": {
            "woa": {woa_files[r]: f"{r}.attn.wo_a.weight" for r in roots},
            "native_dense": [f"{p}.weight" for p in dense_predecode],
            "note": "FP16 [out, in] reconstructions of EXL3 linears with cpu_tier.exl3 (float64 inside, "
            "rounded to fp16 once); wo_a is the concatenation of its o_groups slices along dim 0.",
        },
    }
    atomic_write_json(partial / PACK_INFO, info)
    known: dict[str, str] = {}
    for tag, inp in (("exl3", ex), ("engram", en)):
        files = (inp.receipt or {}).get("files", {})
        for rel, meta in files.items():
            if isinstance(meta, dict) and isinstance(meta.get("sha256"), str):
                link = engram_links.get(rel) if tag == "engram" else (rel if rel in link_names else None)
                if link:
                    known[link] = meta["sha256"]
    state.path.unlink(missing_ok=True)
    write_manifest(partial, known_sha256=known, hash_links=cfg.hash_inputs)
    say(f"wrote {MANIFEST_NAME}")
    _fsync_dir(partial)
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)
    _fsync_dir(out.parent)
    say(f"pack ready: {out}")
    return out


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _natural(s: str) -> list[Any]:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


def _link(path: Path, target: Path, mode: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = str(target) if mode == "absolute" else os.path.relpath(target, path.parent)
    if path.is_symlink():
        if os.readlink(path) == text:
            return
        path.unlink()
    elif path.exists():
        raise PackError(f"{path}: exists in the partial build and is not a link")
    os.symlink(text, path)


def _check_engram(tc: Any, engram: Path, en: _Input, keys: dict[str, str]) -> None:
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


def _check_woa_shape(dims: tuple[Any, ...], root: str, w: np.ndarray, file: str) -> None:
    heads, hdim, groups, rank = dims
    if None in (heads, hdim, groups, rank):
        return
    want = (groups * rank, heads * hdim // groups)
    if w.shape != want:
        raise PackError(
            f"{file}: {root}.attn.wo_a: reconstructed shape {list(w.shape)}, config implies {list(want)} "
            "(o_groups * o_lora_rank, num_attention_heads * head_dim / o_groups)"
        )


def _quant_config(
    source_cfg: dict[str, Any],
    tc: Any,
    modules: dict[str, set[str]],
    where: dict[str, str],
    headers: dict[str, Header],
    predecoded: set[str],
) -> dict[str, Any]:
    """The ``quantization_config`` of the text-only pack (reference-system.md section 8, step 3)."""
    n_layers = int(tc.get("num_hidden_layers", 0))
    routed_bits: dict[str, dict[str, float]] = defaultdict(dict)
    routed_codebooks: Counter[str] = Counter()
    dense: dict[str, dict[str, Any]] = {}
    dense_members: dict[str, str] = {}
    dense_codebooks: Counter[str] = Counter()
    for prefix, parts in modules.items():
        if v41.is_vision(prefix + ".trellis") or prefix in predecoded:
            continue
        codebook = "mul1" if "mul1" in parts else "mcg" if "mcg" in parts else "3inst"
        bits = _bits(where, headers, prefix)
        if m := v41.EXPERT_RE.match(prefix + ".trellis"):
            layer = v41.serving_module_name(m["moe"], n_layers).split(".")
            idx = layer[2] if len(layer) > 2 and layer[1] == "layers" else m["moe"]
            prev = routed_bits[idx].get(m["proj"])
            if prev is not None and prev != bits:
                raise PackError(
                    f"{where[prefix + '.trellis']}: {prefix}.trellis: {bits} bits, other experts of this "
                    f"projection have {prev} (the fused kernels need one K per projection and layer)"
                )
            routed_bits[idx][m["proj"]] = bits
            routed_codebooks[codebook] += 1
            continue
        name = v41.serving_module_name(prefix, n_layers)
        spec = {"bits": _int_if_whole(bits), "codebook": codebook}
        if name in dense and (dense[name]["bits"], dense[name]["codebook"]) != (spec["bits"], codebook):
            raise PackError(
                f"{where[prefix + '.trellis']}: {prefix}: {bits} bits {codebook}, but {dense_members[name]} fused "
                f"into the same module {name} has {dense[name]['bits']} bits {dense[name]['codebook']}"
            )
        dense[name] = spec
        dense_members[name] = prefix
        dense_codebooks[codebook] += 1
    if len(routed_codebooks) > 1:
        raise PackError(f"routed experts mix codebooks {dict(routed_codebooks)}; the expert kernels need one")
    per_layer: dict[str, Any] = {}
    for idx, projs in routed_bits.items():
        vals = set(projs.values())
        per_layer[idx] = (
            _int_if_whole(vals.pop()) if len(vals) == 1 else {k: _int_if_whole(v) for k, v in projs.items()}
        )
    scalar = [v for v in per_layer.values() if not isinstance(v, dict)]
    main_bits = Counter(scalar).most_common(1)[0][0] if scalar else None
    layer_bits = {k: v for k, v in sorted(per_layer.items(), key=lambda kv: _natural(kv[0])) if v != main_bits}
    dense_cb = dense_codebooks.most_common(1)[0][0] if dense_codebooks else None
    layers = {}
    for name in sorted(dense, key=_natural):
        spec = {"bits": dense[name]["bits"]}
        if dense[name]["codebook"] != dense_cb:
            spec["codebook"] = dense[name]["codebook"]
        layers[name] = spec
    quant: dict[str, Any] = {
        "quant_method": "exl3",
        "bits": main_bits,
        "codebook": next(iter(routed_codebooks), None),
        "scope": "dsv41_native_exl3",
        "layer_bits": layer_bits,
        "non_routed_exl3": {"codebook": dense_cb, "layers": layers},
        "non_routed_dtype_policy": "bf16_as_stored",
    }
    src_q = source_cfg.get("quantization_config") or {}
    for k in ("version", "head_bits", "out_scales", "calibration"):
        if k in src_q:
            quant[k] = src_q[k]
    return quant


def _bits(where: dict[str, str], headers: dict[str, Header], prefix: str) -> float:
    """K of an EXL3 linear: the trellis's last dimension is ``16 * K``."""
    name = prefix + ".trellis"
    t = headers[where[name]].tensors[name]
    if t.dtype != "I16" or len(t.shape) != 3:
        raise PackError(f"{where[name]}: {name}: EXL3 trellis must be I16 3-D, got {t.dtype} {list(t.shape)}")
    return t.shape[2] / 16


def _int_if_whole(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def _input_info(inp: _Input) -> dict[str, Any]:
    r = inp.receipt or {}
    return {
        "dir": inp.root.name,
        "repo_id": r.get("repo_id"),
        "revision": r.get("revision"),
        "source": r.get("source"),
        "files": len(inp.files),
        "bytes": sum((inp.root / f).stat().st_size for f in inp.files),
    }


class _NoBar:
    def update(self, n: int) -> None:
        return None

    def close(self) -> None:
        return None


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="decode EXL3 -> fp16", unit="file")


def _fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
