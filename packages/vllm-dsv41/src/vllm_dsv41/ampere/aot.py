"""Proof that the Ampere path targets sm_80/sm_86 without an Ampere card: ahead-of-time compilation and a scan.

``python -m vllm_dsv41.ampere.aot [--arch 80 86] [--upstream] [--json FILE]`` compiles every kernel of
``vllm_dsv41.ampere.kernels`` (at V4.1's real sizes) with Triton for each target (``GPUTarget("cuda", arch, 32)``;
no GPU needed: Triton ships ``ptxas``) and checks the generated code:

* the PTX declares ``.target sm_<arch>`` and contains none of the instructions sm_8x lacks (``FORBIDDEN_PTX``:
  Hopper's ``wgmma``, TMA / bulk async copies, tensor maps, ``setmaxnreg``, thread-block clusters, programmatic
  dependent launch, FP8 conversions and FP8 MMA, ...);
* ``ptxas`` assembled it for ``sm_<arch>`` (the cubin exists and its ELF names the arch), which it refuses for an
  instruction the arch does not have;
* when ``nvdisasm`` is available, the SASS has none of ``FORBIDDEN_SASS`` (HGMMA, UTMA*, UBLKCP, ...).

``--upstream`` adds the upstream vLLM Triton kernels the Ampere path reuses unchanged (compressed-cache insert
with ``kv_rounding="bf16"``, compressor, index bookkeeping, candidate blocks); it needs vLLM's CUDA build (the CPU
build replaces Triton with a placeholder), so it runs in the device script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORBIDDEN_PTX",
    "FORBIDDEN_SASS",
    "CheckResult",
    "KernelSpec",
    "compile_for",
    "cubin_arch",
    "kernel_specs",
    "scan_ptx",
    "scan_sass",
]

#: PTX that sm_80/sm_86 cannot run, as regular expressions (instruction prefixes and the sm_90+ special registers).
FORBIDDEN_PTX: dict[str, str] = {
    "wgmma (Hopper warpgroup MMA)": r"\bwgmma\.",
    "TMA / bulk async copy": r"\bcp\.async\.bulk|\bcp\.reduce\.async\.bulk",
    "tensor map": r"\btensormap\.|\.tensormap",
    "setmaxnreg": r"\bsetmaxnreg",
    "thread-block cluster": r"\bbarrier\.cluster|%cluster|\bmapa\.|\.shared::cluster",
    "programmatic dependent launch": r"\bgriddepcontrol",
    "elect.sync": r"\belect\.sync",
    "stmatrix": r"\bstmatrix",
    "async proxy fence": r"\bfence\.proxy\.async",
    "multimem": r"\bmultimem\.",
    "FP8 conversion (sm_89+)": r"\bcvt\.[a-z.]*e[45]m[23]x2",
    "FP8 / FP4 MMA": r"\bmma\.[a-z0-9.:]*\.e[245]m[1-3]",
    "tcgen05 (Blackwell)": r"\btcgen05",
}
#: SASS opcodes of sm_90+ units.
FORBIDDEN_SASS: dict[str, str] = {
    "HGMMA": r"\bHGMMA\b",
    "UTMA (TMA)": r"\bUTMA[A-Z]*\b",
    "UBLKCP (bulk copy)": r"\bUBLKCP\b",
    "SYNCS (async barrier unit)": r"\bSYNCS\b",
    "ACQBULK": r"\bACQBULK\b",
}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel at one specialization: example arguments by name (tensors give their dtype only)."""

    label: str
    fn: Any  # a triton JITFunction
    args: dict[str, Any]
    num_warps: int = 4


def _t(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, dtype=dtype)


BF16, F32, I32, I64 = (_t(torch.bfloat16), _t(torch.float32), _t(torch.int32), _t(torch.int64))


