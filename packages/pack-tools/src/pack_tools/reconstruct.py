"""The EXL3 linears a pack ships reconstructed to FP16, and the (parallel) decoding that writes them.

* ``woa-<root>.safetensors``: the grouped ``attn.wo_a`` projection of each layer and MTP stage, its
  ``o_groups`` EXL3 slices reconstructed and concatenated along dim 0 to FP16
  ``[o_groups * o_lora_rank, heads * head_dim / o_groups]``;
* ``native-dense.safetensors``: the projections that bypass the quantized path (``PackConfig.predecode``:
  compressor ``wkv`` / ``wgate``, indexer ``wk``) decoded to FP16 ``[out, in]``.

Decoding is ``cpu_tier.exl3``'s bit-exact decode plus an exact Hadamard (``pack_tools.decode``), in this
process or in ``jobs`` spawned worker processes (one task per ``wo_a`` root or dense module); the output does
not depend on ``jobs``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from pack_tools import v41
from pack_tools.decode import reconstruct_fp16
from pack_tools.errors import PackError
from pack_tools.st import write_safetensors
from pack_tools.staging import BuildState

__all__ = ["NATIVE_DENSE", "DecodePlan", "plan_decoding", "run_decoding"]

NATIVE_DENSE = "native-dense.safetensors"


@dataclasses.dataclass
class DecodePlan:
    """What a build reconstructs: ``wo_a`` slices per root, the pre-decoded dense modules, the file names."""

    modules: dict[str, set[str]]  # every EXL3 module prefix of the checkpoint -> its parts
    slices: dict[str, dict[int, str]]  # wo_a root -> group -> slice module prefix
    roots: list[str]  # wo_a roots, layers first, then MTP stages
    woa_files: dict[str, str]  # wo_a root -> generated file
    dense_predecode: list[str]  # module prefixes shipped in NATIVE_DENSE

    @property
    def generated(self) -> set[str]:
        """The safetensors files the decoding writes."""
        return set(self.woa_files.values()) | ({NATIVE_DENSE} if self.dense_predecode else set())

    @property
    def predecoded_sources(self) -> set[str]:
        """EXL3 module prefixes whose tensors the pack replaces by FP16 ones (left out of the index)."""
        out = set(self.dense_predecode)
        for root in self.roots:
            out.update(self.slices[root].values())
        return out


def plan_decoding(where: dict[str, str], tc: Any, predecode: Iterable[str]) -> DecodePlan:
    """Group the checkpoint's EXL3 modules into ``wo_a`` roots and pre-decoded dense modules; check the groups."""
    modules = v41.exl3_modules(where)
    slices: dict[str, dict[int, str]] = defaultdict(dict)
    dense_predecode: list[str] = []
    for prefix in modules:
        if (r := v41.woa_slice_root(prefix)) is not None:
            slices[r[0]][r[1]] = prefix
        elif not v41.EXPERT_RE.match(prefix + ".trellis") and any(re.search(p, prefix) for p in predecode):
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
    return DecodePlan(modules, slices, roots, woa_files, dense_predecode)


def run_decoding(
    plan: DecodePlan,
    exl3: Path,
    where: dict[str, str],
    tc: Any,
    partial: Path,
    state: BuildState,
    *,
    jobs: int,
    progress: bool,
    say: Callable[[str], None],
) -> None:
    """Write the plan's files not yet done in ``state`` into ``partial`` (``jobs`` worker processes if > 1)."""
    woa_files, slices, dense_predecode = plan.woa_files, plan.slices, plan.dense_predecode
    dims = tuple(tc.get(k) for k in ("num_attention_heads", "head_dim", "o_groups", "o_lora_rank"))
    woa_todo = [r for r in plan.roots if not state.is_done(woa_files[r])]
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
        from concurrent.futures import Future, ProcessPoolExecutor, as_completed

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            try:
                futs: dict[Future[Any], tuple[str, str]] = {
                    pool.submit(_make_woa, *woa_args[r]): ("woa", r) for r in woa_todo
                }
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


def _subset(where: dict[str, str], prefixes: Iterable[str]) -> dict[str, str]:
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


def _root_key(root: str) -> tuple[int, int, str]:
    m = re.match(r"^(layers|mtp)\.(\d+)$", root)
    if m:
        return (0 if m[1] == "layers" else 1, int(m[2]), "")
    return (2, 0, root)


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
