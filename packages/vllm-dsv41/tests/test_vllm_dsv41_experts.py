"""The expert runtimes behind the ``dsv41::routed_experts_out`` op, on views of the pack's host home, against the
float64 numpy reference; the op's out-buffer contract."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cpu_tier import CpuTierConfig, exl3
from vllm_dsv41 import Dsv41PluginConfig
from vllm_dsv41.experts import (
    AllInVramRuntime,
    CpuExpertRuntime,
    NoExpertsRuntime,
    choose_dequantize,
    free_device_bytes,
    get_runtime,
    make_runtime,
    register_runtime,
    replace_runtime,
    routed_experts,
    unregister_runtime,
)
from vllm_dsv41.home import ExpertHome, LayerExperts
from vllm_dsv41.reference import ReferenceExperts

LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 8, 2, 256


@pytest.fixture(scope="module", params=["cpu", "all-in-vram", "all-in-vram-f64", "all-in-vram:per-call",
                                         "all-in-vram-f64:per-call"])  # fmt: skip
def handle(request: pytest.FixtureRequest, home: ExpertHome) -> Iterator[int]:
    runtime: CpuExpertRuntime | AllInVramRuntime
    name, _, dequantize = request.param.partition(":")
    if name == "cpu":
        runtime = CpuExpertRuntime(Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision="exact")))
    elif name == "all-in-vram-f64":
        runtime = AllInVramRuntime("cpu", torch.float64, dequantize=dequantize or "auto")  # type: ignore[arg-type]
        assert runtime.name == "all-in-vram-f64" + (f"-{dequantize}" if dequantize else "")
    else:
        runtime = AllInVramRuntime("cpu", dequantize=dequantize or "auto")  # type: ignore[arg-type]
        assert runtime.name == "all-in-vram" + (f"-{dequantize}" if dequantize else "")
    for lx in home.layers():
        runtime.add_layer(lx, swiglu_limit=None)
    if dequantize:  # per call: the home's views kept (read-only mappings), nothing dequantized held
        assert isinstance(runtime, AllInVramRuntime) and runtime.nbytes == 0
        assert set(runtime.modes.values()) == {"per-call"}
    h = register_runtime(runtime)
    yield h
    unregister_runtime(h)


def _routing(rng: np.random.Generator, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(EXPERTS, size=TOP_K, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.uniform(0.1, 1.0, size=(tokens, TOP_K))
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def test_home_layers_are_views_of_the_pack(home: ExpertHome) -> None:
    assert home.layer_ids == tuple(range(LAYERS))
    lx = home.layer(1)
    assert (lx.num_experts, lx.hidden) == (EXPERTS, HIDDEN)
    t = lx.down[3].trellis
    assert not t.flags.owndata  # a view of the mapping, not a copy
    name = "model.layers.1.mlp.experts.3.down_proj.trellis"
    assert home.address(name) == t.ctypes.data
    with pytest.raises(KeyError, match="layer 7"):
        home.layer(7)


@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("layer", range(LAYERS))
def test_op_matches_reference(handle: int, reference: ReferenceExperts, tokens: int, layer: int) -> None:
    rng = np.random.default_rng(100 * tokens + layer)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    ids, w = _routing(rng, tokens)
    out = routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), handle, layer)
    assert out.dtype == torch.float32 and out.shape == (tokens, HIDDEN)
    expected = reference.forward(layer, x, ids, w)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_padding_rows_are_no_picks(handle: int, reference: ReferenceExperts) -> None:
    """vLLM routes the rows a CUDA graph pads a batch with to expert -1 (VLLM_MOE_SKIP_PADDING): no pick, a zero
    output row, the other rows as without them (the tier checks its picks' ids and would refuse -1)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    ids, w = _routing(rng, 6)
    ids[4:] = -1
    ids[1, 1] = -1
    out = routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), handle, 0)
    assert (out[4:] == 0).all()
    expected = reference.forward(0, x, ids, w)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing vLLM's forward context trips torch's own
