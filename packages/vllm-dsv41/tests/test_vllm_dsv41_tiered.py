"""The tiered runtime composed on a CPU "device": the real ExpertCache (host slots), the reference hit kernel
reading host addresses, the real CPU tier; against the float64 reference, across cache sizes and miss splits,
with the deadline fallback, the step protocol and the routing trace."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cpu_tier import CpuTierConfig
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41 import tiered as tiered_mod
from vllm_dsv41.config import TieredConfig
from vllm_dsv41.home import ExpertHome
from vllm_dsv41.reference import ReferenceExperts
from vllm_dsv41.split import Rates
from vllm_dsv41.tiered import TieredRuntime

LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 8, 2, 256
RATES = Rates(cpu_bps=10e9, pcie_bps=10e9, source="test")


def _slot_bytes(home: ExpertHome) -> int:
    from expert_cache import ExpertCacheConfig

    src = home.cache_home(list(home.layer_ids))
    return ExpertCacheConfig(num_layers=LAYERS, num_experts=EXPERTS, projections=src.projections).slot_stride


def _runtime(home: ExpertHome, slots: int, split: str = "auto", rates: Rates = RATES,
             graph_factory: Callable[[], object] | None = None, **tiered: object) -> TieredRuntime:  # fmt: skip
    tiered.setdefault("prefill", False)  # the decode composition (the staged prefill: test_vllm_dsv41_prefill.py)
    tiered.setdefault("cpu_drive", "host")  # the host-driven split (its CPU/PCIe shares); the stream's tests ask for it
    t = TieredConfig(split=split, hit_kernel="reference", replan_every=2, **tiered)  # type: ignore[arg-type]
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, home, "cpu", rates=rates, cache_bytes=max(slots * _slot_bytes(home), 1),
                       graph_factory=graph_factory)  # fmt: skip
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    return rt


def _routing(rng: np.random.Generator, tokens: int, hot: int = EXPERTS) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(hot, size=TOP_K, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, size=(tokens, TOP_K))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def _step(rt: TieredRuntime, rng: np.random.Generator, tokens: int, hot: int = EXPERTS) -> list[tuple]:
    """One model step: every MoE layer once, in order; returns (layer, x, ids, w, out) per layer."""
    done = []
    for layer in range(LAYERS):
        x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
        ids, w = _routing(rng, tokens, hot)
        out = torch.full((tokens + 2, HIDDEN), float("nan"))
        rt.forward_into(layer, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
        assert torch.isnan(out[tokens:]).all()  # rows past T untouched
        done.append((layer, x, ids, w, out[:tokens].numpy().copy()))
    return done


def _exact_steps(rt: TieredRuntime, rng: np.random.Generator, reference: ReferenceExperts, steps: int,
                 tokens: int, hot: int = EXPERTS) -> list[np.ndarray]:  # fmt: skip
    """``steps`` model steps of ``tokens`` tokens, every layer's output checked against the float64 reference."""
    outs = []
    for _ in range(steps):
        for layer, x, ids, w, out in _step(rt, rng, tokens=tokens, hot=hot):
            expected = reference.forward(layer, x, ids, w)
            np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
            outs.append(out)
    return outs


def test_rates_are_measured_per_tokens_per_expert(home: ExpertHome) -> None:
    """Without configured rates the CPU tier is timed at 1, 2, 4 and 8 tokens per expert when the cache is made
    (no PCIe rate on a CPU device), and the cost model and the log use every point."""
    rt = _runtime(home, 4, "auto", rates=None)  # type: ignore[arg-type]
    try:
        assert rt.rates is None
        _step(rt, np.random.default_rng(0), tokens=2)
        r = rt.rates
        assert r is not None and r.source == "measured" and r.pcie_bps == 0 and r.cpu_bps > 0
        assert r.cpu_fixed_s >= 0 and r.pcie_fixed_s == 0
        assert [m for m, _ in r.cpu_tokens] == [2, 4, 8] and all(v > 0 for _, v in r.cpu_tokens)
        assert "8 tokens" in r.describe()
        eb = 3 * HIDDEN * 128  # any size: the ratio to one token's time is what is checked
        assert r.cpu_expert_seconds(eb, 8) == pytest.approx(eb / dict(r.cpu_tokens)[8])
    finally:
        rt.close()


def test_affine_fit() -> None:
    from vllm_dsv41.tiered import _affine

    assert _affine(3.0, 12.0, 10) == (1.0, 2.0)  # t = 2 + n
    assert _affine(3.0, 2.0, 10) == (0.2, 0.0)  # no fixed part shown (noise): the mean
    assert _affine(3.0, 3.0, 1) == (3.0, 0.0)


@pytest.mark.parametrize("slots", [0, 5, LAYERS * EXPERTS])
@pytest.mark.parametrize("split", ["cpu", "pcie", "auto"])
def test_matches_the_reference_across_cache_sizes_and_splits(home: ExpertHome, reference: ReferenceExperts,
                                                             slots: int, split: str) -> None:  # fmt: skip
    rt = _runtime(home, slots, split)
    rng = np.random.default_rng(slots * 10 + len(split))
    try:
        for step in range(8):
            for layer, x, ids, w, out in _step(rt, rng, tokens=[1, 3, 17, 2][step % 4], hot=5):
                expected = reference.forward(layer, x, ids, w)
                np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        s = rt.stats
        assert s.picks == 2 * LAYERS * (1 + 3 + 17 + 2) * TOP_K
        # the decode-size calls' own counters (<= HIT_CHUNK_TOKENS = 16 tokens): the 17-token steps stay out
        d = rt.stats_decode
        assert d.steps == 6 and d.layer_calls == 6 * LAYERS and d.picks == 2 * LAYERS * (1 + 3 + 2) * TOP_K
        assert 0 < d.layer_seconds < s.layer_seconds and d.hit_picks <= s.hit_picks
        assert rt.cache is not None and rt.cache.num_slots == slots
        if slots == 0:
            assert s.hit_picks == 0
        else:
            assert s.hit_picks > 0  # replans every 2 steps admitted the hot experts
        if split == "cpu":
            assert s.pcie_picks == 0
        if split == "pcie":
            assert s.cpu_picks == 0
        if split == "auto" and slots < LAYERS * EXPERTS:
            assert s.cpu_picks > 0 and s.pcie_picks > 0  # equal rates: the misses are shared
            # the host's time per share is timed (run 3: auto slower than PCIe alone; these say where it goes)
            assert s.pcie_enqueue_seconds > 0 and s.cpu_wait_seconds > 0
            assert 0 < s.cpu_run_seconds <= s.cpu_seconds  # the pool's run time is within submit-to-wait
            assert s.cpu_pred_seconds > 0  # (decode-size calls: the startup rates' prediction, beside the run time)
            # the host's parts of the layer calls: within them, and the submit within begin
            assert 0 < s.submit_seconds < s.begin_seconds and 0 < s.bookkeeping_seconds
            parts = s.begin_seconds + s.finish_seconds + s.cpu_wait_seconds + s.bookkeeping_seconds
            assert 0 < parts <= s.layer_seconds
            assert "PCIe queuing" in s.describe() and "wait for the CPU tier" in s.describe()
        if split == "cpu":
            assert s.pcie_enqueue_seconds == 0
    finally:
        rt.close()