def kernel_specs() -> list[KernelSpec]:
    """Every kernel of ``vllm_dsv41.ampere.kernels`` at DeepSeek-V4.1-Flash's sizes (head_dim 512, RoPE 64,
    64 query heads, indexer 32 x 128), at the tile sizes the wrappers launch."""
    from . import kernels as k

    big, small = 1 << 40, 1 << 12  # strides beyond int32 where vLLM's packed blocks can get there
    specs = [
        KernelSpec(
            "rope_q_kv_insert",
            k._rope_q_kv_insert_kernel,
            dict(
                q=BF16,
                q_s_t=32768,
                q_s_h=512,
                n_heads=64,
                kv=BF16,
                kv_s_t=512,
                positions=I64,
                cos_sin=F32,
                cs_s=64,
                cache=BF16,
                c_s_blk=big,
                c_s_row=512,
                c_rows=32,
                slots=I64,
                D=512,
                ROPE=64,
                FP8=False,
            ),
        ),
        KernelSpec(
            "indexer_k_store",
            k._indexer_k_store_kernel,
            dict(
                k_pre=BF16,
                k_s_t=128,
                positions=I64,
                cos_sin=F32,
                cs_s=64,
                weight=BF16,
                eps=1e-6,
                cache=BF16,
                c_s_blk=big,
                c_s_row=128,
                c_rows=64,
                slots=I64,
                ratio=2,
                D=128,
                ROPE=64,
                FP8=False,
            ),
            num_warps=1,
        ),
        KernelSpec(
            "indexer_q_rope",
            k._indexer_q_rope_kernel,
            dict(
                q=BF16,
                q_s_t=4096,
                q_s_h=128,
                positions=I64,
                cos_sin=F32,
                cs_s=64,
                w=F32,
                w_s_t=32,
                w_out=F32,
                wo_s_t=32,
                w_scale=0.0156,
                n_heads=32,
                D=128,
                ROPE=64,
                NH=32,
                FP8=False,
            ),
        ),
        KernelSpec(
            "topk_rows",
            k._topk_kernel,
            dict(logits=F32, l_s=small, lens=I32, out=I32, o_s=512, width=small, K=512, BLOCK=1024),
            num_warps=8,
        ),
        KernelSpec(
            "inv_rope_grouped",
            k._inv_rope_grouped_kernel,
            dict(
                o=BF16,
                o_s_t=32768,
                o_s_h=512,
                positions=I64,
                cos_sin=F32,
                cs_s=64,
                out=BF16,
                out_s_g=big,
                out_s_t=4096,
                heads_per_group=8,
                D=512,
                ROPE=64,
            ),
        ),
    ]
    for bh, warps in ((16, 4), (32, 8)):
        for has_b in (False, True):
            specs.append(
                KernelSpec(
                    f"sparse_mqa_attention BH={bh} extra={has_b}",
                    k._sparse_mqa_kernel,
                    dict(
                        q=BF16,
                        q_s_t=32768,
                        q_s_h=512,
                        out=BF16,
                        o_s_t=32768,
                        o_s_h=512,
                        n_heads=64,
                        kv_a=BF16,
                        a_s_blk=big,
                        a_s_row=512,
                        a_rows=32,
                        idx_a=I32,
                        idx_a_s=128,
                        len_a=I32,
                        width_a=128,
                        kv_b=BF16,
                        b_s_blk=big,
                        b_s_row=512,
                        b_rows=64,
                        idx_b=I32,
                        idx_b_s=512,
                        len_b=I32,
                        width_b=512,
                        sink=F32,
                        scale_log2=0.0637,
                        D=512,
                        BH=bh,
                        BN=32,
                        HAS_B=has_b,
                        HAS_SINK=True,
                    ),
                    num_warps=warps,
                )
            )
    for bt, warps in ((1, 4), (4, 8)):
        specs.append(
            KernelSpec(
                f"indexer_logits BT={bt}",
                k._indexer_logits_kernel,
                dict(
                    q=BF16,
                    q_s_t=4096,
                    q_s_h=128,
                    w=F32,
                    w_s_t=32,
                    n_heads=32,
                    cache=BF16,
                    c_s_blk=big,
                    c_s_row=128,
                    c_rows=64,
                    block_table=I32,
                    bt_s=small,
                    tok_req=I32,
                    positions=I64,
                    blk_start=I32,
                    blk_count=I32,
                    ratio=1,
                    out=F32,
                    o_s_t=small,
                    row0=0,
                    width=small,
                    D=128,
                    NH=32,
                    BT=bt,
                    BN=64,
                ),
                num_warps=warps,
            )
        )
    # kv_rounding="fp8": the store kernels' FP8 rounding (integer / fp32 arithmetic only, no e4m3 conversion)
    for spec in [s for s in specs if "FP8" in s.args]:
        specs.append(dataclasses.replace(spec, label=f"{spec.label} fp8", args={**spec.args, "FP8": True}))
    for fp8 in (False, True):
        specs.append(
            KernelSpec(
                "compressed_kv_insert" + (" fp8" if fp8 else ""),
                k._compressed_kv_insert_kernel,
                dict(
                    latent=BF16,
                    l_s_t=512,
                    positions=I64,
                    cos_sin=F32,
                    cs_s=64,
                    cache=BF16,
                    c_s_blk=big,
                    c_s_row=512,
                    c_rows=32,
                    slots=I64,
                    ratio=2,
                    D=512,
                    ROPE=64,
                    FP8=fp8,
                ),
            )
        )
    rows = dict(x=BF16, x_s=64, out=BF16, o_s=64, exps=I32, B=64, GIVEN=False)
    specs.append(KernelSpec("e4m3_round_blocks", k._e4m3_round_kernel, rows))
    return specs