def test_profile_run(handle: int, reference: ReferenceExperts) -> None:
    """vLLM's dummy forwards (no attention metadata) leave attention outputs unwritten, so their router weights may
    be NaN: the CPU runtime answers them with zeros and counts them, without host work; the oracle computes what
    it is given. A real batch (metadata present) or a call outside vLLM is computed, and the CPU tier refuses
    non-finite weights there."""
    from vllm.forward_context import ForwardContext, override_forward_context

    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    ids, w = _routing(rng, 4)
    bad = w.copy()
    bad[1, 0], bad[2, 1] = np.nan, np.inf
    args = (torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(bad), handle, 0)
    rt = get_runtime(handle)
    profile = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})  # type: ignore[arg-type]
    with override_forward_context(profile):
        if rt.name == "cpu":
            before = rt.profile_calls  # type: ignore[attr-defined]
            assert (routed_experts(*args) == 0).all()
            assert rt.profile_calls == before + 1  # type: ignore[attr-defined]
        else:
            assert torch.isfinite(routed_experts(*args)[[0, 3]]).all()
    real = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    for ctx in (real, None):
        with override_forward_context(ctx):
            if rt.name == "cpu":
                with pytest.raises(ValueError, match="picks.weights: must be finite"):
                    routed_experts(*args)
            out = routed_experts(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), handle, 0)
            expected = reference.forward(0, x, ids, w)
            np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_out_buffer_contract(handle: int, reference: ReferenceExperts) -> None:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((5, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
    ids, w = _routing(rng, 5)
    out = torch.full((9, HIDDEN), float("nan"), dtype=torch.bfloat16)  # rows past T must stay untouched
    torch.ops.dsv41.routed_experts_out(x, torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(w), out, handle, 1)
    assert torch.isfinite(out[:5].float()).all() and torch.isnan(out[5:].float()).all()
    expected = reference.forward(1, x.float().numpy(), ids, w)
    np.testing.assert_allclose(out[:5].float().numpy(), expected, rtol=0, atol=2e-2 * np.abs(expected).max())
    empty = torch.zeros(0, HIDDEN)
    torch.ops.dsv41.routed_experts_out(empty, torch.zeros(0, TOP_K, dtype=torch.int64), torch.zeros(0, TOP_K),
                                       torch.zeros(1, HIDDEN), handle, 0)  # fmt: skip
    with pytest.raises(ValueError, match=r"\[T, 256\]"):
        routed_experts(torch.zeros(2, 128), torch.zeros(2, TOP_K, dtype=torch.int64), torch.zeros(2, TOP_K), handle, 0)
    with pytest.raises(ValueError, match="out must be"):
        torch.ops.dsv41.routed_experts_out(torch.zeros(3, HIDDEN), torch.zeros(3, TOP_K, dtype=torch.int64),
                                           torch.zeros(3, TOP_K), torch.zeros(2, HIDDEN), handle, 0)  # fmt: skip
    with pytest.raises(ValueError, match="out must be"):
        half = torch.zeros(3, HIDDEN, dtype=torch.float16)
        torch.ops.dsv41.routed_experts_out(torch.zeros(3, HIDDEN), torch.zeros(3, TOP_K, dtype=torch.int64),
                                           torch.zeros(3, TOP_K), half, handle, 0)  # fmt: skip
    with pytest.raises(KeyError, match="layer 5"):
        ids1 = torch.zeros(1, TOP_K, dtype=torch.int64)
        routed_experts(torch.zeros(1, HIDDEN), ids1, torch.zeros(1, TOP_K), handle, 5)


def test_op_has_a_shape_only_fake(handle: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(9, HIDDEN)
        out = torch.empty(9, HIDDEN)
        torch.ops.dsv41.routed_experts_out(x, torch.empty(9, TOP_K, dtype=torch.int64), torch.empty(9, TOP_K), out,
                                           handle, 0)  # fmt: skip


def test_f64_variant_is_closer_to_the_reference_and_refuses_other_dtypes(
    home: ExpertHome, reference: ReferenceExperts
) -> None:
    f32, f64 = AllInVramRuntime("cpu"), AllInVramRuntime("cpu", torch.float64)
    for lx in home.layers():
        f32.add_layer(lx, swiglu_limit=None)
        f64.add_layer(lx, swiglu_limit=None)
    assert f64.nbytes == 2 * f32.nbytes
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, HIDDEN)).astype(np.float32)
    ids, w = _routing(rng, 32)
    expected = reference.forward(0, x, ids, w)
    errs = []
    for rt in (f32, f64):
        out = torch.zeros(32, HIDDEN, dtype=torch.float32)
        rt.forward_into(0, torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w), out)
        errs.append(float(np.abs(out.numpy() - expected).max()))
    assert errs[1] <= errs[0]  # float64 sums: only the final rounding to float32 remains
    assert errs[1] <= 1e-6 * np.abs(expected).max()
    with pytest.raises(ValueError, match="float32 or float64"):
        AllInVramRuntime("cpu", torch.bfloat16)