@pytest.mark.parametrize("slots", [0, 5])
@pytest.mark.parametrize("split", ["cpu", "pcie", "auto"])
def test_padding_rows_are_no_picks(home: ExpertHome, reference: ReferenceExperts, slots: int, split: str) -> None:
    """vLLM routes the rows a CUDA graph pads a batch with to expert -1: they are neither hits nor misses (the
    CPU tier never sees them), their output rows are zero, and the real rows match the reference."""
    rt = _runtime(home, slots, split)
    rng = np.random.default_rng(5)
    real = 0
    try:
        for step in range(6):
            tokens, pad = [3, 4, 1][step % 3], [1, 3, 2][step % 3]
            for layer in range(LAYERS):
                x = rng.standard_normal((tokens + pad, HIDDEN)).astype(np.float32)
                ids, w = _routing(rng, tokens + pad, hot=5)
                ids[tokens:] = -1
                out = torch.full((tokens + pad, HIDDEN), float("nan"))
                rt.forward_into(layer, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
                assert (out[tokens:] == 0).all()
                expected = reference.forward(layer, x[:tokens], ids[:tokens], w[:tokens])
                np.testing.assert_allclose(out[:tokens].numpy(), expected, rtol=0, atol=3e-5 * np.abs(expected).max())
                real += tokens * TOP_K
        s = rt.stats
        assert s.hit_picks + s.cpu_picks + s.pcie_picks == real
        assert (s.hit_picks > 0) == (slots > 0)
    finally:
        rt.close()


def test_hit_calls_in_chunks_equal_one_call(home: ExpertHome, reference: ReferenceExperts,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A MoE call longer than HIT_CHUNK_TOKENS runs its hits in chunks of that many tokens, and its PCIe share as
    rows of one pick sorted by expert in chunks of as many picks (HIT_CHUNK_TOKENS x top_k: each layer's kernel
    scratch stays bounded): the same result as the reference."""
    import vllm_dsv41.tiered as tiered

    monkeypatch.setattr(tiered, "HIT_CHUNK_TOKENS", 2)
    seen: list[tuple[int, int]] = []  # (rows, picks per row) of every kernel call
    rt = _runtime(home, 5, "auto")
    for kernel in rt._hits.values():
        forward = kernel.forward
        kernel.forward = lambda table, x, ids, *a, _f=forward: (seen.append(tuple(ids.shape)), _f(table, x, ids, *a))[1]
    rng = np.random.default_rng(5)
    try:
        for step in range(6):
            for layer, x, ids, w, out in _step(rt, rng, tokens=[7, 1, 5][step % 3], hot=5):
                expected = reference.forward(layer, x, ids, w)
                np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        assert rt.stats.hit_picks > 0 and rt.stats.pcie_picks > 0
        assert seen and max(r * k for r, k in seen) == 2 * TOP_K
        assert max(r for r, k in seen if k == TOP_K) == 2  # token chunks (hits, decode-size PCIe shares)
        assert any(k == 1 and r > 2 for r, k in seen)  # a prompt's PCIe share, pick-major
    finally:
        rt.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM's forward context trips torch's own
def test_a_dummy_forward_is_answered_with_zeros(home: ExpertHome, reference: ReferenceExperts) -> None:
    """vLLM's dummy forwards (no attention metadata: profiling, warm-ups, graph-capture warm-ups; NaN inputs
    possible) get zeros: no step, no cache created, no buffers grown, no CPU job; the next real batch is computed."""
    from vllm.forward_context import ForwardContext, override_forward_context

    rt = _runtime(home, 5, "auto")
    try:
        rng = np.random.default_rng(9)
        x = torch.full((40, HIDDEN), float("nan"))
        ids, w = _routing(rng, 40)
        out = torch.full((40, HIDDEN), float("nan"))
        dummy = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})  # type: ignore[arg-type]
        with override_forward_context(dummy):
            for layer in range(LAYERS):
                rt.forward_into(layer, x, torch.from_numpy(ids), torch.from_numpy(w), out)
                assert (out == 0).all()
        assert rt.stats.profile_calls == LAYERS and rt.stats.steps == 0 and rt.stats.picks == 0
        assert rt.cache is None and not rt._buffers
        with override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})):
            for layer, xs, ids2, w2, got in _step(rt, rng, tokens=3):
                expected = reference.forward(layer, xs, ids2, w2)
                np.testing.assert_allclose(got, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        assert rt.cache is not None and rt.stats.steps == 1
    finally:
        rt.close()


def test_a_cache_created_inside_a_step(home: ExpertHome, reference: ReferenceExperts) -> None:
    """vLLM binds its KV cache between two layers of a step (the plugin then allows the cache): the cache's step
    opens where it is created, and the next step closes it (one after_step per before_step)."""
    rt = _runtime(home, 5, "auto")
    rt._allowed = False  # a GPU model's runtime before vLLM's KV cache exists
    rng = np.random.default_rng(11)
    try:
        for step in range(5):
            for layer in range(LAYERS):
                if step == 1 and layer == 1:
                    rt.allow_cache()
                x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
                ids, w = _routing(rng, 2, hot=4)
                out = torch.empty((2, HIDDEN))
                rt.forward_into(layer, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
                expected = reference.forward(layer, x, ids, w)
                np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=3e-5 * np.abs(expected).max())
            assert (rt.cache is None) == (step == 0)
        assert rt.stats.hit_picks > 0  # the replans ran: the cache's steps were opened and closed in order
    finally:
        rt.close()


def _wide_runtime(home: ExpertHome, graph_factory: Callable[[], object] | None = None,
                  **tiered: object) -> TieredRuntime:  # fmt: skip
    """A runtime whose hit kernel needs wider loads than this home's tensors give (a checkpoint's safetensors files
    align tensors to 8 bytes; exllamav3's kernel loads 16): the reference kernel with its alignment raised."""
    from vllm_dsv41.hits import ReferenceHits, make_hits

    class Wide(ReferenceHits):
        alignment = 256  # what the cache's slots give (slot_alignment), wider than this home's tensors

    def factory(lx, dev):  # type: ignore[no-untyped-def]
        k = make_hits(lx, dev, backend="reference")
        k.__class__ = Wide
        return k

    tiered.setdefault("prefill", False)
    tiered.setdefault("cpu_drive", "host")
    t = TieredConfig(hit_kernel="reference", replan_every=2, **tiered)  # type: ignore[arg-type]
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    # a cache of 5 slots once the transient slots (taken from the budget when the read is staged) are out
    budget = (6 + int(tiered.get("pcie_stage_slots", TieredConfig().pcie_stage_slots))) * _slot_bytes(home)  # type: ignore[call-overload]
    rt = TieredRuntime(cfg, home, "cpu", rates=RATES, cache_bytes=budget, hits_factory=factory,
                       graph_factory=graph_factory)  # fmt: skip
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    return rt


@pytest.mark.parametrize("slots", [1, 3, 16])
@pytest.mark.parametrize("split", ["pcie", "auto"])
def test_the_staged_read_through_transient_slots(home: ExpertHome, reference: ReferenceExperts, slots: int,
                                                  split: str) -> None:  # fmt: skip
    """pcie_read auto on a home the hit kernel cannot read in place: the GPU's share of the misses is copied into
    transient slots (in rounds when they are fewer than its experts) and read from there; the same results, also
    for a call of more tokens than one kernel call takes (its picks sorted by expert, a run of rows per round)."""
    rt = _wide_runtime(home, split=split, pcie_read="auto", pcie_stage_slots=slots)
    rng = np.random.default_rng(slots)
    try:
        for step in range(8):
            for layer, x, ids, w, out in _step(rt, rng, tokens=[1, 3, 5, 24][step % 4], hot=6):
                expected = reference.forward(layer, x, ids, w)
                np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        s = rt.stats
        assert rt.cache.home_alignment < 256
        assert rt._stager is not None and rt._stager.n == slots and rt.cache.num_slots == 5
        assert s.pcie_picks > 0 and s.hit_picks > 0 and rt._stager.bytes_copied > 0
        if split == "pcie":
            assert s.cpu_picks == 0
            # the decode-size steps on the device path, their misses staged by the device over the same slots
            assert s.device_steps == 6 and rt._dstage is not None and rt._dstage.bytes_copied > 0
        if slots == 1 and split == "pcie":
            assert rt._stager.rounds > 2 * LAYERS  # the 24-token steps: several rounds per layer
        st = rt._stager
        assert st.groups == (2 if slots >= 2 else 1) and st.round_size == slots // st.groups
    finally:
        rt.close()


def test_staged_rounds_alternate_between_two_slot_groups(home: ExpertHome) -> None:
    """Double buffering: consecutive rounds fill the two halves of the transient slots in turn (round r + 1's copies
    never write the slots round r's kernel reads), each round's table points its experts into its own half, and a
    round larger than a half is refused."""
    rt = _wide_runtime(home, split="pcie", pcie_read="auto", pcie_stage_slots=4)
    try:
        _step(rt, np.random.default_rng(3), tokens=1, hot=6)  # creates the cache and the stager
        st = rt._stager
        assert st is not None and st.groups == 2 and st.round_size == 2
        table = rt.cache.layer_pointers(0)
        stride = st.stride
        groups = []
        for r, experts in enumerate((np.array([1, 4]), np.array([2, 7]), np.array([5]))):
            ptrs = st.stage(0, experts, table, 0, r)
            slots = (ptrs[:, experts].numpy() - st.base - st.offs[:, None]) // stride  # [P, k] slot of each expert
            assert (slots == slots[0]).all()  # every projection of an expert in one slot
            groups.append(set((slots[0] // st.round_size).tolist()))
            untouched = np.setdiff1d(np.arange(table.shape[1]), experts)
            assert torch.equal(ptrs[:, untouched], table[:, untouched])  # the other columns still read the home
            st.done()
        assert groups[0] == {0} and groups[1] == {1} and groups[2] == {0}
        with pytest.raises(ValueError, match="rounds of 2 transient slots"):
            st.stage(0, np.array([1, 2, 3]), table, 0, 0)
    finally:
        rt.close()


def test_the_mapped_read_refuses_a_home_its_kernel_cannot_read(home: ExpertHome) -> None:
    rt = _wide_runtime(home, split="pcie", pcie_read="mapped")
    rng = np.random.default_rng(0)
    try:
        with pytest.raises(ValueError, match=r"pcie_read 'mapped' needs the host home's tensors 256-byte aligned"):
            _step(rt, rng, tokens=2)
    finally:
        rt.close()


def test_staged_and_mapped_reads_agree(home: ExpertHome) -> None:
    """The same hit kernel through the home in place and through transient slots: bit-identical outputs (the
    decode-size steps on the device path: its misses staged by the device in rounds of the 2 slots, ``dev_stage``;
    the 20-token step on the split path: staged by the copy engine)."""
    outs = []
    for mode in ("mapped", "staged"):
        rt = _runtime(home, 0, "pcie", pcie_read=mode, pcie_stage_slots=2)
        rng = np.random.default_rng(9)
        try:
            outs.append([o for n in (3, 3, 20, 3) for *_, o in _step(rt, rng, tokens=n, hot=6)])
            assert (rt._stager is not None) == (mode == "staged") and rt.stats.device_steps == 3
            if mode == "staged":
                assert rt._dstage is not None and rt._dstage.bytes_copied > 0 and rt._stager.bytes_copied > 0
        finally:
            rt.close()
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("alignment", "pcie_read", "switched"),
    [(8, "auto", True), (16, "auto", False), (8, "staged", False)],
)
def test_auto_hit_kernel_takes_ours_on_a_home_exllamav3_cannot_read_in_place(
    home: ExpertHome,
    reference: ReferenceExperts,
    monkeypatch: pytest.MonkeyPatch,
    alignment: int,
    pcie_read: str,
    switched: bool,
) -> None:
    """``hit_kernel`` "auto" with exllamav3 (stood in for by the reference kernel under its name and alignment) on a
    home of 8-byte-aligned tensors: the layers get our kernel (asked of ``make_hits`` by name) and the misses are
    read in place (no transient slots); on a 16-byte-aligned home, or with ``pcie_read`` "staged" asked, nothing
    changes. Outputs exact either way."""
    from vllm_dsv41 import hits as hits_mod
    from vllm_dsv41.hits import ReferenceHits

    class FakeExl3(ReferenceHits):
        name = "exllamav3"
        alignment = 16

    t = TieredConfig(split="pcie", hit_kernel="auto", pcie_read=pcie_read, replan_every=2, prefill=False)
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, home, "cpu", rates=RATES, cache_bytes=12 * _slot_bytes(home))
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    for k in rt._hits.values():
        k.__class__ = FakeExl3
    asked: list[str] = []
    make = hits_mod.make_hits

    def recording(lx, dev, backend="auto", **kw):  # type: ignore[no-untyped-def]
        asked.append(backend)
        return make(lx, dev, backend="reference", **kw)

    monkeypatch.setattr(hits_mod, "make_hits", recording)
    monkeypatch.setattr(tiered_mod, "_home_alignment", lambda rows: alignment)
    try:
        _exact_steps(rt, np.random.default_rng(3), reference, steps=3, tokens=2)
        assert asked == (["triton"] * LAYERS if switched else [])
        names = {k.name for k in rt._hits.values()}
        assert names == ({"reference"} if switched else {"exllamav3"})
        assert (rt._stager is None) == (pcie_read == "auto")
    finally:
        rt.close()


@pytest.mark.parametrize("why", ["device_stage off", "not 4-byte words"])
def test_without_device_staging_a_staged_home_keeps_the_split_path(
    home: ExpertHome, reference: ReferenceExperts, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """With ``device_stage`` off, or on a home whose tensors are not 4-byte words (``DeviceStaging.supported``
    false), a staged home has no device path: split "pcie" runs its decode steps on the split path (the copy engine
    stages), with the same results."""
    if why == "not 4-byte words":
        monkeypatch.setattr(tiered_mod.DeviceStaging, "supported", staticmethod(lambda alignment, nbytes: False))
    rt = _runtime(home, 0, "pcie", pcie_read="staged", pcie_stage_slots=2, device_stage=why != "device_stage off")
    rng = np.random.default_rng(4)
    try:
        _exact_steps(rt, rng, reference, 3, tokens=2)
        assert rt._stager is not None and rt._dstage is None
        assert rt.stats.device_steps == 0 and rt._stager.bytes_copied > 0 and rt.stats.pcie_picks > 0
    finally:
        rt.close()


def test_the_combine_does_not_depend_on_the_split(home: ExpertHome) -> None:
    """With misses read by the same GPU kernel as hits (split=pcie), every cache size gives bit-identical outputs:
    each pick is computed once, in one place, and summed in a fixed order."""
    outs = []
    for slots in (0, 3, LAYERS * EXPERTS):
        rt = _runtime(home, slots, "pcie")
        rng = np.random.default_rng(5)
        try:
            outs.append([o for _ in range(6) for *_, o in _step(rt, rng, tokens=4, hot=6)])
            hits = rt.stats.hit_picks
        finally:
            rt.close()
        assert (hits > 0) == (slots > 0)
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert np.array_equal(a, b)


def test_decode_with_every_miss_over_pcie_runs_without_a_host_sync(home: ExpertHome, reference: ReferenceExperts,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    """split "pcie" with mapped reads: decode-size calls go to the device in one hit-kernel call per layer (the
    pointer table sends each pick to its slot or its host bytes) with no host sync and no host-side split; the
    same outputs, counters and routing trace as the split path (forced for comparison), and longer calls keep the
    split path."""
    runs = {}
    for device_only in (True, False):
        rt = _runtime(home, 5, "pcie", trace_path=str(tmp_path / f"trace_{device_only}.npz"))
        if not device_only:
            rt._device_only = lambda t: False  # type: ignore[method-assign]
        rng = np.random.default_rng(13)
        try:
            outs = [
                o for step in range(10) for o in _exact_steps(rt, rng, reference, 1, [1, 4, 16, 3, 24][step % 5], 7)
            ]
            if device_only:
                assert rt._dev_counts is not None and rt.stats.device_steps == 8  # the 8 decode-size steps
                assert rt._stats_decode.wait_seconds == 0 < rt._stats.wait_seconds  # only the 24-token calls synced
            s = rt.stats
            runs[device_only] = (outs, s.hit_picks, s.pcie_picks, s.cpu_picks, rt.stats_decode.pcie_picks)
        finally:
            rt.close()
    (a, *ca), (b, *cb) = runs[True], runs[False]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    assert ca == cb and ca[0] > 0 and ca[1] > 0 and ca[2] == 0
    ta, tb = np.load(tmp_path / "trace_True.npz"), np.load(tmp_path / "trace_False.npz")
    assert sorted(ta.files) == sorted(tb.files)
    for f in ta.files:
        assert np.array_equal(ta[f], tb[f]), f


def test_the_stream_driven_cpu_tier_gives_the_host_driven_results_bit_for_bit(
    home: ExpertHome, reference: ReferenceExperts, tmp_path: Path
) -> None:
    """cpu_drive "stream": the CPU tier's share submitted and waited for by the device stream's host functions (run
    in order on a CPU device) gives the host-driven split path's outputs bit for bit (each pick computed once, by
    the same kernel in the same chunks; zeros added where the other side computed it), the same counters and the
    same routing trace; calls above the decode size keep the host path."""
    runs = {}
    for drive in ("stream", "host"):
        # (no deadline: a pick the GPU recomputed under load would differ in its last bits)
        rt = _runtime(home, 5, "cpu", cpu_drive=drive, trace_path=str(tmp_path / f"trace_{drive}.npz"),
                      deadline_factor=0.0)  # fmt: skip
        rng = np.random.default_rng(21)
        try:
            outs = [
                o for step in range(10) for o in _exact_steps(rt, rng, reference, 1, [1, 4, 16, 3, 24][step % 5], 7)
            ]
            s = rt.stats
            if drive == "stream":
                assert s.stream_steps == 8 and rt._stats_decode.stream_steps == 8  # the 8 decode-size steps
                assert rt._stats_decode.wait_seconds == 0 < rt._stats.wait_seconds  # only the 24-token calls synced
                assert 0 < s.cpu_run_seconds <= s.cpu_seconds and s.stream_wait_seconds > 0
                assert "with the CPU tier driven by the stream" in s.describe()
            runs[drive] = (outs, s.hit_picks, s.cpu_picks, s.pcie_picks, rt.stats_decode.cpu_picks)
        finally:
            rt.close()
    (a, *ca), (b, *cb) = runs["stream"], runs["host"]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    assert ca == cb and ca[0] > 0 and ca[1] > 0 and ca[2] == 0
    ta, tb = np.load(tmp_path / "trace_stream.npz"), np.load(tmp_path / "trace_host.npz")
    for f in ta.files:
        assert np.array_equal(ta[f], tb[f]), f


def test_the_stream_driven_cpu_tier_leaves_what_it_misses_to_the_gpu(home: ExpertHome,
                                                                      reference: ReferenceExperts) -> None:  # fmt: skip
    """Jobs that stop early on the stream path (the test hook: each cancels itself after one expert chunk, as a
    deadline's cancel does): the wait lists the picks they did not compute and the hit kernel computes those from
    the host home; the outputs stay exact and the picks are counted, with the failure logged."""
    # a deadline the jobs always meet (a minute): only the hook stops them
    rt = _runtime(home, 3, "cpu", cpu_drive="stream", deadline_factor=1.0, deadline_floor_ms=60_000.0)
    real = rt._tier.stream_call
    rt._tier.stream_call = lambda *a, **k: real(*a, **k, _test_cancel_after_chunks=1)  # type: ignore[method-assign]
    rng = np.random.default_rng(4)
    try:
        _exact_steps(rt, rng, reference, 6, 8)
        s = rt.stats
        assert s.stream_steps == 6 and s.fallback_picks > 0 and s.deadline_misses == 0
        assert s.cpu_picks + s.hit_picks == 6 * LAYERS * 8 * TOP_K
    finally:
        rt.close()


def test_auto_measures_the_stream_driven_split_against_the_device_path(
    home: ExpertHome, reference: ReferenceExperts
) -> None:
    """split "auto" with cpu_drive "stream": the chooser's split side is the stream path (every miss to the CPU
    tier, no host sync); both sides are measured and every output is exact."""
    rt = _runtime(home, 4, "auto", cpu_drive="stream", split_probe=2)
    rng = np.random.default_rng(6)
    try:
        _exact_steps(rt, rng, reference, 10, 2)
        s = rt.stats
        assert s.stream_steps > 0 and s.device_steps > 0 and s.stream_steps + s.device_steps == 10
        assert s.cpu_picks > 0 and s.pcie_picks > 0
    finally:
        rt.close()


def test_the_stream_driven_split_shares_the_misses_by_the_rates(home: ExpertHome,
                                                               reference: ReferenceExperts) -> None:  # fmt: skip
    """stream_share with split "auto", cpu_drive "stream", the split side only (no probes): per call the GPU reads
    the quota of the distinct missed experts (``share_quota_table`` at the rates: equal rates, about half) from
    the host home while the CPU tier computes the rest; every output exact, every pick counted once (hit, CPU or
    PCIe); with split "cpu", or without stream_share, no share."""
    from vllm_dsv41.split import share_quota_table

    for split, asked, share in (("auto", True, True), ("cpu", True, False), ("auto", False, False)):
        # (split_feedback 0: the quota at the startup rates; the feedback's own test is below)
        rt = _runtime(home, 3, split, cpu_drive="stream", stream_share=asked, split_probe=0, deadline_factor=0.0,
                      split_feedback=0.0)  # fmt: skip
        rng = np.random.default_rng(12)
        try:
            for tokens in (1, 3, 8):
                _exact_steps(rt, rng, reference, 3, tokens)
            s = rt.stats
            assert s.stream_steps == 9 and s.device_steps == 0
            assert s.hit_picks + s.cpu_picks + s.pcie_picks == 3 * LAYERS * (1 + 3 + 8) * TOP_K
            assert s.cpu_picks > 0 and (s.pcie_picks > 0) == share, s.describe()
            eb = rt._expert_bytes[0]
            if share:
                dev, _, q, _ = rt._stream_quota[(eb, TOP_K)]
                assert np.array_equal(q, share_quota_table(eb, RATES, 16, TOP_K)) and np.array_equal(dev.numpy(), q)
                assert 0 < q[8, 8] < 8 and rt._share_quota(0, 8, TOP_K) is not None
            else:
                assert not rt._stream_quota
        finally:
            rt.close()


class _ScaledStreamCall:
    """A ``StreamCall`` whose counters report its jobs' run time as ``factor`` times their prediction (from the last
    ``set_factor`` on)."""

    def __init__(self, call: object, factor: float) -> None:
        self.call, self.factor = call, factor
        self._run0 = self._pred0 = 0.0

    def _run(self, predicted_s: float) -> float:
        return self._run0 + self.factor * (predicted_s - self._pred0)

    def set_factor(self, factor: float) -> None:
        pred = self.call.counters().predicted_s  # type: ignore[attr-defined]
        self._run0, self._pred0, self.factor = self._run(pred), pred, factor

    def counters(self) -> object:
        now = self.call.counters()  # type: ignore[attr-defined]
        return now._replace(run_s=self._run(now.predicted_s))

    def __getattr__(self, name: str) -> object:
        return getattr(self.call, name)


class _ScaledStreamTier:
    def __init__(self, tier: object, factor: float) -> None:
        self.tier, self.factor = tier, factor

    def stream_call(self, *args: object, **kwargs: object) -> _ScaledStreamCall:
        return _ScaledStreamCall(self.tier.stream_call(*args, **kwargs), self.factor)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tier, name)


@pytest.mark.parametrize(("feedback", "graphs"), [(0.0, False), (0.5, False), (0.5, True)])
def test_split_feedback_moves_the_stream_share_off_a_cpu_tier_slower_than_its_startup_rate(
    home: ExpertHome, reference: ReferenceExperts, feedback: float, graphs: bool
) -> None:
    """The stream path's jobs run 4x their startup prediction: folding their counters moves the CPU tier's feedback
    average to ~4 and builds the quota table again at the split's rates, in place (the same device tensor: the
    layer graphs, captured before, replay it with no new capture), giving the GPU's PCIe reads a larger share;
    every output exact. No feedback: the startup table stays."""
    from vllm_dsv41.split import share_quota_table

    rt = _runtime(home, 3, "auto", cpu_drive="stream", stream_share=True, split_probe=0, deadline_factor=0.0,
                  split_feedback=feedback, layer_graphs=graphs,
                  graph_factory=_RerunGraph if graphs else None)  # fmt: skip
    rt._tier = _ScaledStreamTier(rt._tier, 4.0)  # type: ignore[assignment]
    rng = np.random.default_rng(14)
    try:
        _exact_steps(rt, rng, reference, 2, 4)
        eb = rt._expert_bytes[0]
        dev, _, q0, _ = rt._stream_quota[(eb, TOP_K)]
        q0 = q0.copy()  # (on a CPU device the table, its source and the host copy are one array)
        assert np.array_equal(q0, share_quota_table(eb, RATES, 16, TOP_K))  # built before any fold
        s = rt.stats  # the fold: 2 steps x 2 layers of jobs, 4x their prediction
        dev1, _, q1, _ = rt._stream_quota[(eb, TOP_K)]
        assert dev1 is dev and np.array_equal(dev.numpy(), q1)
        if feedback:
            assert s.cpu_scale == pytest.approx(4.0 ** (1 - 0.5**4))
            assert "split feedback: CPU tier x3.67" in s.describe()  # 4 ** (1 - 0.5 ** 4)
            assert np.array_equal(q1, share_quota_table(eb, rt.split_rates(), 16, TOP_K))
            assert (q1 >= q0).all() and (q1 > q0).any()
        else:
            assert s.cpu_scale == 1.0 and np.array_equal(q1, q0)
        before = (s.cpu_picks, s.pcie_picks)
        captures = rt._graphs.captures if rt._graphs is not None else 0
        assert (captures > 0) == graphs
        _exact_steps(rt, rng, reference, 3, 4)
        assert (rt._graphs.captures if rt._graphs is not None else 0) == captures
        s = rt.stats
        assert s.cpu_picks > before[0] and s.pcie_picks > before[1]
        assert s.hit_picks + s.cpu_picks + s.pcie_picks == 5 * LAYERS * 4 * TOP_K
    finally:
        rt.close()


def test_the_stream_path_needs_a_home_read_in_place(home: ExpertHome, reference: ReferenceExperts) -> None:
    # staged reads (the GPU's fallback would need the host to stage the missed picks): the host-driven path
    rt = _runtime(home, 3, "cpu", cpu_drive="stream", pcie_read="staged", device_stage=False)
    rng = np.random.default_rng(8)
    try:
        _exact_steps(rt, rng, reference, 3, 2)
        assert rt.stats.stream_steps == 0 and rt.stats.cpu_picks > 0
    finally:
        rt.close()


def test_the_routing_trace_holds_each_steps_own_routing(home: ExpertHome, tmp_path: Path) -> None:
    """Each step's routing is recorded after the next step's first CPU job is submitted (off the CPU tier's
    critical path) or before the device path rewrites its pinned copies: the trace still holds every step's own
    ids, in order, on both decode paths and with prefill-size steps between them."""
    from expert_cache import load_trace

    for device_only in (True, False):
        path = tmp_path / f"own_{device_only}.npz"
        rt = _runtime(home, 5, "pcie" if device_only else "cpu", trace_path=str(path))
        rng = np.random.default_rng(21)
        given = []
        try:
            for step in range(7):
                rows = _step(rt, rng, tokens=[1, 3, 16, 2, 1, 24, 4][step])
                given.append(np.stack([ids for _, _, ids, _, _ in rows], axis=1))  # [T, L, K]
            assert (rt.stats.device_steps > 0) == device_only
        finally:
            rt.close()
        trace = load_trace(path)
        assert trace.tokens_per_step.tolist() == [1, 3, 16, 2, 1, 24, 4]
        assert np.array_equal(trace.ids, np.concatenate(given).astype(trace.ids.dtype)), device_only


class _LateEvent:
    """A copy event the stream has not passed until ``done`` (query False); ``synchronize`` waits it out."""

    def __init__(self, log: list[str]) -> None:
        self.done, self.log = False, log

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:  # (a wait)
            self.log.append("sync")
        self.done = True


def test_the_trace_waits_for_no_copy_until_its_ring_is_full(home: ExpertHome, tmp_path: Path) -> None:
    """On the no-sync paths a step's routing copies are recorded once their event has passed (a query), never by a
    sync, while the ring of pinned copies has a free slot; a step about to reuse a slot still waiting is recorded
    first (the one sync), and close records the rest: every step, in order, its own ids."""
    from expert_cache import load_trace
    from vllm_dsv41.tiered import _TRACE_RING

    path = tmp_path / "late.npz"
    rt = _runtime(home, 5, "pcie", trace_path=str(path))
    log: list[str] = []
    events: list[_LateEvent] = []

    def late() -> _LateEvent:
        events.append(_LateEvent(log))
        return events[-1]

    rt._trace_event = late  # type: ignore[method-assign]
    rng = np.random.default_rng(5)
    given = []
    try:
        for step in range(_TRACE_RING + 2):
            rows = _step(rt, rng, tokens=1 + step % 3)
            given.append(np.stack([ids for _, _, ids, _, _ in rows], axis=1))
            if step < _TRACE_RING:  # the ring not yet full: nothing recorded, no sync
                assert len(rt._trace_pending) == step + 1 and not log
        # steps 4 and 5 reused the slots of steps 0 and 1 (copies not done): each recorded its slot's step first
        assert log == ["sync", "sync"] and len(rt._trace_pending) == _TRACE_RING
        events[2].done = True  # the stream passed step 2's copies: the next flush records it without a sync
        rt._flush_trace()
        assert len(rt._trace_pending) == _TRACE_RING - 1 and log == ["sync", "sync"]
    finally:
        rt.close()
    assert log == ["sync"] * 5  # close waited for the other three
    trace = load_trace(path)
    assert trace.tokens_per_step.tolist() == [1 + s % 3 for s in range(_TRACE_RING + 2)]
    assert np.array_equal(trace.ids, np.concatenate(given).astype(trace.ids.dtype))


def _auto_on_a_virtual_clock(home: ExpertHome) -> tuple[TieredRuntime, _VirtualClock]:
    """A split "auto" runtime (2 probe steps a path, 3 slots) whose chooser reads a ``_VirtualClock``."""
    rt = _runtime(home, 3, "auto", split_probe=2, deadline_factor=0.0)
    clock = _VirtualClock()
    rt._span_mark = clock.mark  # type: ignore[method-assign]
    return rt, clock


def test_auto_measures_the_split_and_the_device_path_and_keeps_the_faster(
    home: ExpertHome, reference: ReferenceExperts
) -> None:
    """split "auto" with mapped reads: per decode batch size, ``split_probe`` steps on each path (alternating), then
    the faster by median step time; here the split path's CPU tier is slowed (on a virtual clock: 10 ms a job), so
    the device path is kept; every output exact on both paths."""
    rt, clock = _auto_on_a_virtual_clock(home)
    rt._tier = _SlowTier(rt._tier, delay=0.01, clock=clock)  # type: ignore[assignment]
    rng = np.random.default_rng(17)
    paths = []
    try:
        for _ in range(9):
            _exact_steps(rt, rng, reference, 1, tokens=2)
            paths.append(rt._step_path)
        chooser = rt._chooser
        assert chooser is not None and chooser.decisions and chooser.decisions[0][:2] == (2, "device")
        assert paths[:4] == ["split", "device", "split", "device"] and set(paths[4:]) == {"device"}, paths
        assert rt.stats.device_steps == paths.count("device") and rt.stats.cpu_picks > 0
    finally:
        rt.close()


def test_auto_charges_a_path_the_time_after_its_last_moe_layer(home: ExpertHome) -> None:
    """A step's sample runs to the next step's first MoE layer: here both paths' MoE layers take the same time, but
    after a split-path step the GPU waits 5 ms (vLLM's host work, which the split path's host syncs keep from
    overlapping the GPU; on a virtual clock): the device path is kept. (Timed from first to last MoE layer the two
    tie and the split path was kept: H200 run 7's 4-token steps.)"""
    rt, clock = _auto_on_a_virtual_clock(home)
    rng = np.random.default_rng(23)
    try:
        for _ in range(8):
            _step(rt, rng, tokens=2)
            if rt._step_path == "split":
                clock.now += 0.005
        chooser = rt._chooser
        assert chooser is not None and chooser.decisions, chooser
        t, kept, split_s, device_s = chooser.decisions[0]
        assert (t, kept) == (2, "device") and split_s > device_s + 0.004, chooser.decisions
    finally:
        rt.close()


def test_auto_times_a_step_from_its_first_moe_layer_to_its_last_not_the_idle_gap_after(
        home: ExpertHome) -> None:  # fmt: skip
    """Where the gap to the next step is idle time between requests (here 0.3 s after every step, on a virtual
    clock that ticks 1 ms a mark: more than ``_IDLE_FACTOR`` x the step's MoE span), the chooser's sample is the
    span alone (first MoE layer's begin to the last one's finish): the idle time is not charged to the path that
    ran before it."""
    rt, clock = _auto_on_a_virtual_clock(home)
    rng = np.random.default_rng(19)
    try:
        for _ in range(6):
            _step(rt, rng, tokens=2)
            clock.now += 0.3
        chooser = rt._chooser
        assert chooser is not None and chooser.decisions
        t, _, split_s, device_s = chooser.decisions[0]
        assert t == 2 and 0 < split_s < 0.1 and 0 < device_s < 0.1, chooser.decisions
    finally:
        rt.close()


def test_split_feedback_learns_from_cpu_jobs_that_miss_their_deadline(
    home: ExpertHome, reference: ReferenceExperts
) -> None:
    """A CPU tier whose every job misses its deadline: the fallback recomputes the picks (exact outputs) and the
    feedback still learns (what the job took, scaled to all its picks; before, it learned only from finished
    jobs and stayed at 1, the split sending the CPU tier work it could not do, every layer)."""
    rates = Rates(cpu_bps=1e12, pcie_bps=1e9, source="test")
    rt = _runtime(home, 0, "auto", rates=rates, split_feedback=0.5, split_probe=0, deadline_factor=1.0,
                  deadline_floor_ms=1.0)  # fmt: skip
    rt._tier = _StallingTier(rt._tier, stall=1)  # type: ignore[assignment]
    rng = np.random.default_rng(23)
    try:
        _exact_steps(rt, rng, reference, 3, tokens=4)
        assert rt.stats.deadline_misses >= 1 and rt.stats.cpu_scale > 100, rt.stats
    finally:
        rt.close()


def test_path_chooser_alternates_keeps_the_faster_and_measures_again() -> None:
    from vllm_dsv41.split import PathChooser

    c = PathChooser(probe=3, revisit=4)
    seconds = {"split": 0.010, "device": 0.004}
    seen = []
    for _ in range(6):
        p = c.choose(1)
        seen.append(p)
        assert c.record(1, p, seconds[p]) == ("device" if len(seen) == 6 else None)
    assert seen == ["split", "device"] * 3
    assert [c.choose(1) for _ in range(4)] == ["device"] * 4
    for p in ("split", "device"):  # kept steps are not measured
        assert c.record(1, p, 1.0) is None
    assert c.choose(1) == "split"  # revisit reached: both measured again
    seconds = {"split": 0.002, "device": 0.004}
    c.record(1, "split", seconds["split"])
    for _ in range(2):
        for p in ("device", "split"):
            c.record(1, p, seconds[p])
    c.record(1, "device", seconds["device"])
    assert c.decisions[-1] == (1, "split", 0.002, 0.004) and c.choose(1) == "split"
    assert c.choose(2) == "split"  # each batch size is measured on its own
    with pytest.raises(ValueError, match="probe"):
        PathChooser(probe=0)
    with pytest.raises(ValueError, match="path"):
        c.record(1, "cpu", 0.1)


class _RerunGraph:
    """A stand-in for a CUDA graph on the CPU: a replay runs the captured work again."""

    def __init__(self) -> None:
        self.work: Callable[[], None] | None = None

    def capture(self, work: Callable[[], None]) -> None:
        self.work = work

    def replay(self) -> None:
        assert self.work is not None
        self.work()


@pytest.mark.parametrize("path", ["device mapped", "device staged", "stream", "stream shared"])
def test_layer_graphs_replay_the_no_sync_paths_with_the_same_results(home: ExpertHome, reference: ReferenceExperts,
                                                                     path: str) -> None:  # fmt: skip
    """layer_graphs: a decode-size call on a no-sync path runs its inputs' copies eagerly and the rest as graphs
    (here a stand-in that runs the captured work again), captured on its shape's second call: on the device path
    one per call (in place, and staged: rounds of transient slots), on the stream-driven split one for begin and
    one for finish (the CPU tier's submit and wait are host functions inside them; "shared": split "auto" with
    its PCIe share). Against the float64 reference, and the same outputs bit for bit, the same counters and cache
    as without graphs; a prompt-size call between them (the split path, its own buffers) leaves the graphs."""
    runs = {}
    stream = path.startswith("stream")
    per_call = 2 if stream else 1  # graphs per layer call
    for graphs in (False, True):
        factory = _RerunGraph if graphs else None
        if path == "device mapped":
            rt = _runtime(home, 5, "pcie", graph_factory=factory, layer_graphs=graphs)
        elif path == "device staged":
            rt = _wide_runtime(home, graph_factory=factory, split="pcie", pcie_read="auto", pcie_stage_slots=3,
                               layer_graphs=graphs)  # fmt: skip
        else:
            # (no deadline: no timing-dependent fallback to the hit kernel)
            rt = _runtime(home, 5, "auto" if path == "stream shared" else "cpu", graph_factory=factory,
                          layer_graphs=graphs, cpu_drive="stream", stream_share=path == "stream shared",
                          split_probe=0, deadline_factor=0.0)  # fmt: skip
        rng = np.random.default_rng(21)
        try:
            outs = []
            for step, t in enumerate([1, 3, 1, 3, 1, 3, 24, 1, 3, 1, 3, 1, 3]):
                if graphs and step == 6:
                    assert rt._graphs is not None and len(rt._graphs) == 2 * LAYERS * per_call  # (1 and 3 tokens)
                    held = dict(rt._graphs._graphs)
                for layer, x, ids, w, out in _step(rt, rng, tokens=t, hot=7):
                    expected = reference.forward(layer, x, ids, w)
                    np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
                    outs.append(out)
                if graphs and step == 6:  # a prompt-size call (its own buffers): the graphs stay
                    assert rt._graphs._graphs == held
            s = rt.stats
            assert (s.stream_steps if stream else s.device_steps) == 12 and s.hit_picks > 0
            assert s.cpu_picks > 0 if stream else s.pcie_picks > 0
            if path == "stream shared":
                assert s.pcie_picks > 0
            if path == "device staged":
                assert rt._dstage is not None and rt._dstage.bytes_copied > 0
            if graphs:
                g = rt._graphs
                n = 2 * LAYERS * per_call  # keys: (layer, 1 or 3 tokens) per graph of a call, 6 calls each
                assert g is not None and len(g) == n
                assert (g.captures, g.replays, g.eager) == (n, 4 * n, 2 * n)
            runs[graphs] = (outs, s.hit_picks, s.pcie_picks, s.cpu_picks, rt.cache.slot_of.clone())
        finally:
            rt.close()
    (eager, *c_eager, slots_eager), (graphed, *c_graphed, slots_graphed) = runs[False], runs[True]
    assert len(eager) == len(graphed) and all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert c_eager == c_graphed and torch.equal(slots_eager, slots_graphed)


def test_layer_graphs_follow_the_hit_kernels_scratch(home: ExpertHome, reference: ReferenceExperts) -> None:
    """A hit kernel with scratch (``reserve``, ``scratch_version``) has it reserved for the largest decode call
    before a graph reads it; when it is reallocated all the same (a larger call elsewhere), the graphs go and are
    captured again: results still the reference's."""
    from vllm_dsv41.hits import make_hits
    from vllm_dsv41.tiered import HIT_CHUNK_TOKENS

    reserved: list[int] = []

    class Scratchy:
        def __init__(self, inner: object) -> None:
            self.inner, self.scratch_version = inner, 0

        def reserve(self, picks: int) -> None:
            reserved.append(picks)

        def forward(self, *a: object) -> None:
            self.inner.forward(*a)  # type: ignore[attr-defined]

    t = TieredConfig(split="pcie", hit_kernel="reference", replan_every=2, prefill=False, cpu_drive="host",
                     layer_graphs=True)  # fmt: skip
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, home, "cpu", rates=RATES, cache_bytes=5 * _slot_bytes(home), graph_factory=_RerunGraph,
                       hits_factory=lambda lx, dev: Scratchy(make_hits(lx, dev, backend="reference")))  # fmt: skip
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    rng = np.random.default_rng(4)
    try:
        _exact_steps(rt, rng, reference, 3, tokens=2)
        g = rt._graphs
        assert g is not None and len(g) == LAYERS and g.replays == LAYERS
        assert set(reserved) == {HIT_CHUNK_TOKENS * TOP_K}
        rt._hits[0].scratch_version += 1  # (as a reallocation would)
        _exact_steps(rt, rng, reference, 1, tokens=2)
        assert len(g) == 0 and g.replays == LAYERS  # dropped at layer 0's call, before anything replayed
        _exact_steps(rt, rng, reference, 2, tokens=2)
        assert len(g) == LAYERS and g.captures == 2 * LAYERS
    finally:
        rt.close()


def test_layer_graphs_are_off_on_a_cpu_device_without_an_injected_graph(home: ExpertHome) -> None:
    rt = _runtime(home, 5, "pcie", layer_graphs=True)
    try:
        _step(rt, np.random.default_rng(0), tokens=1)
        _step(rt, np.random.default_rng(1), tokens=1)
        assert rt._graphs is None and rt.stats.device_steps == 2
    finally:
        rt.close()


def test_device_path_counts_made_in_inference_mode_fold_outside_it(home: ExpertHome) -> None:
    """vLLM runs the model under ``torch.inference_mode``: the device path's counters are inference tensors, and
    reading the stats afterwards (outside it) must still fold them (a served run of the fidelity tool hit this)."""
    rt = _runtime(home, 5, "pcie")
    rng = np.random.default_rng(29)
    try:
        with torch.inference_mode():
            for _ in range(3):
                _step(rt, rng, tokens=2)
        s = rt.stats
        assert s.device_steps == 3 and s.hit_picks + s.pcie_picks == 3 * LAYERS * 2 * TOP_K
        assert rt.stats.hit_picks + rt.stats.pcie_picks == 3 * LAYERS * 2 * TOP_K  # folded once, not twice
    finally:
        rt.close()


class _StalledJob:
    """A CPU-tier job whose workers never got to run (as when the host is oversubscribed): it is not done by any
    deadline and reports every pick missing. The real tier's cancellation is tested in cpu-tier."""

    def __init__(self, n: int) -> None:
        self.n = n

    def wait(self, timeout: float | None = None) -> bool:
        return timeout is None  # never done by a deadline

    def missing(self) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64)

    def result(self) -> None:
        raise AssertionError("the runtime must not read the result of a job that missed its deadline")

    def cancel(self) -> None:
        pass

    elapsed_s = 0.0  # its workers never ran


class _StallingTier:
    """The real CPU tier, except that every ``stall``-th job stalls."""

    def __init__(self, tier: object, stall: int) -> None:
        self.tier, self.stall, self.jobs = tier, stall, 0

    def submit(self, layer: int, x: np.ndarray, picks: object, out: np.ndarray) -> object:
        self.jobs += 1
        if self.jobs % self.stall == 0:
            return _StalledJob(x.shape[0])
        return self.tier.submit(layer, x, picks, out=out)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tier, name)


