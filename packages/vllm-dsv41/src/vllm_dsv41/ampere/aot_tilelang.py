"""Proof that V4.1's mHC kernels (vLLM's TileLang kernels) build for sm_80/sm_86, without an Ampere card.

Outside attention, upstream's V4.1 model (vLLM 0.32 ``models/deepseek_v41/nvidia/model.py``) runs each sublayer's
hyper-connections (mHC) through TileLang. On a GPU without DeepGEMM (every sm_8x) ``mhc_pre_delayed_tilelang``
takes its TileLang GEMM, so three kernels run (``kernels/mhc/tilelang_kernels.py``):

* the pre-norm GEMM, ``hc_prenorm_gemm_tilelang`` (``_block_m`` from 1,024 tokens), called with the sublayer's
  input width (the broadcast embedding's ``hidden`` in layer 0, ``hc_mult * hidden`` after) and ``hc_mult=1``;
* the pre epilogue, ``mhc_pre_big_fuse_with_norm_tilelang`` (Sinkhorn, the collapse, its RMSNorm): layer 0 (no
  carried pre-mix) and the later sublayers without / with one;
* the post, ``mhc_post_tilelang``.

(The final collapse is Triton, ``hc_collapse_triton``; Blackwell's overlapped and DeepGEMM variants are gated off
below sm_100 / without DeepGEMM.) ``python -m vllm_dsv41.ampere.aot_tilelang --config CONFIG.json [--arch 80 86]
[--nvcc PATH] [--json FILE]`` takes every specialization upstream's own dispatch picks at the config's sizes
(``HcPrenormGemmTileLangKernel.dispatch`` over the token regimes, ``MHCPreNormKernel.dispatch``), lowers it with
TileLang for a ``cuda`` target of that arch with vLLM's pass configs, as it is built on an sm_<arch> card (PDL off,
whatever GPU this machine has: ``pdl_as_on``), and checks:

* the launch against the arch (threads per block, dynamic shared memory per block: ``SM_LIMITS``);
* with nvcc: the CUDA source compiled to PTX for ``compute_<arch>`` and scanned like the Triton kernels
  (``aot.scan_ptx``: no ``wgmma``, TMA, clusters, PDL, FP8, ...), then assembled by ``ptxas`` for ``sm_<arch>``
  (it refuses what the arch lacks): registers per thread times threads within the register file, spills stated.

Needs TileLang (vLLM's CUDA install has it) and, for the compile, nvcc (a CUDA toolkit, or the ``nvidia-cuda-nvcc``,
``nvidia-nvvm``, ``nvidia-cuda-crt``, ``nvidia-cuda-runtime`` and ``nvidia-cuda-cccl`` wheels): no GPU. Without
nvcc only the lowering and the launch limits are checked, and the output says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from .aot import CheckResult, cubin_arch, scan_ptx

__all__ = ["SM_LIMITS", "MhcShape", "Result", "TileLangSpec", "check", "launch_problems", "pdl_as_on", "ptxas_usage",
           "specs_for", "trace", "upstream_pdl"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SmLimits:
    threads: int  # per block
    dyn_smem: int  # bytes of shared memory one block may use (with the opt-in attribute TileLang sets)
    registers: int  # 32-bit registers per SM (a block's threads x registers must fit)
    max_regs: int = 255  # per thread


#: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
SM_LIMITS: dict[int, SmLimits] = {
    80: SmLimits(threads=1024, dyn_smem=163 * 1024, registers=65536),
    86: SmLimits(threads=1024, dyn_smem=99 * 1024, registers=65536),
    89: SmLimits(threads=1024, dyn_smem=99 * 1024, registers=65536),
}
#: Token counts that reach every regime of upstream's pre-norm GEMM dispatch (< 128, 128..1023, >= 1024).
TOKEN_REGIMES = (1, 128, 1024)


@dataclasses.dataclass(frozen=True)
class MhcShape:
    """The mHC sizes of one V4.1 config."""

    name: str
    hidden: int
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float
    rms_eps: float

    @classmethod
    def from_config(cls, path: Path) -> MhcShape:
        try:
            c = json.loads(path.read_text())
            c = c.get("text_config", c)
            return cls(path.parent.name or path.stem, int(c["hidden_size"]), int(c["hc_mult"]),
                       int(c["hc_sinkhorn_iters"]), float(c["hc_eps"]), float(c["rms_norm_eps"]))  # fmt: skip
        except KeyError as e:
            raise ValueError(f"{path}: not a V4.1 config with mHC (no field {e.args[0]!r})") from None

    @property
    def mix(self) -> int:
        return self.hc_mult * (self.hc_mult + 2)


@dataclasses.dataclass(frozen=True)
class TileLangSpec:
    """One TileLang kernel at one specialization: its ``@tilelang.jit`` function and its compile-time arguments."""

    label: str
    fn: Any
    params: dict[str, Any]


def specs_for(shape: MhcShape) -> list[TileLangSpec]:
    """The specializations the V4.1 model dispatches on a GPU without DeepGEMM, at ``shape``'s sizes (upstream's own
    dispatch code picks them, so a change of its heuristics is followed)."""
    _tilelang()  # before the kernels' module binds ``T``
    from vllm.model_executor.kernels.mhc import tilelang_kernels as tk
    from vllm.model_executor.kernels.mhc.warmup import MHC_PRE_NORM_KERNEL

    out: list[TileLangSpec] = []
    gemm = tk.HcPrenormGemmTileLangKernel()
    for width, where in ((shape.hidden, "layer 0"), (shape.hc_mult * shape.hidden, "hc stream")):
        keys = {gemm.dispatch(num_tokens=t, hc_hidden_size=width, hidden_size=width, hc_mult=1, n_out=shape.mix)
                for t in TOKEN_REGIMES}  # fmt: skip
        for key in sorted(keys, key=lambda k: (k.use_block_m, k.n_thr)):
            params = dict(hidden_size=key.hidden_size, hc_mult=key.hc_mult, n_out=key.n_out, n_thr=key.n_thr,
                          tile_n=key.tile_n)  # fmt: skip
            if key.use_block_m:
                params["block_m"] = key.block_m
            else:
                params["n_splits"] = key.n_splits
            label = f"hc_prenorm_gemm{'_block_m' if key.use_block_m else ''} {where} K={width} n_thr={key.n_thr}"
            fn = tk.HcPrenormGemmTileLangKernel.kernel(key)
            out.append(TileLangSpec(f"{shape.name}: {label} tile_n={key.tile_n}", fn, params))
    stream = shape.hc_mult * shape.hidden
    variants = ((shape.hidden, False, "layer 0"), (stream, False, "no pre-mix"), (stream, True, "carried pre-mix"))
    for rms_numel, pre_in, where in variants:
        key = MHC_PRE_NORM_KERNEL.dispatch(
            n_splits=1, hidden_size=shape.hidden, rms_eps=shape.rms_eps, hc_pre_eps=shape.hc_eps,
            hc_sinkhorn_eps=shape.hc_eps, hc_post_mult_value=2.0, sinkhorn_repeat=shape.sinkhorn_iters,
            norm_eps=shape.rms_eps, hc_mult=shape.hc_mult, use_pre_mix_in=pre_in, rms_numel=rms_numel,
            save_pre_mix=True,
        )  # fmt: skip
        out.append(TileLangSpec(f"{shape.name}: mhc_pre_big_fuse_with_norm {where}", MHC_PRE_NORM_KERNEL.kernel,
                                dataclasses.asdict(key)))  # fmt: skip
    out.append(TileLangSpec(f"{shape.name}: mhc_post", tk.mhc_post_tilelang,
                            dict(hc=shape.hc_mult, hidden=shape.hidden)))  # fmt: skip
    return out


def _tilelang() -> Any:
    """vLLM's TileLang helpers with ``tilelang`` and ``T`` bound (vLLM binds them at import on a CUDA platform only;
    elsewhere this must run before ``kernels/mhc/tilelang_kernels.py`` is imported, which copies ``T``)."""
    import vllm.tilelang_utils as tu

    tu._ensure_tilelang_imported()
    return tu


def upstream_pdl(arch: int) -> bool:
    """Whether upstream's mHC kernels use PDL (``T.pdl_sync`` / ``T.pdl_trigger``: griddepcontrol) on an sm_<arch> card.

    ``kernels/mhc/tilelang_kernels.py`` sets ``ENABLE_PDL = current_platform.is_arch_support_pdl() and
    current_platform.is_cuda()`` once, at import, from the device of the importing process; ``CudaPlatform.
    is_arch_support_pdl`` (``platforms/cuda.py``) is ``major >= 9`` of ``torch.cuda.get_device_capability``. TileLang
    refuses the intrinsics below sm_90 (``MarkCudaSyncCalls(have_pdl(target))``: "PDL is not supported")."""
    return arch // 10 >= 9


@contextlib.contextmanager
def pdl_as_on(arch: int, kernels: Any) -> Iterator[str]:
    """Upstream's ``kernels.ENABLE_PDL`` (the module ``tilelang_kernels``) set, for the duration, to what an sm_<arch>
    card gives it (``upstream_pdl``), then restored; yields a note for the result. Imported on a GPU of compute
    capability 9.0+ (an H200) the flag is on, and a kernel traced with it carries PDL, which sm_8x cannot lower: the
    check must build what an sm_8x card builds, whatever GPU (or none) runs it."""
    had, want = bool(kernels.ENABLE_PDL), upstream_pdl(arch)
    state = "on" if want else "off"
    if had == want:
        note = f"{state}, as on sm_{arch} (upstream's ENABLE_PDL is {had} here too)"
    else:
        note = (f"forced {state}: an sm_{arch} card gives upstream's ENABLE_PDL {want} (capability >= 9.0 only); "
                f"this machine's import gave {had}")  # fmt: skip
    with mock.patch.object(kernels, "ENABLE_PDL", want):  # no ``create``: a renamed flag fails here, loudly
        yield note


def trace(spec: TileLangSpec, arch: int, kernels: Any = None) -> tuple[Any, str]:
    """``spec``'s TIR as an sm_<arch> card traces it (``pdl_as_on``; TileLang re-runs an eager kernel's body per
    ``get_tir``, reading the module's flag then) and the PDL note. ``kernels``: upstream's ``tilelang_kernels``."""
    if kernels is None:
        _tilelang()
        from vllm.model_executor.kernels.mhc import tilelang_kernels

        kernels = tilelang_kernels
    with pdl_as_on(arch, kernels) as note:
        tir = spec.fn.get_tir(**spec.params)
    return tir, note


def _pdl_calls(tir: Any) -> list[str]:
    """The PDL intrinsics (``tl.pdl_sync``, ``tl.pdl_trigger``) in a TIR function."""
    from tvm import tirx

    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, tirx.Call) and "pdl" in str(getattr(node.op, "name", "")):
            found.append(str(node.op.name))

    tirx.stmt_functor.post_order_visit(tir.body, visit)
    return sorted(set(found))


def lower(tir: Any, arch: int) -> tuple[str, dict[str, Any]]:
    """The CUDA source for ``sm_<arch>`` of a kernel's TIR (``trace``) and its launch (``threads``, ``dyn_smem``)."""
    tu = _tilelang()
    import tvm
    from tilelang.engine.lower import lower as tl_lower
    from tilelang.transform.pass_config import normalize_pass_configs
    from tvm.target import Target

    if not upstream_pdl(arch) and (calls := _pdl_calls(tir)):
        raise RuntimeError(f"traced with PDL ({', '.join(calls)}) although sm_{arch} has it off")
    target = Target({"kind": "cuda", "arch": f"sm_{arch}"})
    with tvm.transform.PassContext(opt_level=3, config=normalize_pass_configs(tu._get_pass_configs())), target:
        art = tl_lower(tir, target=target)
    threads, smem = 0, 0
    for _, f in art.device_mod.functions.items():
        ext = dict(f.attrs.get("thread_extent", {}))
        t = 1
        for axis in ("threadIdx.x", "threadIdx.y", "threadIdx.z"):
            t *= int(ext.get(axis, 1))
        threads = max(threads, t)
        smem = max(smem, int(f.attrs.get("dyn_shared_memory_buf", 0) or 0))
    return str(art.kernel_source), {"threads": threads, "dyn_smem": smem}