def test_runtime_slot_can_be_swapped(home: ExpertHome) -> None:
    a = AllInVramRuntime("cpu")
    b = AllInVramRuntime("cpu")
    for lx in home.layers():
        a.add_layer(lx, swiglu_limit=None)
        b.add_layer(lx, swiglu_limit=1.0)  # a different clamp, so the outputs differ
    h = register_runtime(a)
    try:
        rng = np.random.default_rng(3)
        x = torch.from_numpy(rng.standard_normal((4, HIDDEN)).astype(np.float32) * 4)
        ids, w = (torch.from_numpy(v) for v in _routing(rng, 4))
        ya = routed_experts(x, ids, w, h, 0)
        assert replace_runtime(h, b) is a and get_runtime(h) is b
        yb = routed_experts(x, ids, w, h, 0)
        assert not torch.allclose(ya, yb)  # the same handle now calls the other runtime
    finally:
        unregister_runtime(h)
    with pytest.raises(KeyError, match="no expert runtime"):
        get_runtime(h)


def test_no_experts_runtime_writes_zeros_and_is_not_configurable(home: ExpertHome) -> None:
    rt = NoExpertsRuntime()
    for lx in home.layers():
        rt.add_layer(lx, swiglu_limit=None)
    h = register_runtime(rt)
    try:
        rng = np.random.default_rng(5)
        x = torch.from_numpy(rng.standard_normal((3, HIDDEN)).astype(np.float32))
        ids, w = (torch.from_numpy(v) for v in _routing(rng, 3))
        out = torch.full((5, HIDDEN), float("nan"))
        torch.ops.dsv41.routed_experts_out(x, ids, w, out, h, 1)
        assert (out[:3] == 0).all() and torch.isnan(out[3:]).all()  # zeros for the T rows, the rest untouched
        with pytest.raises(KeyError, match="layer 7"):
            routed_experts(x, ids, w, h, 7)
        out2 = torch.full((5, HIDDEN), float("nan"))  # the two halves, as a model compiled with the tiered runtime
        rt.begin(0, x[:2], ids[:2], w[:2])
        rt.finish(0, out2)
        assert (out2[:2] == 0).all() and torch.isnan(out2[2:]).all()
        with pytest.raises(RuntimeError, match="finish\\(\\) without its begin"):
            rt.finish(0, out2)
    finally:
        unregister_runtime(h)
    with pytest.raises(ValueError, match="runtime: expected one of"):
        Dsv41PluginConfig(runtime="none")  # type: ignore[arg-type]


def test_the_call_path_is_fixed_by_the_runtime_the_model_is_built_with() -> None:
    """How the model calls its runtime (experts.call_path) and which runtimes may replace the one it was built with:
    with CUDA graphs, a graph-safe runtime's calls are captured, so nothing may replace it."""
    from vllm_dsv41.experts import call_path
    from vllm_dsv41.quant import Exl3Config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = Dsv41PluginConfig(cpu=CpuTierConfig(threads=1))
    oracle, host, none = AllInVramRuntime(cpu), CpuExpertRuntime(cfg), NoExpertsRuntime()

    class Halves:  # a runtime with the tiered runtime's two halves
        name, graph_safe = "halves", False

        def begin(self) -> None: ...

    try:
        assert [call_path(r, cuda) for r in (oracle, host, Halves(), none)] == ["eager", "eager", "split", "op"]
        assert {call_path(r, cpu) for r in (oracle, host, Halves(), none)} == {"op"}
        for path, graphs, allowed in (("op", True, False), ("op", False, True), ("eager", True, True),
                                      ("split", True, True)):  # fmt: skip
            q = Exl3Config({"quant_method": "exl3"})
            q._runtime, q._runtime_handle = oracle, register_runtime(oracle)
            q._call_path, q._cuda_graphs = path, graphs
            try:
                if allowed:
                    assert q.set_runtime(host) is oracle and q.expert_runtime()[0] is host
                else:
                    with pytest.raises(RuntimeError, match="captured in the graphs"):
                        q.set_runtime(host)
                    assert q.expert_runtime()[0] is oracle
            finally:
                unregister_runtime(q._runtime_handle)
    finally:
        host.close()