def test_deadline_fallback_recomputes_on_the_gpu_and_counts(home: ExpertHome, reference: ReferenceExperts) -> None:
    # a deadline the real jobs always meet (a minute), so only the stalled ones miss it, whatever the load
    rt = _runtime(home, 0, "cpu", deadline_factor=1.0, deadline_floor_ms=60_000.0)
    rt._tier = _StallingTier(rt._tier, stall=3)  # type: ignore[assignment]
    rng = np.random.default_rng(9)
    try:
        for _ in range(4):
            for layer, x, ids, w, out in _step(rt, rng, tokens=32):
                expected = reference.forward(layer, x, ids, w)
                np.testing.assert_allclose(out, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        s = rt.stats
        # 8 jobs, every third stalled: 2 deadline misses, all their picks recomputed; nothing dropped (the outputs
        # above are complete)
        assert s.deadline_misses == 2 and s.fallback_picks == 2 * 32 * TOP_K
        assert s.cpu_picks == 4 * LAYERS * 32 * TOP_K
    finally:
        rt.close()


def test_row_views_are_kept_for_decode_sizes_only(home: ExpertHome, reference: ReferenceExperts) -> None:
    """The per-size views of the runtime's buffers are kept for decode-size calls; a prompt's are made afresh (one
    set kept per prompt length, and an arange per pick count, would grow without bound in a server)."""
    from vllm_dsv41.tiered import HIT_CHUNK_TOKENS

    rt = _runtime(home, 5, "cpu")
    rng = np.random.default_rng(29)
    try:
        for tokens in (HIT_CHUNK_TOKENS + 7, 1, HIT_CHUNK_TOKENS + 1, 3, 2):  # (the first sizes the buffers)
            _exact_steps(rt, rng, reference, 1, tokens=tokens)
        # decode-size calls have their own buffers, of HIT_CHUNK_TOKENS rows (never grown: graphs read them)
        dec, prompt = rt._buffers[(HIDDEN, TOP_K, True)], rt._buffers[(HIDDEN, TOP_K, False)]
        assert dec.rows == HIT_CHUNK_TOKENS and prompt.rows >= HIT_CHUNK_TOKENS + 7
        assert set(dec._rows) == {1, 2, 3} and not prompt._rows, (sorted(dec._rows), sorted(prompt._rows))
        for b in (dec, prompt):
            assert not b._picks or max(b._picks) <= HIT_CHUNK_TOKENS * TOP_K, sorted(b._picks)
        assert dec._picks
    finally:
        rt.close()


class _LateJob:
    """A real CPU-tier job that is never done by a deadline (as on a loaded machine) but is when waited for whole."""

    def __init__(self, job: object) -> None:
        self.job = job

    def wait(self, timeout: float | None = None) -> bool:
        return False if timeout is not None else self.job.wait(None)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.job, name)