def launch_problems(arch: int, threads: int, dyn_smem: int, registers: int | None = None) -> list[str]:
    """What of a launch ``sm_<arch>`` cannot run (empty when it fits)."""
    lim = SM_LIMITS[arch]
    out = []
    if threads > lim.threads:
        out.append(f"{threads} threads per block > {lim.threads}")
    if dyn_smem > lim.dyn_smem:
        out.append(f"{dyn_smem} B of shared memory per block > {lim.dyn_smem} B")
    if registers is not None and (registers > lim.max_regs or registers * threads > lim.registers):
        out.append(f"{registers} registers x {threads} threads > the {lim.registers}-register file")
    return out


def ptxas_usage(text: str) -> dict[str, int]:
    """Registers and spill bytes from ``ptxas -v`` output (the largest over its entry functions)."""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", text)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    if not regs:
        raise ValueError(f"no register count in ptxas output: {text[-300:]!r}")
    return {"registers": max(regs), "spill_bytes": max(spills, default=0)}


def _nvcc_compile(source: str, arch: int, nvcc: str, include: list[str]) -> tuple[str, bytes, str]:
    """PTX for ``compute_<arch>``, the cubin ptxas makes of it for ``sm_<arch>``, and ptxas' ``-v`` report."""
    ptxas = str(Path(nvcc).with_name("ptxas"))
    with tempfile.TemporaryDirectory() as d:
        cu, ptx, cubin = Path(d, "k.cu"), Path(d, "k.ptx"), Path(d, "k.cubin")
        cu.write_text(source)
        cmd = [nvcc, "-std=c++20", "-w", "-Xcudafe", "--diag_suppress=177", "-ptx", f"-arch=compute_{arch}",
               *(f"-I{p}" for p in include), str(cu), "-o", str(ptx)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"nvcc failed: {(r.stderr or r.stdout).strip()[-600:]}")
        # vLLM's pass config asks ptxas for register usage level 10 (TL_PTXAS_REGISTER_USAGE_LEVEL)
        r = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", "--register-usage-level=10", str(ptx), "-o", str(cubin)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"ptxas failed: {(r.stderr or r.stdout).strip()[-600:]}")
        return ptx.read_text(), cubin.read_bytes(), r.stdout + r.stderr