# ------------------------------------------------------------------------- the oracle's dequantization modes


def _random_layer(rng: np.random.Generator, layer: int, experts: int = 6, hidden: int = 256,
                  inter: int = 384) -> LayerExperts:  # fmt: skip
    """Fresh random experts (each projection of a random codebook and width, a half-bit one among them)."""
    widths = {"3inst": (2, 3, 4), "mcg": (3, 4), "mul1": (2.5, 3, 3.5)}

    def one(k: int, n: int) -> exl3.Exl3Tensor:
        cb = str(rng.choice(list(widths)))
        return exl3.random_tensor(k, n, float(rng.choice(widths[cb])), cb, rng)  # type: ignore[arg-type]

    return LayerExperts(layer, tuple(one(hidden, inter) for _ in range(experts)),
                        tuple(one(hidden, inter) for _ in range(experts)),
                        tuple(one(inter, hidden) for _ in range(experts)))  # fmt: skip


@contextlib.contextmanager
def _records(name: str = "vllm.dsv41.experts") -> Iterator[list[logging.LogRecord]]:
    """The records of logger ``name`` at INFO and up (a handler on it: vLLM's "vllm" logger does not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_call_equals_load_bit_for_bit(dtype: torch.dtype) -> None:
    """Per call, each routed expert is dequantized on the device, used and freed; at load all are kept: the same
    weights and the same math, so the outputs are equal bit for bit, on fresh random layers and routings with
    padding rows (all ids -1), single skipped picks, an expert picked twice by one token, and T = 0."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    hidden, experts, topk = 256, 6, 4
    layers = [_random_layer(rng, lid, experts, hidden) for lid in (0, 3)]
    limits = {0: None, 3: 0.5}  # the clamp bites: random inputs give gate/up values of order 1
    load = AllInVramRuntime("cpu", dtype, dequantize="load")
    per_call = AllInVramRuntime("cpu", dtype, dequantize="per-call")
    ref = ReferenceExperts()
    for lx in layers:
        for rt in (load, per_call):
            rt.add_layer(lx, swiglu_limit=limits[lx.layer])
        ref.add_layer(lx.layer, lx.gate, lx.up, lx.down, swiglu_limit=limits[lx.layer])
    assert load.modes == {0: "load", 3: "load"} and per_call.modes == {0: "per-call", 3: "per-call"}
    assert load.nbytes == sum(load.layer_nbytes(lx) for lx in layers) > 0 and per_call.nbytes == 0
    for tokens in (0, 1, 5, 23):
        for lid in (0, 3):
            x = torch.from_numpy((rng.standard_normal((tokens, hidden)) * 2).astype(np.float32))
            ids = rng.integers(-1, experts, size=(tokens, topk))  # -1: a skipped pick; repeats within a token
            if tokens > 2:
                ids[-2:] = -1  # a CUDA graph's padding rows
                ids[0, :2] = ids[0, 2]  # one expert picked three times by a token
            w = torch.from_numpy(rng.uniform(0.05, 1.0, size=(tokens, topk)).astype(np.float32))
            outs = []
            for rt in (load, per_call):
                out = torch.full((tokens + 2, hidden), float("nan"))
                rt.forward_into(lid, x, torch.from_numpy(ids), w, out)
                assert torch.isnan(out[tokens:]).all(), f"seed {seed}"  # rows past T untouched
                outs.append(out[:tokens])
            assert torch.equal(outs[0], outs[1]), f"seed {seed}: T {tokens} layer {lid}"
            if tokens > 2:
                assert (outs[1][-2:] == 0).all()
            if tokens:
                want = ref.forward(lid, x.numpy(), ids, w.numpy())
                np.testing.assert_allclose(outs[1].numpy(), want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                           err_msg=f"seed {seed}")  # fmt: skip