def test_before_the_cache_exists_the_cpu_share_is_waited_for_whole(
    home: ExpertHome, reference: ReferenceExperts
) -> None:
    """Before the cache exists (vLLM's KV cache not yet bound) the GPU has no pointer table to recompute missed picks
    from: the CPU tier's share gets no deadline (CI, loaded: a deadline passed there and the fallback raised)."""
    rt = _runtime(home, 5, "auto", deadline_factor=1.0, deadline_floor_ms=0.001)
    rt._allowed = False
    tier = rt._tier

    class Late:
        def submit(self, layer: int, x: np.ndarray, picks: object, out: np.ndarray) -> object:
            return _LateJob(tier.submit(layer, x, picks, out=out))

        def __getattr__(self, name: str) -> object:
            return getattr(tier, name)

    rt._tier = Late()  # type: ignore[assignment]
    rng = np.random.default_rng(27)
    try:
        _exact_steps(rt, rng, reference, 2, tokens=3)
        assert rt.cache is None and rt.stats.deadline_misses == 0 and rt.stats.cpu_picks > 0
    finally:
        rt.close()


class _VirtualClock:
    """The chooser's clock in a test: ``mark`` replaces the runtime's ``_span_mark`` (host seconds on a CPU device)
    and advances ``tick`` per call, so the spans the chooser compares come from what the test charges, not from the
    machine's load (a CI box made the device path's real span slower than the split path's slowed one)."""

    def __init__(self, tick: float = 1e-3) -> None:
        self.now, self.tick = 0.0, tick

    def mark(self) -> float:
        self.now += self.tick
        return self.now


