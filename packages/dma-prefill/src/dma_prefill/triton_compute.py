"""The Triton backend: all experts of a staged batch in 13 kernels (decode, transforms, grouped GEMMs, SwiGLU).

See :class:`TritonCompute`; the launchers are :mod:`dma_prefill.triton_ops`, the kernels
:mod:`dma_prefill.triton_kernels`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .compute import BatchCompute, LayerPrep
from .config import PROJECTIONS, PrefillConfig, Projection
from .device import Device
from .layout import ExpertLayout
from .ops_torch import hadamard_pm1
from .plan import PrefillPlan
from .ring import Staged, StagingRing
from .store import ExpertStore
from .triton_ops import decode_into, grouped_gemm, post_swiglu, row_hadamard, row_sumsq

__all__ = ["TritonCompute", "make_tiles"]


def make_tiles(plan: PrefillPlan, bm: int) -> tuple[np.ndarray, dict[int, tuple[int, int]]]:
    """GEMM row tiles ``(local expert, row0, row1)`` (rows local to the batch) for every GPU batch."""
    out: list[tuple[int, int, int]] = []
    ranges: dict[int, tuple[int, int]] = {}
    for b in plan.gpu_batches:
        start = len(out)
        e0, _ = plan.batch_range(b)
        br0, _ = plan.batch_rows(b)
        for e in plan.routed(b).tolist():
            r0, r1 = plan.rows(e)
            for s in range(r0, r1, bm):
                out.append((e - e0, s - br0, min(s + bm, r1) - br0))
        ranges[b] = (start, len(out))
    return np.array(out, dtype=np.int32).reshape(-1, 3), ranges


class TritonCompute(BatchCompute):
    """Per batch: decode the B experts' three projections into fp16 scratch, then for all rows of the batch
    at once: input transforms (split), grouped GEMM gate and up (their epilogues sum the squares of the output
    rows), output transforms + SwiGLU, input transform, grouped GEMM down, output transform with the routing
    weight, atomically added into the layer output. 13 kernels (and two small memsets) per batch, none per
    expert; with ``stage_events`` set, CUDA events between the stages time them (``stage_times``)."""

    #: GEMM tile configs by BM: (BN, BK, num_warps, num_stages)
    gemm_configs: dict[int, tuple[int, int, int, int]] = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
    promote: bool = True
    #: Hadamard transforms as fp32 butterflies (True: per-expert error equal to a plain fp32 evaluation, 1.03e-6
    #: vs 1.04e-6 BLAS / 1.20e-6 sequential; 32k chunk 101.5 ms) or split fp16 tensor-core products (False: 2.9e-6,
    #: the tensor cores do not round to nearest while they accumulate; same speed within noise), results/h200-0d83cad-*
    fwht: bool = True
    #: row transforms: (rows per program, 128-column blocks per program, num_warps) for the GEMM inputs, the
    #: gate/up outputs + SwiGLU, and the down output + weighted add
    #: (defaults from scripts/kernel_tune.py on the H200 at the 32k-chunk shape, R = 4096 rows per batch)
    transform_config: tuple[int, int, int] = (64, 2, 4)
    swiglu_config: tuple[int, int, int] = (16, 4, 4)
    out_config: tuple[int, int, int] = (64, 2, 4)
    decode_block_tn: int = 8

    def __init__(
        self,
        store: ExpertStore,
        config: PrefillConfig,
        device: Device,
        torch_device: torch.device,
        scratch: torch.Tensor | None = None,
    ) -> None:
        super().__init__(store, config, device)
        self.torch_device = torch_device
        #: when a list, every batch appends ``(stage, cuda event)`` marks (``stage_times`` sums them); profiling only
        self.stage_events: list[tuple[str, Any]] | None = None
        self.hpm = hadamard_pm1(torch.float16, torch_device)
        spec = store.spec(store.layer_ids[0])
        B = config.experts_per_batch
        shapes = {p: (B, spec.proj(p).k, spec.proj(p).n) for p in PROJECTIONS}
        if scratch is None:
            self.w = {p: torch.empty(sh, dtype=torch.float16, device=torch_device) for p, sh in shapes.items()}
        else:  # carved out of a given uint8 buffer (e.g. VRAM lent by the expert cache)
            need = self.scratch_bytes(store, config)
            if scratch.dtype != torch.uint8 or scratch.dim() != 1 or scratch.numel() < need:
                raise ValueError(f"TritonCompute: scratch must be 1-D uint8 of at least {need} bytes, got "
                                 f"{scratch.dtype} {tuple(scratch.shape)}")  # fmt: skip
            self.w, pos = {}, 0
            for p, sh in shapes.items():
                n = 2 * sh[0] * sh[1] * sh[2]
                self.w[p] = scratch[pos : pos + n].view(torch.float16).view(sh)
                pos += n

    @staticmethod
    def scratch_bytes(store: ExpertStore, config: PrefillConfig) -> int:
        """Bytes of the decoded fp16 weights of one batch (gate, up, down of ``experts_per_batch`` experts)."""
        spec = store.spec(store.layer_ids[0])
        return sum(2 * config.experts_per_batch * spec.proj(p).k * spec.proj(p).n for p in PROJECTIONS)

    def prepare(self, plan: PrefillPlan, x: torch.Tensor) -> LayerPrep:
        busy = plan.counts[plan.counts > 0]
        bm = 64 if busy.size == 0 or busy.mean() <= 96 else 128
        tiles, ranges = make_tiles(plan, bm)
        return LayerPrep(
            plan,
            counts=torch.from_numpy(plan.counts).to(self.torch_device),
            tiles=torch.from_numpy(tiles).to(self.torch_device),
            tile_ranges=ranges,
            bm=bm,
        )

    def run_batch(
        self, ring: StagingRing, st: Staged, prep: LayerPrep, x: torch.Tensor, out: torch.Tensor, stream: Any
    ) -> None:
        routed, layout, slot = self._staged(ring, st, prep)
        self.device.launch(
            stream,
            lambda: self._batch(layout, slot, st, prep, routed, x, out),
            reads=st.tags(routed),
            label=f"L{st.layer}b{st.batch}",
        )

    def _mark(self, stage: str) -> None:
        if self.stage_events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stage_events.append((stage, ev))

    def stage_times(self) -> dict[str, float]:
        """Milliseconds per stage summed over the batches marked since ``stage_events`` was set (synchronizes)."""
        if not self.stage_events:
            return {}
        torch.cuda.synchronize()
        out: dict[str, float] = {}
        prev = None
        for stage, ev in self.stage_events:
            if stage != "start" and prev is not None:
                out[stage] = out.get(stage, 0.0) + prev.elapsed_time(ev)
            prev = ev
        return out

    def _batch(
        self,
        layout: ExpertLayout,
        slot: torch.Tensor,
        st: Staged,
        prep: LayerPrep,
        routed: tuple[int, ...],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        plan = prep.plan
        spec = layout.spec
        cfg = self.config
        assert prep.counts is not None and prep.tiles is not None
        ne = st.e1 - st.e0
        counts = prep.counts[st.e0 : st.e1]
        slot32 = slot.view(torch.int32)
        slot16 = slot.view(torch.float16)
        s4, s2 = layout.stride // 4, layout.stride // 2
        self._mark("start")
        for p in PROJECTIONS:
            ps = spec.proj(p)
            decode_into(
                slot32, s4, layout.elem_offset(p, "trellis", 4), counts, self.w[p], ps.k, ps.n, ps.bits, ps.codebook,
                block_tn=self.decode_block_tn,
            )  # fmt: skip
        self._mark("decode")
        r0, r1 = plan.batch_rows(st.batch)
        R = r1 - r0
        tok = plan.sorted_tokens[r0:r1]
        grp = plan.sorted_experts[r0:r1]
        wts = plan.sorted_weights[r0:r1]
        t0, t1 = prep.tile_ranges[st.batch]
        tiles = prep.tiles[t0:t1]
        H, I = spec.hidden, spec.intermediate
        dev = self.torch_device
        split = cfg.exact

        def kcfg(c: tuple[int, int, int]) -> dict[str, Any]:
            return {"block_r": c[0], "cpb": c[1], "num_warps": c[2]}

        tcfg: dict[str, Any] = {**kcfg(self.transform_config), "fwht": self.fwht}

        def gemm(
            hi: torch.Tensor, lo: torch.Tensor | None, inv: torch.Tensor, p: Projection, n: int, ss: torch.Tensor
        ) -> torch.Tensor:
            t = torch.empty((R, n), dtype=torch.float32, device=dev)
            bn, bk, nw, ns = self.gemm_configs[prep.bm]
            grouped_gemm(
                hi, lo, inv, self.w[p][:ne], tiles, t, bm=prep.bm, bn=bn, bk=bk, num_warps=nw, num_stages=ns,
                promote=self.promote, ss=ss,
            )  # fmt: skip
            return t

        def transform_in(
            inp: torch.Tensor, n: int, p: Projection, src: torch.Tensor | None, ss: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
            hi = torch.empty((R, n), dtype=torch.float16, device=dev)
            lo = torch.empty((R, n), dtype=torch.float16, device=dev) if split else None
            inv = torch.empty(R, dtype=torch.float32, device=dev)
            row_hadamard(
                inp, n, R, grp, st.e0, self.hpm, ss, mode=0, src=src, vec=slot16, vec_stride=s2,
                pre_off=layout.elem_offset(p, "suh", 2), split=split, o_hi=hi, o_lo=lo, o_inv=inv, **tcfg,
            )  # fmt: skip
            return hi, lo, inv

        def sumsq(inp: torch.Tensor, n: int, pres: tuple[Projection, ...], src: torch.Tensor | None) -> torch.Tensor:
            ss = torch.empty((max(1, len(pres)), R), dtype=torch.float32, device=dev)
            offs = tuple(layout.elem_offset(p, "suh", 2) for p in pres)
            row_sumsq(inp, n, R, grp, st.e0, ss, src=src, vec=slot16, vec_stride=s2, pre_offs=offs)
            return ss

        ss_in = sumsq(x, H, ("gate", "up"), tok)
        self._mark("row norms")
        ss_gu = torch.zeros((2, R), dtype=torch.float32, device=dev)  # filled by the GEMM epilogues
        tgu = []
        gate_up: tuple[Projection, Projection] = ("gate", "up")
        for i, p in enumerate(gate_up):
            a = transform_in(x, H, p, tok, ss_in[i])
            self._mark("transform in")
            tgu.append(gemm(*a, p, I, ss_gu[i]))
            del a
            self._mark("gemm gate/up")
        tg, tu = tgu
        act = torch.empty((R, I), dtype=torch.float32, device=dev)
        svh = (layout.elem_offset("gate", "svh", 2), layout.elem_offset("up", "svh", 2))
        post_swiglu(
            tg, tu, ss_gu, grp, st.e0, slot16, s2, svh, self.hpm, act, cfg.swiglu_limit, **kcfg(self.swiglu_config),
            fwht=self.fwht,
        )  # fmt: skip
        del tg, tu, tgu
        self._mark("post + swiglu")
        ss_act = sumsq(act, I, ("down",), None)[0]
        self._mark("row norms")
        a = transform_in(act, I, "down", None, ss_act)
        self._mark("transform in")
        ss_t = torch.zeros(R, dtype=torch.float32, device=dev)
        t = gemm(*a, "down", H, ss_t)
        del a
        self._mark("gemm down")
        row_hadamard(
            t, H, R, grp, st.e0, self.hpm, ss_t, mode=2, vec=slot16, vec_stride=s2,
            post_off=layout.elem_offset("down", "svh", 2), out=out, w=wts, dst=tok, **kcfg(self.out_config),
            fwht=self.fwht,
        )  # fmt: skip
        self._mark("post + weighted add")
        self.computed.extend((st.layer, e) for e in routed)