def upstream_kernel_specs() -> list[KernelSpec]:
    """The upstream vLLM Triton kernels the Ampere path runs unchanged (needs vLLM's CUDA build)."""
    from vllm.model_executor.kernels.attention.dsa import candidate_blocks as cb
    from vllm.models.deepseek_v41 import attention as a
    from vllm.models.deepseek_v41.common.ops import cache_utils as cu
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache as fc

    for fn in (fc._rope_plain_insert_kernel, cb._block_scores_kernel):
        if not hasattr(fn, "params"):
            raise RuntimeError(
                "vLLM's Triton is a placeholder here (vLLM's CPU build): run --upstream with vLLM's CUDA build"
            )
    big = 1 << 40
    return [
        KernelSpec(
            "upstream compressed-cache insert, bf16 rows",
            fc._rope_plain_insert_kernel,
            dict(
                latent=BF16,
                positions=I64,
                cos_sin=F32,
                cache=BF16,
                cache_slots=I64,
                fp8_scale=None,
                COS_STRIDE=64,
                CACHE_STRIDE=big,
                ROW_STRIDE=512,
                CACHE_BLOCK=64,
                COMPRESS_RATIO=2,
                STORE_FP8=False,
            ),
        ),
        *[
            KernelSpec(
                f"upstream compressor ratio {r}",
                fc._fused_save_compress_norm_kernel,
                dict(
                    raw=F32,
                    positions=I64,
                    state=F32 if r == 2 else None,
                    state_slots=I64,
                    query_start_loc=I32 if r == 2 else None,
                    req_ids=I32 if r == 2 else None,
                    norm_weight=BF16,
                    latent=BF16,
                    num_tokens=4096,
                    num_reqs=4,
                    RAW_STRIDE=512 * r,
                    STATE_STRIDE=8192 if r == 2 else 1,
                    STATE_ROW_STRIDE=1024 if r == 2 else 1,
                    STATE_BLOCK=8 if r == 2 else 1,
                    COMPRESS_RATIO=r,
                    EPS=1e-6,
                    JOIN_ROW_PTRS=True,
                ),
            )
            for r in (1, 2)
        ],
        KernelSpec(
            "upstream global top-k indices",
            cu._compute_global_topk_indices_and_lens_kernel,
            dict(
                global_topk_indices_ptr=I32,
                global_topk_indices_stride=512,
                topk_lens_ptr=I32,
                topk_indices_ptr=I32,
                topk_indices_stride=512,
                topk=512,
                token_to_req_indices_ptr=I32,
                block_table_ptr=I32,
                block_table_stride=4096,
                block_size=64,
                is_valid_token_ptr=_t(torch.bool),
                TRITON_BLOCK_SIZE=1024,
            ),
        ),
        KernelSpec(
            "upstream short-context top-k fill",
            a._fill_short_context_topk_indices,
            dict(output=I32, positions=I64, TOP_K=512, COMPRESS_RATIO=2, PADDED_TOP_K=512),
            num_warps=8,
        ),
        KernelSpec(
            "upstream candidate block scores",
            cb._block_scores_kernel,
            dict(
                logits=F32,
                starts=None,
                ends=I32,
                scores=F32,
                stride_row=4096,
                stride_col=1,
                stride_start=0,
                stride_end=1,
                width=4096,
                nblocks=512,
                BLOCK_SIZE=8,
                HAS_STARTS=False,
                ROW_REPEAT=1,
                TILE=128,
            ),
        ),
        KernelSpec(
            "upstream candidate store",
            cb._store_candidates_kernel,
            dict(
                values=F32,
                indices=_t(torch.int64),
                output=I32,
                out_stride_row=2048,
                out_stride_col=1,
                k=2048,
                OUT_K=2048,
                TILE=256,
            ),
        ),
        KernelSpec(
            "upstream candidate flags",
            cb._candidate_flags_kernel,
            dict(
                candidates=I32,
                starts=None,
                flags=_t(torch.uint8),
                stride_row=2048,
                stride_col=1,
                stride_start=0,
                width=4096,
                nblocks=512,
                BLOCK_SIZE=8,
                K=2048,
                HAS_STARTS=False,
                ROW_REPEAT=1,
            ),
        ),
        KernelSpec(
            "upstream candidate mask",
            cb._mask_candidates_kernel,
            dict(
                logits=F32,
                starts=None,
                ends=I32,
                flags=_t(torch.uint8),
                stride_row=4096,
                stride_col=1,
                stride_start=0,
                stride_end=1,
                width=4096,
                nblocks=512,
                BLOCK_SIZE=8,
                HAS_STARTS=False,
                ROW_REPEAT=1,
                TILE=1024,
            ),
        ),
    ]