class _SlowJob:
    """A real CPU-tier job whose wait takes ``delay`` seconds longer (a CPU tier slower in service than alone); with
    a ``clock`` the delay is charged to it instead of slept."""

    def __init__(self, job: object, delay: float, clock: _VirtualClock | None = None) -> None:
        self.job, self.delay, self.clock = job, delay, clock

    def wait(self, timeout: float | None = None) -> bool:
        if self.clock is None:
            time.sleep(self.delay)
        else:
            self.clock.now += self.delay
        return self.job.wait(timeout)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.job, name)


class _SlowTier:
    def __init__(self, tier: object, delay: float, clock: _VirtualClock | None = None) -> None:
        self.tier, self.delay, self.clock = tier, delay, clock

    def submit(self, layer: int, x: np.ndarray, picks: object, out: np.ndarray) -> object:
        job = self.tier.submit(layer, x, picks, out=out)  # type: ignore[attr-defined]
        return _SlowJob(job, self.delay, self.clock)

    def __getattr__(self, name: str) -> object:
        return getattr(self.tier, name)


@pytest.mark.parametrize("feedback", [0.0, 0.5])
def test_split_feedback_moves_misses_off_a_cpu_tier_slower_than_its_startup_rate(
    home: ExpertHome, reference: ReferenceExperts, feedback: float
) -> None:
    # startup rates that make the CPU tier look free: the split sends every miss there; in service each of its
    # jobs takes 20 ms more. With feedback the measured / predicted average grows and the misses move to PCIe;
    # without it they stay on the CPU tier. The results are exact either way.
    rates = Rates(cpu_bps=1e12, pcie_bps=1e9, source="test")
    rt = _runtime(home, 0, "auto", rates=rates, split_feedback=feedback, deadline_factor=0.0, split_probe=0)
    rt._tier = _SlowTier(rt._tier, delay=0.02)  # type: ignore[assignment]
    # on a CPU "device" the PCIe share's time is the reference kernel's Python, whose speed against the 20 ms above
    # depends on the machine's load (a loaded box grew its average 200x and sent the misses back): only the CPU
    # tier's samples reach the feedback here (how a PCIe sample scales the split: the split_rates test below)
    feedback_of = rt._feedback
    rt._feedback = lambda path, measured, predicted: (  # type: ignore[method-assign]
        feedback_of(path, measured, predicted) if path == "cpu" else None
    )
    rng = np.random.default_rng(21)
    cpu_per_step = []
    try:
        for _ in range(6):
            before = rt.stats.cpu_picks
            _exact_steps(rt, rng, reference, 1, tokens=4)
            cpu_per_step.append(rt.stats.cpu_picks - before)
        all_picks = LAYERS * 4 * TOP_K
        assert cpu_per_step[0] >= all_picks // LAYERS  # the first layer call trusts the startup rates
        if feedback:
            # most misses moved to PCIe (the balance may still give the CPU tier one expert in a step)
            assert rt.stats.cpu_scale > 100 and max(cpu_per_step[-3:]) <= all_picks // 4, (
                cpu_per_step,
                rt.stats.cpu_scale,
            )
            assert rt.split_rates().cpu_bps == pytest.approx(rates.cpu_bps / rt.stats.cpu_scale, rel=0.03)
            assert "split feedback: CPU tier x" in rt.stats.describe()
        else:
            assert cpu_per_step == [all_picks] * 6 and rt.stats.cpu_scale == 1.0
            assert rt.split_rates() == rates
    finally:
        rt.close()