@dataclasses.dataclass
class Result(CheckResult):
    threads: int = 0
    dyn_smem: int = 0
    compiled: bool = False
    registers: int | None = None
    spill_bytes: int | None = None
    pdl: str = ""  # PDL as built (``pdl_as_on``): sm_8x has it off, whatever the checking machine's GPU


def check(specs: Iterable[TileLangSpec], archs: Iterable[int], nvcc: str | None,
          progress: Callable[[str], None] | None = None) -> list[Result]:  # fmt: skip
    include: list[str] = []
    if nvcc is not None:
        from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

        include = [str(TILELANG_TEMPLATE_PATH), str(CUTLASS_INCLUDE_DIR)]
    out: list[Result] = []
    for spec in specs:
        for arch in archs:
            t0 = time.perf_counter()
            r = Result(spec.label, arch, False, [], 0.0)
            try:
                tir, r.pdl = trace(spec, arch)
                source, launch = lower(tir, arch)
                r.threads, r.dyn_smem = launch["threads"], launch["dyn_smem"]
                if nvcc is not None:
                    ptx, cubin, report = _nvcc_compile(source, arch, nvcc, include)
                    r.problems += scan_ptx(ptx, arch)
                    if cubin_arch(cubin) != arch:
                        r.problems.append(f"cubin is for sm_{cubin_arch(cubin)}, expected sm_{arch}")
                    use = ptxas_usage(report)
                    r.compiled, r.registers, r.spill_bytes = True, use["registers"], use["spill_bytes"]
                r.problems += launch_problems(arch, r.threads, r.dyn_smem, r.registers)
            except Exception as e:  # a lowering or compile failure is a finding, reported with the kernel's name
                r.problems.append(f"{type(e).__name__}: {str(e)[:600]}")
            r.ok, r.seconds = not r.problems, time.perf_counter() - t0
            out.append(r)
            if progress is not None:
                regs = f" regs={r.registers} spills={r.spill_bytes}B" if r.compiled else ""
                progress(f"sm_{arch} {'ok  ' if r.ok else 'FAIL'} {r.seconds:5.1f}s {spec.label}: threads={r.threads} "
                         f"smem={r.dyn_smem}B{regs} pdl={re.split('[:,]', r.pdl)[0] or '?'}"
                         + ("" if r.ok else f" {r.problems}"))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.ampere.aot_tilelang",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--config", type=Path, nargs="+", required=True, help="V4.1 config.json files (a pack's)")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 86], choices=sorted(SM_LIMITS))
    ap.add_argument("--nvcc", default=None, help="nvcc to compile with (default: on PATH; none: lowering only)")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    nvcc = a.nvcc or shutil.which("nvcc")
    specs = [s for path in a.config for s in specs_for(MhcShape.from_config(path))]
    results = check(specs, a.arch, nvcc, progress=lambda s: print(s, flush=True))
    bad = [r for r in results if not r.ok]
    how = f" (lowered, compiled by {nvcc} and assembled)" if nvcc else " (lowered only: no nvcc, nothing compiled)"
    archs = "/sm_".join(map(str, a.arch))
    print(f"{len(results) - len(bad)}/{len(results)} TileLang mHC kernels clean for sm_{archs}{how}")
    if a.json:
        a.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
