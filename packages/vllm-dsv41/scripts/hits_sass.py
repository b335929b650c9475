"""Machine instructions per decoded weight in the inner loop of the Triton hit kernel, per variant (CPU, no GPU).

    uv run python packages/vllm-dsv41/scripts/hits_sass.py [--arch 90 86] [--bits 3]

Compiles ``hits_kernels.gemv_kernel`` with Triton for ``sm_<arch>`` (Triton's bundled ``ptxas`` and ``nvdisasm``;
no GPU), finds the innermost loop that decodes (the backward branch around the ``dp4a`` instructions), and prints
its instruction count per weight a thread decodes per iteration, with the registers per thread (``cuobjdump``), the
opcode mix, shared memory and spills.
A static measure: it says how much work the code asks of the SM's issue slots and integer pipes, not how fast it
runs (memory latency and occupancy decide that; ``benches/bench_hits.py`` on a GPU measures it).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

_TYPES = dict(IDS="*i32", ROWS="*i32", COUNT="*i32", S="i32", PTRS="*i64", E="i32", COL0="i32", A_HI="*fp16",
              A_LO="*fp16", A_INV="*fp32", A32="*fp32", P="*fp32", KS="i32", KPER="i32", MULT="i32",
              ADD="i32")  # fmt: skip


def loop_body(sass: str) -> list[str]:
    """Instructions of the shortest loop (a backward ``BRA`` to a label) that contains a ``dp4a`` (``IDP``)."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1))
    best: tuple[int, int] | None = None
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), len(ins)) <= i:
            start = labels[m.group(1)]
            if any("IDP" in x for x in ins[start : i + 1]) and (best is None or i - start < best[1] - best[0]):
                best = (start, i)
    if best is None:
        raise RuntimeError("no loop with a dp4a found in the SASS")
    return ins[best[0] : best[1] + 1]


def registers(cubin: bytes) -> int:
    """Registers per thread of the cubin's kernel (Triton's bundled ``cuobjdump -res-usage``)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no register count: {out[:300]}")
    return int(m.group(1))


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_dsv41 import hits_kernels as hk
    from vllm_dsv41.ampere.aot import disassemble

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 86])
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--kdim", type=int, default=5120)
    ap.add_argument("--n", type=int, default=2304)
    a = ap.parse_args()
    # (label, block_n, block_k, num_warps, GROUPS, PICKS): PICKS 1 the one-pick launch, 2 the dot launch
    variants = [
        ("elements, dot (run 2)", 128, 32, 8, False, 0),
        ("groups, one pick (fp32 FMAs)", 128, 32, 8, True, 1),
        ("groups, one pick, block_n 256", 256, 32, 8, True, 1),
        ("groups, one pick, block_k 64", 128, 64, 8, True, 1),
        ("groups, more picks (dot)", 128, 32, 8, True, 2),
    ]
    print(f"gemv_kernel, MUL1 K={a.bits}, k={a.kdim} n={a.n}: instructions of the innermost decoding loop")
    print(f"{'arch':>5} {'variant':<32} {'w/thread':>8} {'instr':>6} {'per w':>6} {'regs':>5} {'shared':>7} "
          f"{'spills':>6}  mix")  # fmt: skip
    for arch in a.arch:
        for label, bn, bk, nw, groups, picks in variants:
            sig = {n: _TYPES.get(n, "constexpr") for n in hk.gemv_kernel.arg_names}
            const = dict(KDIM=a.kdim, N=a.n, NPROJ=2, K2=2 * a.bits, MUL1=True, BM=16, BN=bn, BK=bk, ASM=True,
                         GROUPS=groups, PICKS=picks, PREFETCH=0, PF_LINES=16)  # fmt: skip
            k = triton.compile(ASTSource(hk.gemv_kernel, sig, constexprs=const), target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": nw})  # fmt: skip
            sass = disassemble(k.asm["cubin"])
            if sass is None:
                raise SystemExit("nvdisasm not found (Triton's NVIDIA backend ships it)")
            body = loop_body(sass)
            mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            per_thread = bn * bk // (32 * nw)
            spills = len(re.findall(r"\b(?:STL|LDL)\b", sass))
            top = " ".join(f"{op}:{n}" for op, n in mix.most_common(9))
            print(f"{arch:>5} {label:<32} {per_thread:>8} {len(body):>6} {len(body) / per_thread:>6.1f} "
                  f"{registers(k.asm['cubin']):>5} {k.metadata.shared:>7} {spills:>6}  {top}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