def test_split_rates_scale_each_path_rate_and_fixed_cost(home: ExpertHome) -> None:
    rates = Rates(cpu_bps=8e9, pcie_bps=20e9, gpu_bps=400e9, source="test", cpu_tokens=((2, 6e9), (8, 2e9)),
                  cpu_fixed_s=1e-3, pcie_fixed_s=2e-4)  # fmt: skip
    rt = _runtime(home, 0, "auto", rates=rates, split_feedback=0.5)
    try:
        assert rt.split_rates() is rt.split_rates()  # kept while the averages do not move
        rt._feedback("cpu", 4e-3, 1e-3)  # measured 4x the prediction: the geometric average 1^0.5 * 4^0.5 = 2
        rt._feedback("pcie", 0.25e-3, 1e-3)  # 0.25x: 0.5
        r = rt.split_rates()
        assert (r.cpu_bps, r.cpu_fixed_s) == pytest.approx((4e9, 2e-3))
        assert [m for m, _ in r.cpu_tokens] == [2, 8] and [v for _, v in r.cpu_tokens] == pytest.approx([3e9, 1e9])
        assert (r.pcie_bps, r.pcie_fixed_s, r.gpu_bps) == pytest.approx((40e9, 1e-4, 400e9))
        assert (rt.stats.cpu_scale, rt.stats.pcie_scale) == pytest.approx((2.0, 0.5))
        rt._feedback("cpu", 1.0, 0.0)  # nothing predicted: nothing learned
        rt._feedback("cpu", float("nan"), 1e-3)
        assert rt.stats.cpu_scale == pytest.approx(2.0)
    finally:
        rt.close()