def _signature(spec: KernelSpec) -> tuple[dict[str, str], dict[str, Any]]:
    from triton.runtime.jit import mangle_type

    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    for p in spec.fn.params:
        if p.name not in spec.args:
            raise KeyError(f"{spec.label}: no example value for argument {p.name!r}")
        v = spec.args[p.name]
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"
            const[p.name] = v
        else:
            sig[p.name] = mangle_type(v)
    extra = set(spec.args) - {p.name for p in spec.fn.params}
    if extra:
        raise KeyError(f"{spec.label}: example values for unknown arguments {sorted(extra)}")
    return sig, const


def compile_for(spec: KernelSpec, arch: int) -> Any:
    """``triton.compile`` of ``spec`` for ``sm_<arch>`` (no device needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const = _signature(spec)
    src = ASTSource(fn=spec.fn, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": spec.num_warps})


def scan_ptx(ptx: str, arch: int) -> list[str]:
    """What in ``ptx`` sm_<arch> cannot run (empty when clean)."""
    problems = [f"{what}: {m.group(0)!r}" for what, pat in FORBIDDEN_PTX.items() for m in [re.search(pat, ptx)] if m]
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    if target is None or target.group(1) != f"sm_{arch}":
        problems.append(f"PTX target is {target.group(1) if target else 'missing'}, expected sm_{arch}")
    return problems


def scan_sass(sass: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pat in FORBIDDEN_SASS.items() for m in [re.search(pat, sass)] if m]


def _tool(name: str) -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else shutil.which(name)


def disassemble(cubin: bytes) -> str | None:
    """SASS of a cubin with Triton's ``nvdisasm`` (None when the tool is absent)."""
    tool = _tool("nvdisasm")
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-hex", f.name], capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"nvdisasm failed: {r.stderr.strip()[:500]}")
        return r.stdout


def cubin_arch(cubin: bytes) -> int:
    """The SM an ELF cubin is for (sm_80 -> 80), from the ``e_flags`` of its 64-bit ELF header: the low byte in the
    CUDA ELF ABI before version 8, bits 8-15 from version 8 on (``e_ident[EI_ABIVERSION]``; CUDA 13's ptxas, whose
    low byte holds other flags)."""
    if cubin[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    flags = int.from_bytes(cubin[48:52], "little")
    if cubin[8] >= 8 or not flags & 0xFF:
        return (flags >> 8) & 0xFF
    return flags & 0xFF


@dataclasses.dataclass
class CheckResult:
    """One kernel at one specialization, built for one arch: clean or not, and what is wrong."""

    label: str
    arch: int
    ok: bool
    problems: list[str]
    seconds: float


@dataclasses.dataclass
class Result(CheckResult):
    ptx_lines: int = 0
    sass_checked: bool = False
    mma: int = 0  # mma.sync instructions in the PTX (the tensor cores Ampere has)


def check(
    specs: Iterable[KernelSpec], archs: Iterable[int], progress: Callable[[str], None] | None = None
) -> list[Result]:
    out: list[Result] = []
    for spec in specs:
        for arch in archs:
            t0 = time.perf_counter()
            try:
                c = compile_for(spec, arch)
                ptx: str = c.asm["ptx"]
                cubin: bytes = c.asm["cubin"]
                problems = scan_ptx(ptx, arch)
                if cubin_arch(cubin) != arch:
                    problems.append(f"cubin is for sm_{cubin_arch(cubin)}, expected sm_{arch}")
                sass = disassemble(cubin)
                if sass is not None:
                    problems += scan_sass(sass)
                r = Result(
                    spec.label,
                    arch,
                    not problems,
                    problems,
                    time.perf_counter() - t0,
                    ptx.count("\n"),
                    sass is not None,
                    len(re.findall(r"\bmma\.sync", ptx)),
                )
            except Exception as e:  # a compile failure is a finding, reported with the kernel's name
                r = Result(
                    spec.label,
                    arch,
                    False,
                    [f"compile failed: {type(e).__name__}: {str(e)[:400]}"],
                    time.perf_counter() - t0,
                )
            out.append(r)
            if progress is not None:
                progress(
                    f"sm_{arch} {'ok  ' if r.ok else 'FAIL'} {r.seconds:5.1f}s {spec.label}"
                    + (f" (mma.sync x{r.mma})" if r.mma else "")
                    + ("" if r.ok else f": {r.problems}")
                )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.ampere.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 86], help="SM versions to compile for")
    ap.add_argument("--upstream", action="store_true", help="also the reused upstream vLLM kernels (CUDA vLLM)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    specs = kernel_specs() + (upstream_kernel_specs() if a.upstream else [])
    results = check(specs, a.arch, progress=lambda s: print(s, flush=True))
    bad = [r for r in results if not r.ok]
    print(
        f"{len(results) - len(bad)}/{len(results)} kernel compilations clean for sm_{'/sm_'.join(map(str, a.arch))}"
        + ("" if results and results[0].sass_checked else " (PTX only: no nvdisasm)")
    )
    if a.json:
        a.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