def test_auto_dequantizes_per_call_above_half_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_dsv41 import experts as ex

    assert choose_dequantize(100, 201) == "load" and choose_dequantize(100, 200) == "load"
    assert choose_dequantize(101, 200) == "per-call" and choose_dequantize(1, 0) == "per-call"
    assert free_device_bytes("cpu") > 0
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    layers = [_random_layer(rng, lid, experts=2) for lid in range(3)]
    rt = AllInVramRuntime("cpu")
    assert rt.dequantize == "auto"
    need = rt.layer_nbytes(layers[0])
    assert need == 2 * 3 * 256 * 384 * 4
    with _records() as records:
        monkeypatch.setattr(ex, "free_device_bytes", lambda device: 2 * need - 1)
        rt.add_layer(layers[0], swiglu_limit=None)
        monkeypatch.setattr(ex, "free_device_bytes", lambda device: 2 * need)
        rt.add_layer(layers[1], swiglu_limit=None)
        monkeypatch.undo()  # the real free memory: a small layer is dequantized at load
        rt.add_layer(layers[2], swiglu_limit=None)
    assert rt.modes == {0: "per-call", 1: "load", 2: "load"}
    assert rt.nbytes == 2 * need  # the two layers dequantized at load; none of the per-call one
    msgs = [r.getMessage() for r in records]
    assert len(msgs) == 3 and "dsv41 all-in-vram: MoE layer 0's 2 experts dequantized per call on cpu (auto:" in msgs[0]
    assert all("dequantized at load on cpu (auto:" in m for m in msgs[1:]), msgs
    f64 = AllInVramRuntime("cpu", torch.float64)
    assert f64.layer_nbytes(layers[0]) == 2 * need


def test_dequantize_is_validated_and_make_runtime_takes_auto() -> None:
    with pytest.raises(ValueError, match=r"dequantize must be one of \('load', 'per-call', 'auto'\), got 'lazy'"):
        AllInVramRuntime("cpu", dequantize="lazy")  # type: ignore[arg-type]
    rt = make_runtime(Dsv41PluginConfig(runtime="all-in-vram"), "cpu", vllm_share_bytes=1 << 30)
    assert isinstance(rt, AllInVramRuntime) and rt.dequantize == "auto" and rt.dtype == torch.float32
    lx = _random_layer(np.random.default_rng(int.from_bytes(os.urandom(4), "little")), 0, experts=1)
    rt.add_layer(lx, swiglu_limit=None)  # vLLM's share is a GPU's: on the CPU, the host's memory counts
    assert rt.modes == {0: "load"} and rt.name == "all-in-vram"


@pytest.mark.parametrize(
    ("precision", "dtype", "want"),
    [
        ("auto", torch.float32, "exact"),  # the demo (vLLM's CPU build runs it in float32)
        ("auto", torch.bfloat16, "fast"),  # the GPU packs
        ("auto", torch.float16, "fast"),
        ("exact", torch.bfloat16, "exact"),  # an explicit setting wins
        ("fast", torch.float32, "fast"),
    ],
)
def test_cpu_precision_auto_follows_the_model_dtype(home: ExpertHome, precision: str, dtype: torch.dtype,
                                                     want: str) -> None:  # fmt: skip
    """The plugin's default CPU-tier precision ("auto") resolves by the model's dtype, in both runtimes that hold
    the CPU tier; the CPU runtime then computes what that precision computes."""
    from vllm_dsv41.config import TieredConfig

    cpu = CpuTierConfig(threads=2, precision=precision)  # type: ignore[arg-type]
    rt = make_runtime(Dsv41PluginConfig(cpu=cpu), "cpu", activation_dtype=dtype)
    tiered = make_runtime(Dsv41PluginConfig(cpu=cpu, runtime="tiered", tiered=TieredConfig(prefill=False)), "cpu",
                          home=home, activation_dtype=dtype)  # fmt: skip
    try:
        assert isinstance(rt, CpuExpertRuntime) and rt.precision == want
        assert getattr(tiered, "precision", None) == want
        explicit = CpuExpertRuntime(Dsv41PluginConfig(cpu=CpuTierConfig(threads=2, precision=want)))  # type: ignore[arg-type]
        try:
            rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
            x = torch.from_numpy(rng.standard_normal((3, HIDDEN)).astype(np.float32))
            ids = torch.from_numpy(np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(3)]))
            w = torch.from_numpy(rng.uniform(0.1, 1.0, (3, TOP_K)).astype(np.float32))
            outs = []
            for r in (rt, explicit):
                for lx in home.layers():
                    r.add_layer(lx, swiglu_limit=None)
                out = torch.empty_like(x)
                r.forward_into(0, x, ids, w, out)
                outs.append(out)
            assert torch.equal(outs[0], outs[1])
        finally:
            explicit.close()
    finally:
        rt.close()
        tiered.close()