def test_steps_replans_and_the_routing_trace(home: ExpertHome, tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    from expert_cache import load_trace

    def metric(name: str, **labels: str) -> float:  # the plugin's dsv41_* series (in-process registry here)
        return REGISTRY.get_sample_value(name, labels) or 0.0

    path = tmp_path / "routing.npz"
    rt = _runtime(home, 4, "cpu", trace_path=str(path))
    rng = np.random.default_rng(2)
    steps = [(1, 2), (2, 2), (1, 2), (3, 2), (1, 2), (1, 2)]  # (tokens, hot experts)
    fills0, hits0 = metric("dsv41_expert_cache_fills_total"), metric("dsv41_expert_picks_total", tier="gpu_cache")
    lookups0 = metric("dsv41_expert_cache_lookups_total", result="hit")
    try:
        for tokens, hot in steps:
            _step(rt, rng, tokens, hot)
        assert rt.stats.steps == len(steps)
        resident = set(rt.cache.resident())
        assert resident and all(k % EXPERTS < 2 for k in resident)  # only the two hot experts of each layer
        assert metric("dsv41_expert_cache_fills_total") - fills0 == rt.cache.fills_issued >= len(resident)
        assert metric("dsv41_expert_picks_total", tier="gpu_cache") - hits0 == rt.stats.hit_picks > 0
        assert metric("dsv41_expert_cache_lookups_total", result="hit") - lookups0 == rt.stats.hit_picks
    finally:
        rt.close()
    trace = load_trace(path)
    assert trace.num_steps == len(steps)
    assert trace.num_layers == LAYERS and trace.num_experts == EXPERTS and trace.top_k == TOP_K


def test_rows_routing_an_expert_twice_stay_out_of_the_trace(home: ExpertHome, reference: ReferenceExperts,
                                                            tmp_path: Path) -> None:  # fmt: skip
    """vLLM's warm-up forwards can route a row to one expert twice (run 3 on the H200: [0, 0]; a trace refuses
    such rows): the row is computed as routed (twice the expert), left out of the trace and counted, and the trace
    of the run is saved (it was lost at close)."""
    path = tmp_path / "routing.npz"
    rt = _runtime(home, 4, "auto", trace_path=str(path))
    rng = np.random.default_rng(3)
    try:
        _step(rt, rng, 2)
        for layer in range(LAYERS):  # a step of 3 tokens: row 1 routes expert 0 twice in every layer
            x = rng.standard_normal((3, HIDDEN)).astype(np.float32)
            ids, w = _routing(rng, 3)
            ids[1] = 0
            out = torch.full((3, HIDDEN), float("nan"))
            rt.forward_into(layer, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
            expected = reference.forward(layer, x, ids, w)
            np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        _step(rt, rng, 1)
        assert rt.stats.trace_rows_dropped == 1
    finally:
        rt.close()
    from expert_cache import load_trace

    trace = load_trace(path)
    assert trace.num_steps == 3
    assert trace.rows_per_step.tolist() == [2, 2, 1] and trace.tokens_per_step.tolist() == [2, 3, 1]


def test_refuses_what_it_cannot_do(home: ExpertHome) -> None:
    rt = _runtime(home, 2)
    try:
        with pytest.raises(ValueError, match=r"\[T, 256\]"):
            rt.forward_into(0, torch.zeros(2, 128), torch.zeros(2, TOP_K, dtype=torch.int64), torch.zeros(2, TOP_K),
                            torch.zeros(2, 128))  # fmt: skip
        with pytest.raises(KeyError, match="layer 5"):
            rt.forward_into(5, torch.zeros(1, HIDDEN), torch.zeros(1, TOP_K, dtype=torch.int64), torch.zeros(1, TOP_K),
                            torch.zeros(1, HIDDEN))  # fmt: skip
        _step(rt, np.random.default_rng(0), 1)
        with pytest.raises(RuntimeError, match="before the first forward"):
            rt.add_layer(home.layer(0), swiglu_limit=None)
    finally:
        rt.close()
    cfg = Dsv41PluginConfig(runtime="tiered", tiered=TieredConfig(hit_kernel="reference", prefill=False))
    auto = TieredRuntime(cfg, home, "cpu", rates=RATES)
    try:
        for lx in home.layers():
            auto.add_layer(lx, swiglu_limit=None)
        with pytest.raises(ValueError, match="cache size must be given"):
            _step(auto, np.random.default_rng(0), 1)
    finally:
        auto.close()


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.fixture(scope="module")
def registered_home(demo_pack: Path) -> Iterator[ExpertHome]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with ExpertHome(demo_pack, register=True) as h:
        yield h


def _gpu_runtime(home: ExpertHome, slots: int, split: str, kernel: str, **tiered: object) -> TieredRuntime:
    tiered.setdefault("prefill", False)
    tiered.setdefault("cpu_drive", "host")  # the stream-driven path: its own GPU test
    t = TieredConfig(split=split, hit_kernel=kernel, replan_every=2, **tiered)  # type: ignore[arg-type]
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact"), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, home, "cuda", rates=RATES, cache_bytes=max(slots * _slot_bytes(home), 1))
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    rt.allow_cache()  # (the plugin's call once vLLM's KV cache exists)
    return rt


def _gpu_steps(rt: TieredRuntime, rng: np.random.Generator, reference: ReferenceExperts,
               tol: float | Callable[[int], float], tokens: tuple[int, ...] = (1, 3, 17, 2), hot: int = 5,
               steps: int = 8) -> list[np.ndarray]:  # fmt: skip
    """``steps`` model steps on CUDA (token counts cycling through ``tokens``), each layer's output written into a
    buffer two rows longer (left NaN: nothing written past the call's rows) and checked against the float64
    reference within ``tol`` (or ``tol(layer)``) of its largest value; returns the outputs."""
    dev = torch.device("cuda")
    outs = []
    for step in range(steps):
        t = tokens[step % len(tokens)]
        for layer in range(LAYERS):
            x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
            ids, w = _routing(rng, t, hot=hot)
            out = torch.full((t + 2, HIDDEN), float("nan"), device=dev)
            rt.forward_into(layer, torch.from_numpy(x).to(dev), torch.from_numpy(ids).to(dev),
                            torch.from_numpy(w).to(dev), out)  # fmt: skip
            got = out.cpu()
            assert torch.isnan(got[t:]).all()
            expected = reference.forward(layer, x, ids, w)
            atol = (tol(layer) if callable(tol) else tol) * np.abs(expected).max()
            np.testing.assert_allclose(got[:t].numpy(), expected, rtol=0, atol=atol)
            outs.append(got[:t].numpy())
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "exllamav3"])
@pytest.mark.parametrize("slots", [0, 5, LAYERS * EXPERTS])
@pytest.mark.parametrize("split", ["cpu", "pcie", "auto"])
def test_on_the_gpu_matches_the_reference(registered_home: ExpertHome, reference: ReferenceExperts, kernel: str,
                                          slots: int, split: str) -> None:  # fmt: skip
    """The composition on CUDA: hits from VRAM slots, PCIe reads of the registered home, the CPU tier through
    pinned buffers, fills on the side stream; against the float64 reference (exllamav3's kernel takes fp16
    activations: a looser bound)."""
    if kernel == "exllamav3":
        from vllm_dsv41.dense import exllamav3_available

        if not exllamav3_available():
            pytest.fail("exllamav3's CUDA extension does not import (stage it: scripts/gpu_stage_exl3.sh)")
    tol = 3e-3 if kernel == "exllamav3" else 3e-5
    rt = _gpu_runtime(registered_home, slots, split, kernel)
    rng = np.random.default_rng(slots * 10 + len(split))
    try:
        _gpu_steps(rt, rng, reference, tol)
        s = rt.stats
        assert rt.cache is not None and rt.cache.num_slots == slots
        assert (s.hit_picks > 0) == (slots > 0)
        if split == "pcie":
            assert s.cpu_picks == 0 and (s.pcie_picks > 0 or slots == LAYERS * EXPERTS)
        if split == "cpu":
            assert s.pcie_picks == 0
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [0, 5])
def test_on_the_gpu_the_stream_driven_cpu_tier_matches_the_host_driven(registered_home: ExpertHome,
                                                                        reference: ReferenceExperts,
                                                                        slots: int) -> None:  # fmt: skip
    """cpu_drive "stream" on CUDA: the CPU tier's share submitted and waited for by host functions on the compute
    stream (cuLaunchHostFunc), no host sync at decode sizes; bit for bit the host-driven split path's outputs,
    both against the float64 reference; then a job that stops early leaves its picks to the hit kernel."""
    runs = {}
    for drive in ("stream", "host"):
        rt = _gpu_runtime(registered_home, slots, "cpu", "triton", cpu_drive=drive, deadline_factor=0.0)
        rng = np.random.default_rng(17 + slots)
        try:
            outs = _gpu_steps(rt, rng, reference, 3e-5)
            s, d = rt.stats, rt.stats_decode
            if drive == "stream":
                assert s.stream_steps == 6 and d.wait_seconds == 0 and d.cpu_run_seconds > 0
            runs[drive] = (outs, s.hit_picks, s.cpu_picks)
        finally:
            rt.close()
    (a, *ca), (b, *cb) = runs["stream"], runs["host"]
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    assert ca == cb
    rt = _gpu_runtime(registered_home, slots, "cpu", "triton", cpu_drive="stream", deadline_factor=1.0,
                      deadline_floor_ms=60_000.0)  # fmt: skip
    real = rt._tier.stream_call
    rt._tier.stream_call = lambda *a, **k: real(*a, **k, _test_cancel_after_chunks=1)  # type: ignore[method-assign]
    try:
        _gpu_steps(rt, np.random.default_rng(3), reference, 3e-5, tokens=(4,), hot=6, steps=3)
        assert rt.stats.fallback_picks > 0
    finally:
        rt.close()


@pytest.mark.gpu
def test_on_the_gpu_the_stream_driven_split_shares_the_misses(registered_home: ExpertHome,
                                                              reference: ReferenceExperts) -> None:  # fmt: skip
    """stream_share on CUDA (split "auto", the split side only): the share kernel gives part of each
    call's misses to the hit kernel reading the host home, the CPU tier computes the rest; exact against the
    float64 reference, every pick counted once."""
    rt = _gpu_runtime(registered_home, 5, "auto", "triton", cpu_drive="stream", stream_share=True, split_probe=0,
                      deadline_factor=0.0)  # fmt: skip
    rng = np.random.default_rng(29)
    tokens = (1, 4, 16, 2)
    total = 2 * sum(tokens) * LAYERS * TOP_K
    try:
        _gpu_steps(rt, rng, reference, 3e-5, tokens=tokens, hot=EXPERTS)
        s = rt.stats
        assert s.stream_steps == 8 and s.device_steps == 0
        assert s.hit_picks + s.cpu_picks + s.pcie_picks == total and s.cpu_picks > 0 and s.pcie_picks > 0, s.describe()
    finally:
        rt.close()


@pytest.mark.gpu
def test_on_the_gpu_auto_takes_a_kernel_reading_the_home_in_place(registered_home: ExpertHome,
                                                                   reference: ReferenceExperts) -> None:  # fmt: skip
    """``hit_kernel`` "auto" with exllamav3 present: on a home not 16-byte aligned the layers get ours and read the
    misses in place (no transient slots, every decode step on the device path); on an aligned one exllamav3 stays.
    Exact against the float64 reference either way."""
    from vllm_dsv41.dense import exllamav3_available

    if not exllamav3_available():
        pytest.fail("exllamav3's CUDA extension does not import (stage it: scripts/gpu_stage_exl3.sh)")
    rt = _gpu_runtime(registered_home, 5, "pcie", "auto")
    try:
        _gpu_steps(rt, np.random.default_rng(21), reference,
                   lambda layer: 3e-3 if rt._hits[layer].name == "exllamav3" else 3e-5, tokens=(2,), hot=6,
                   steps=4)  # fmt: skip
        aligned = tiered_mod._home_alignment(registered_home.cache_home(list(registered_home.layer_ids)).rows)
        names = {k.name for k in rt._hits.values()}
        assert names == ({"exllamav3"} if aligned % 16 == 0 else {"triton"}), (aligned, names)
        assert rt._stager is None and rt.stats.device_steps == 4
    finally:
        rt.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "exllamav3"])
@pytest.mark.parametrize("stage_slots", [1, 4])
def test_on_the_gpu_the_staged_read_matches_the_reference(registered_home: ExpertHome, reference: ReferenceExperts,
                                                          kernel: str, stage_slots: int) -> None:  # fmt: skip
    """pcie_read staged on CUDA: the misses copied by the copy engine into transient VRAM slots (on its own stream,
    in rounds), read by the hit kernel from there; against the float64 reference."""
    tol = 3e-3 if kernel == "exllamav3" else 3e-5
    rt = _gpu_runtime(registered_home, 5, "pcie", kernel, pcie_read="staged", pcie_stage_slots=stage_slots)
    try:
        _gpu_steps(rt, np.random.default_rng(stage_slots), reference, tol, tokens=(1, 3, 17), hot=6, steps=6)
        assert rt._stager is not None and rt._stager.bytes_copied > 0 and rt.stats.pcie_picks > 0
        # the 1- and 3-token steps on the device path, their misses staged by the GPU itself (dev_stage's kernels)
        assert rt._dstage is not None and rt._dstage.use_triton and rt.stats.device_steps == 4
    finally:
        rt.close()


def _first_forward(rt: TieredRuntime, dev: torch.device) -> None:
    """Allow the cache and run one token through layer 0 (the cache is created and sized in it)."""
    rt.allow_cache()
    x = torch.zeros((1, HIDDEN), device=dev)
    ids = torch.zeros((1, TOP_K), dtype=torch.int64, device=dev)
    ids[0, 1] = 1
    rt.forward_into(0, x, ids, torch.full((1, TOP_K), 0.5, device=dev), torch.empty((1, HIDDEN), device=dev))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "exllamav3"])
@pytest.mark.parametrize("read", ["mapped", "staged"])
def test_on_the_gpu_layer_graphs_replay_the_device_path(registered_home: ExpertHome, reference: ReferenceExperts,
                                                         kernel: str, read: str) -> None:  # fmt: skip
    """layer_graphs on CUDA: the device path's layer calls captured as CUDA graphs and replayed, with new routings
    every step and the cache replanning between them (its tables mutated in place); every output equal bit for bit
    to the eager device path's, and to the float64 reference within the kernel's bound."""
    if kernel == "exllamav3":
        from vllm_dsv41.dense import exllamav3_available

        if not exllamav3_available():
            pytest.fail("exllamav3's CUDA extension does not import (stage it: scripts/gpu_stage_exl3.sh)")
    if kernel == "exllamav3" and read == "mapped":
        kernel = "triton"  # (exllamav3 reads the home in place only 16-byte aligned: the staged case covers it)
    tol = 3e-3 if kernel == "exllamav3" else 3e-5
    tokens = (1, 3, 1, 3, 2)
    runs = {}
    for graphs in (False, True):
        extra = {"pcie_read": "staged", "pcie_stage_slots": 3} if read == "staged" else {"pcie_read": "mapped"}
        rt = _gpu_runtime(registered_home, 5, "pcie", kernel, layer_graphs=graphs, **extra)
        try:
            outs = _gpu_steps(rt, np.random.default_rng(7), reference, tol, tokens=tokens, hot=7, steps=15)
            s = rt.stats
            assert s.device_steps == 15 and s.pcie_picks > 0
            if graphs:
                g = rt._graphs
                assert g is not None and g.captures == 3 * LAYERS and g.replays > 0, g.captures
            runs[graphs] = (outs, s.hit_picks, s.pcie_picks)
        finally:
            rt.close()
    (eager, *c_eager), (graphed, *c_graphed) = runs[False], runs[True]
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True)) and c_eager == c_graphed


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["cpu", "auto"])
def test_on_the_gpu_layer_graphs_replay_the_stream_split(registered_home: ExpertHome, reference: ReferenceExperts,
                                                         split: str) -> None:  # fmt: skip
    """layer_graphs on the stream path on CUDA: begin and finish each a CUDA graph whose host functions submit and
    wait for the CPU tier; bit for bit the eager stream path's outputs and counters ("auto": with its PCIe share);
    then, replayed, a job that stops early still leaves its picks to the hit kernel inside the finish graph."""
    tokens = (1, 3, 1, 3, 2)
    runs = {}
    for graphs in (False, True):
        rt = _gpu_runtime(registered_home, 5, split, "triton", cpu_drive="stream", layer_graphs=graphs,
                          deadline_factor=0.0, stream_share=split == "auto", split_probe=0)  # fmt: skip
        try:
            outs = _gpu_steps(rt, np.random.default_rng(9), reference, 3e-5, tokens=tokens, hot=7, steps=15)
            s = rt.stats
            assert s.stream_steps == 15 and s.cpu_picks > 0 and (s.pcie_picks > 0) == (split == "auto")
            if graphs:
                g = rt._graphs
                assert g is not None and g.captures == 2 * 3 * LAYERS and g.replays > 0, g.captures
            runs[graphs] = (outs, s.hit_picks, s.cpu_picks, s.pcie_picks)
        finally:
            rt.close()
    (eager, *c_eager), (graphed, *c_graphed) = runs[False], runs[True]
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True)) and c_eager == c_graphed
    rt = _gpu_runtime(registered_home, 5, split, "triton", cpu_drive="stream", layer_graphs=True, deadline_factor=1.0,
                      deadline_floor_ms=60_000.0, split_probe=0)  # fmt: skip
    real = rt._tier.stream_call
    rt._tier.stream_call = lambda *a, **k: real(*a, **k, _test_cancel_after_chunks=1)  # type: ignore[method-assign]
    try:
        _gpu_steps(rt, np.random.default_rng(3), reference, 3e-5, tokens=(4,), hot=6, steps=5)
        assert rt._graphs is not None and rt._graphs.replays > 0 and rt.stats.fallback_picks > 0
    finally:
        rt.close()


@pytest.mark.gpu
def test_on_the_gpu_layer_graphs_read_the_stream_share_rebuilt_in_place(
    registered_home: ExpertHome, reference: ReferenceExperts
) -> None:
    """The split feedback's quota rebuild on CUDA: the stream split's graphs, captured at the startup table, replay
    the table overwritten in place once the CPU tier's jobs (their counters scaled: 8x their prediction) are
    folded: the GPU's PCIe reads take a larger share of the misses, no new capture, every output exact against the
    float64 reference."""
    rt = _gpu_runtime(registered_home, 5, "auto", "triton", cpu_drive="stream", layer_graphs=True, stream_share=True,
                      deadline_factor=0.0, split_probe=0, split_feedback=0.5)  # fmt: skip
    rt._tier = _ScaledStreamTier(rt._tier, 1.0)  # type: ignore[assignment]
    try:
        _gpu_steps(rt, np.random.default_rng(31), reference, 3e-5, tokens=(4,), hot=8, steps=6)
        eb = rt._expert_bytes[0]
        dev, _, q0, _ = rt._stream_quota[(eb, TOP_K)]
        assert rt.stats.cpu_scale == 1.0 and rt._stream_quota[(eb, TOP_K)][2] is q0  # a fold at 1x: no rebuild
        for call in rt._stream_calls.values():
            call.set_factor(8.0)
        _gpu_steps(rt, np.random.default_rng(32), reference, 3e-5, tokens=(4,), hot=8, steps=2)
        s0 = dataclasses.replace(rt.stats)  # the fold: the CPU tier's average to ~8, the table built again
        assert s0.cpu_scale > 7
        g = rt._graphs
        assert g is not None and g.replays > 0
        captures, replays = g.captures, g.replays
        dev1, _, q1, _ = rt._stream_quota[(eb, TOP_K)]
        assert dev1 is dev and (q1 >= q0).all() and q1[4].sum() > q0[4].sum()
        _gpu_steps(rt, np.random.default_rng(33), reference, 3e-5, tokens=(4,), hot=8, steps=6)
        assert np.array_equal(dev.cpu().numpy(), q1) and g.captures == captures and g.replays > replays
        s1 = rt.stats
        pcie = (s0.pcie_picks, s1.pcie_picks - s0.pcie_picks)
        cpu = (s0.cpu_picks, s1.cpu_picks - s0.cpu_picks)
        assert pcie[1] / max(pcie[1] + cpu[1], 1) > pcie[0] / max(pcie[0] + cpu[0], 1), (pcie, cpu)
    finally:
        rt.close()


@pytest.mark.gpu
def test_on_the_gpu_layer_graphs_run_ahead_of_the_host(registered_home: ExpertHome, reference: ReferenceExperts,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """layer_graphs with nothing syncing between the layers (the host queues every step ahead, as in serving):
    split "auto" on both no-sync paths (the device path, the stream-driven split with its PCIe share), the routing
    trace on; every output kept on the device and read at the end: bit for bit the eager run's, against the float64
    reference, and the same trace. The chooser follows a fixed schedule and the split's rates do not follow the
    measured times (split_feedback 0): the real chooser keeps whichever path timed faster, so an eager and a graphed
    run would take different paths (and round differently) where their times differ (H200 run 11: they did)."""
    from expert_cache import load_trace
    from vllm_dsv41.split import PathChooser

    class ScriptedChooser(PathChooser):
        def __init__(self) -> None:
            super().__init__(probe=1)
            self.calls = 0

        def choose(self, t: int) -> str:  # 3 steps (one of each size) on the device path, 3 split, ...
            self.calls += 1
            return ("device", "split")[((self.calls - 1) // 3) % 2]

    dev = torch.device("cuda")
    runs = {}
    for graphs in (False, True):
        path = tmp_path / f"trace_{graphs}.npz"
        rt = _gpu_runtime(registered_home, 5, "auto", "triton", cpu_drive="stream", layer_graphs=graphs,
                          deadline_factor=0.0, stream_share=True, split_probe=2, split_feedback=0.0,
                          trace_path=str(path))  # fmt: skip
        assert rt._chooser is not None
        rt._chooser = ScriptedChooser()
        rng = np.random.default_rng(31)
        given, outs = [], []
        try:
            for step in range(24):
                t = (1, 3, 2)[step % 3]
                for layer in range(LAYERS):
                    x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
                    ids, w = _routing(rng, t, hot=7)
                    out = torch.empty((t, HIDDEN), device=dev)
                    # (inputs from pinned memory: a pageable copy would wait for the stream)
                    xd, idd, wd = (torch.from_numpy(a).pin_memory().to(dev, non_blocking=True) for a in (x, ids, w))
                    rt.forward_into(layer, xd, idd, wd, out)
                    given.append((layer, x, ids, w))
                    outs.append(out)
            s = rt.stats
            assert s.device_steps == 12 and s.stream_steps == 12
            if graphs:
                assert rt._graphs is not None and rt._graphs.replays > 0
        finally:
            rt.close()
        got = [o.cpu().numpy() for o in outs]
        for (layer, x, ids, w), o in zip(given, got, strict=True):
            expected = reference.forward(layer, x, ids, w)
            np.testing.assert_allclose(o, expected, rtol=0, atol=3e-5 * np.abs(expected).max())
        runs[graphs] = (got, load_trace(path).ids)
    (eager, trace_eager), (graphed, trace_graphed) = runs[False], runs[True]
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True))
    assert np.array_equal(trace_eager, trace_graphed)


@pytest.mark.gpu
def test_on_the_gpu_the_automatic_cache_stays_inside_the_device_budget(registered_home: ExpertHome) -> None:
    """cache_gib 0: the cache takes what is left of the given budget (vLLM's share of the card) after what
    PyTorch has reserved, minus the margin; not the card's free memory."""
    dev = torch.device("cuda", torch.cuda.current_device())
    stride = _slot_bytes(registered_home)
    t = TieredConfig(hit_kernel="triton", cache_gib=0.0, cache_margin_gib=0.0, prefill=False)
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2), runtime="tiered", tiered=t)
    keep = torch.empty(1 << 20, dtype=torch.uint8, device=dev)  # something reserved
    rt = TieredRuntime(cfg, registered_home, dev, rates=RATES, device_budget_bytes=1)
    try:
        for lx in registered_home.layers():
            rt.add_layer(lx, swiglu_limit=None)  # (the hit kernels may reserve memory: the budget is set after)
        rt._device_budget = torch.cuda.memory_reserved(dev) + 5 * stride + stride // 2
        _ = keep
        _first_forward(rt, dev)
        assert rt.cache is not None and rt.cache.num_slots == 5
    finally:
        rt.close()


@pytest.mark.gpu
def test_on_the_gpu_the_automatic_cache_leaves_vllm_its_unheld_share(registered_home: ExpertHome) -> None:
    """The part of vLLM's share (gpu_memory_utilization x total) PyTorch does not hold when the cache is sized
    (activations of larger forwards, the sampler's) stays out of the cache: free memory minus that."""
    dev = torch.device("cuda", torch.cuda.current_device())
    stride = _slot_bytes(registered_home)
    t = TieredConfig(hit_kernel="triton", cache_gib=0.0, cache_margin_gib=0.0, prefill=False)
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=2), runtime="tiered", tiered=t)
    rt = TieredRuntime(cfg, registered_home, dev, rates=RATES, vllm_share_bytes=1)
    try:
        for lx in registered_home.layers():
            rt.add_layer(lx, swiglu_limit=None)
        # vLLM's share: what is reserved now plus an unheld part that leaves room for 7.5 slots of the free memory
        rt._vllm_share = torch.cuda.memory_reserved(dev) + torch.cuda.mem_get_info(dev)[0] - 7 * stride - stride // 2
        _first_forward(rt, dev)
        assert rt.cache is not None and rt.cache.num_slots == 7
    finally:
        rt.close()
