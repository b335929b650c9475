"""vllm_dsv41.ampere on the CPU (CI): the V4.1 attention path for sm_80/sm_86.

* every Triton kernel against its float64 reference under Triton's interpreter, on fresh random data (the seed is
  printed on failure), including a prefill + decode pipeline with prompts longer than the window and than top-k,
  and the FP8 rounding of ``kv_rounding="fp8"`` bit for bit against torch's e4m3 cast with upstream's scale rule
  (``ampere_cases.py``, run in a subprocess with ``TRITON_INTERPRET=1``);
* every kernel compiled ahead of time for sm_80 and sm_86 with no instruction those lack, and the scan's own
  negative controls (Hopper code for sm_90, FP8 conversions);
* the KV-cache arithmetic, the attention selection and the vLLM wiring (the layer built on vLLM's CPU build).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
CASES = [
    "rope_q_kv_insert",
    "sparse_mqa_attention",
    "indexer_k_store",
    "indexer_q_rope",
    "indexer_logits",
    "topk_rows",
    "inv_rope_grouped",
    "pipeline_prefill_decode",
    "fp8_rounding",
    "fp8_stores",
]


# --------------------------------------------------------------------------- kernels vs references (interpreter)


@pytest.fixture(scope="module")
def interpreted() -> tuple[int, dict[str, dict[str, Any]]]:
    seed = secrets.randbits(30)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-W", "ignore", str(HERE / "ampere_cases.py"), str(seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"seed {seed}: {r.stderr[-3000:]}"
    results = {d["case"]: d for d in map(json.loads, r.stdout.splitlines())}
    return seed, results


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_float64_reference_in_interpreter(interpreted: tuple[int, dict], case: str) -> None:
    seed, results = interpreted
    assert set(results) == set(CASES), f"cases run: {sorted(results)}"
    assert results[case]["ok"], f"seed {seed} ({case}): {results[case]['detail']}"


# ------------------------------------------------------------------------------ ahead-of-time for sm_80 / sm_86


@pytest.fixture(scope="module")
def compiled() -> list[Any]:
    from vllm_dsv41.ampere import aot

    return aot.check(aot.kernel_specs(), (80, 86))


def test_every_kernel_compiles_for_sm80_and_sm86_without_newer_instructions(compiled: list[Any]) -> None:
    from vllm_dsv41.ampere import aot

    labels = {s.label for s in aot.kernel_specs()}
    assert {(r.label, r.arch) for r in compiled} == {(lbl, a) for lbl in labels for a in (80, 86)}
    bad = [f"sm_{r.arch} {r.label}: {r.problems}" for r in compiled if not r.ok]
    assert not bad, bad
    assert all(r.sass_checked for r in compiled), "nvdisasm (shipped with Triton) did not run"
    # the two heavy kernels run on Ampere's tensor cores (mma.sync), not scalar FMAs
    for r in compiled:
        if r.label.startswith(("sparse_mqa_attention", "indexer_logits")):
            assert r.mma > 0, r


def test_the_scan_flags_hopper_code_and_fp8() -> None:
    """Negative controls: the check fails where it must (so a clean result above means something)."""
    import torch
    import triton
    import triton.language as tl

    from vllm_dsv41.ampere import aot

    @triton.jit
    def dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):  # type: ignore[no-untyped-def]
        m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        x = tl.load(a + m[:, None] * K + k[None, :])
        y = tl.load(b + k[:, None] * N + n[None, :])
        tl.store(c + m[:, None] * N + n[None, :], tl.dot(x, y))

    @triton.jit
    def fp8_kernel(x, y, n):  # type: ignore[no-untyped-def]
        i = tl.arange(0, 128)
        v = tl.load(x + i, mask=i < n)
        tl.store(y + i, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=i < n)

    bf16, f32, u8 = aot._t(torch.bfloat16), aot._t(torch.float32), aot._t(torch.uint8)
    dot = aot.KernelSpec("dot", dot_kernel, dict(a=bf16, b=bf16, c=f32, M=128, N=128, K=64))
    (ampere, hopper) = aot.check([dot], (86, 90))
    assert ampere.ok and ampere.mma > 0
    assert not hopper.ok and any("wgmma" in p for p in hopper.problems) and any("HGMMA" in p for p in hopper.problems)
    fp8 = aot.KernelSpec("fp8", fp8_kernel, dict(x=f32, y=u8, n=128))
    (sm86, sm89) = aot.check([fp8], (86, 89))
    assert not sm86.ok and "fp8e4nv not supported" in sm86.problems[0]  # Triton refuses e4m3 below sm_89
    assert not sm89.ok and any("FP8 conversion" in p for p in sm89.problems)


def _elf(abi_version: int, flags: int) -> bytes:
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    head[4], head[7], head[8] = 2, 0x33, abi_version  # 64-bit, CUDA OS/ABI, ABI version
    head[48:52] = flags.to_bytes(4, "little")
    return bytes(head)


def test_cubin_arch_reads_both_elf_encodings() -> None:
    """The SM of a cubin: the low byte of e_flags before CUDA ELF ABI 8 (Triton's ptxas), bits 8-15 from 8 on
    (CUDA 13's ptxas: e_flags 0x6005604 is sm_86)."""
    from vllm_dsv41.ampere.aot import cubin_arch

    assert cubin_arch(_elf(7, 0x500550)) == 80
    assert cubin_arch(_elf(8, 0x6005604)) == 86
    assert cubin_arch(_elf(8, 0x6005004)) == 80
    with pytest.raises(ValueError, match="not an ELF"):
        cubin_arch(b"\0" * 64)


def test_tilelang_check_limits_and_reports(tmp_path: Path) -> None:
    """The parts of the TileLang mHC check that need neither TileLang nor nvcc: the launch limits per arch (a
    clean run means something: what does not fit is named), ptxas' report, the config's mHC sizes."""
    from vllm_dsv41.ampere.aot_tilelang import SM_LIMITS, MhcShape, launch_problems, ptxas_usage

    assert launch_problems(86, 1024, 99 * 1024, 64) == []
    assert launch_problems(86, 1025, 0) == ["1025 threads per block > 1024"]
    assert launch_problems(86, 96, 99 * 1024 + 1) == [f"{99 * 1024 + 1} B of shared memory per block > {99 * 1024} B"]
    assert launch_problems(80, 96, 99 * 1024 + 1) == []  # an A100 block may take 163 KiB
    assert launch_problems(86, 512, 0, 129) == ["129 registers x 512 threads > the 65536-register file"]
    assert SM_LIMITS[86].dyn_smem < SM_LIMITS[80].dyn_smem
    report = ("ptxas info    : Function properties for k\n    0 bytes stack frame, 8 bytes spill stores, 4 bytes "
              "spill loads\nptxas info    : Used 113 registers, used 4 barriers, 436 bytes cmem[0]\n")  # fmt: skip
    assert ptxas_usage(report) == {"registers": 113, "spill_bytes": 12}
    with pytest.raises(ValueError, match="no register count"):
        ptxas_usage("ptxas fatal")
    from pack_tools.presets.tiny_v41 import FLASH, tiny_v41_config

    (tmp_path / "flash").mkdir()
    cfg = tmp_path / "flash" / "config.json"
    cfg.write_text(json.dumps(tiny_v41_config(FLASH)))
    shape = MhcShape.from_config(cfg)
    assert (shape.name, shape.hidden, shape.hc_mult, shape.mix) == ("flash", FLASH.hidden, FLASH.hc_mult, 24)
    cfg.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config.json: not a V4.1 config with mHC \(no field 'hc_mult'\)"):
        MhcShape.from_config(cfg)


def test_tilelang_check_traces_sm8x_kernels_with_pdl_off_on_a_hopper_box() -> None:
    """Upstream's mHC kernels emit PDL when ``tilelang_kernels.ENABLE_PDL`` is on, and that flag is set at import from
    the checking machine's GPU: on an H200 (capability 9.0) every sm_80/sm_86 lowering failed ("PDL is not
    supported", results/h200-run3-ampere-aot-tilelang.log). The check traces each kernel with the flag an sm_8x card
    gives it (off), restores it after, and says so in the result."""
    import types

    from vllm_dsv41.ampere.aot_tilelang import TileLangSpec, trace, upstream_pdl

    assert [upstream_pdl(a) for a in (80, 86, 89, 90, 100)] == [False, False, False, True, True]
    kernels = types.SimpleNamespace(ENABLE_PDL=True)  # tilelang_kernels as imported on the H200
    seen: list[tuple[bool, dict[str, Any]]] = []

    class Fn:  # a @tilelang.jit kernel: TileLang re-runs its body, reading the module's flag, per get_tir
        def get_tir(self, **params: Any) -> str:
            seen.append((kernels.ENABLE_PDL, params))
            return "tir"

    spec = TileLangSpec("k", Fn(), {"hc": 4})
    for arch in (80, 86):
        tir, note = trace(spec, arch, kernels)
        assert tir == "tir" and seen[-1] == (False, {"hc": 4})
        assert note == (f"forced off: an sm_{arch} card gives upstream's ENABLE_PDL False (capability >= 9.0 only); "
                        "this machine's import gave True")  # fmt: skip
        assert kernels.ENABLE_PDL is True  # restored
    assert trace(spec, 90, kernels)[1] == "on, as on sm_90 (upstream's ENABLE_PDL is True here too)"
    assert seen[-1][0] is True
    kernels.ENABLE_PDL = False  # a CPU box or an sm_8x card: nothing to force
    assert trace(spec, 86, kernels)[1] == "off, as on sm_86 (upstream's ENABLE_PDL is False here too)"

    class Failing:
        def get_tir(self, **params: Any) -> str:
            raise RuntimeError("trace failed")

    kernels.ENABLE_PDL = True
    with pytest.raises(RuntimeError, match="trace failed"):
        trace(TileLangSpec("k", Failing(), {}), 80, kernels)
    assert kernels.ENABLE_PDL is True  # restored on a failure too
    with pytest.raises(AttributeError):  # upstream renamed its flag: fail, don't lower with PDL silently
        trace(spec, 80, types.SimpleNamespace())


def test_tilelang_pdl_rule_matches_vllm_source() -> None:
    """``upstream_pdl`` restates vLLM 0.32's rule, which CPU CI cannot import (TileLang, CUDA build): the mHC kernels
    wrap their PDL calls in the module flag ``ENABLE_PDL = current_platform.is_arch_support_pdl() and ...``, and
    ``CudaPlatform.is_arch_support_pdl`` is compute capability major >= 9. A change there fails here."""
    import re

    import vllm

    root = Path(vllm.__file__).parent
    kernels = (root / "model_executor/kernels/mhc/tilelang_kernels.py").read_text()
    assert "\nENABLE_PDL = current_platform.is_arch_support_pdl() and current_platform.is_cuda()\n" in kernels
    pdl_calls = re.findall(r"^\s*(.*)\n\s*T\.pdl_(?:sync|trigger)\(\)", kernels, re.M)
    assert pdl_calls and set(pdl_calls) == {"if ENABLE_PDL:"}
    cuda = (root / "platforms/cuda.py").read_text()
    rule = re.search(r"def is_arch_support_pdl\(cls\) -> bool:\n(.*?)\n\n", cuda, re.S)
    assert rule is not None and rule.group(1).strip().endswith("return major >= 9"), rule


@pytest.mark.gpu  # needs TileLang, which comes with vLLM's CUDA install (scripts/gpu_ampere.sh "tests"), not a GPU
@pytest.mark.filterwarnings("ignore:`tl.disable_tma_lower` is deprecated:DeprecationWarning")  # vLLM's pass config
def test_tilelang_lowers_for_sm8x_when_imported_with_pdl_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """With TileLang (vLLM's CUDA install, or a CPU venv with tilelang==0.1.12): upstream's mhc_post traced with
    ``ENABLE_PDL`` on (an H200's import) carries PDL, which the check refuses for sm_86 by name; ``check`` traces it
    as an sm_86 card does and lowers it."""
    from vllm_dsv41.ampere import aot_tilelang as at

    at._tilelang()
    from vllm.model_executor.kernels.mhc import tilelang_kernels as tk

    monkeypatch.setattr(tk, "ENABLE_PDL", True)
    spec = at.TileLangSpec("mhc_post", tk.mhc_post_tilelang, {"hc": 4, "hidden": 1024})
    hopper = spec.fn.get_tir(**spec.params)
    assert at._pdl_calls(hopper) == ["tl.pdl_sync", "tl.pdl_trigger"]
    with pytest.raises(RuntimeError, match=r"traced with PDL \(tl.pdl_sync, tl.pdl_trigger\) although sm_86"):
        at.lower(hopper, 86)
    [r] = at.check([spec], [86], nvcc=None)
    assert r.ok and r.threads == 128 and r.pdl.startswith("forced off: an sm_86 card"), r.problems
    assert tk.ENABLE_PDL is True


# ----------------------------------------------------------------------------------------------- KV layout


def _flash_config() -> dict[str, Any]:
    """DeepSeek-V4.1-Flash's text config with the published compress-ratio split (exl3-format.md section 8.2:
    layers 2-19 ratio 2, 20-39 ratio 1; pack-tools' FLASH preset puts layer 20 at ratio 2)."""
    from pack_tools.presets.tiny_v41 import FLASH, tiny_v41_config

    cfg = tiny_v41_config(FLASH)["text_config"]
    cfg["compress_ratios"] = [0, 0] + [2] * 18 + [1] * 20 + [0] * FLASH.mtp
    return cfg


def test_kv_bytes_bf16_rows_against_fp8_records_at_262k() -> None:
    from vllm_dsv41.ampere.layout import kv_bytes

    cfg = _flash_config()
    ours, hopper = kv_bytes(cfg, "ampere-bf16"), kv_bytes(cfg, "fp8_ds_mla-sm90")
    # kv sources 2, 8, 14 (ratio 2) and 20 (ratio 1), all index sources: 2.5 entries per token of each kind
    assert ours.compressed_entries_per_token == ours.index_entries_per_token == 2.5
    assert ours.per_token == 2.5 * 1024 + 2.5 * 256 == 3200
    assert hopper.per_token == 2.5 * 584 + 2.5 * 132 == 1790
    assert ours.swa_per_request == 40 * 128 * 1024 and hopper.swa_per_request == 40 * 128 * 584
    ctx = 262144
    assert ours.at(ctx) == 3200 * ctx + 40 * 128 * 1024  # 805 MiB
    assert hopper.at(ctx) == 1790 * ctx + 40 * 128 * 584  # 450 MiB
    with pytest.raises(ValueError, match="layout"):
        kv_bytes(cfg, "fp4")
    with pytest.raises(ValueError, match="sliding_window"):
        kv_bytes({k: v for k, v in cfg.items() if k != "sliding_window"})


# --------------------------------------------------------------------------------------- selection, wiring


def test_kv_rounding_config_defaults_to_fp8_and_reads_additional_config() -> None:
    """``attention_kv_rounding`` is a field of the plugin's one configuration: "fp8" by default, read from
    ``additional_config["dsv41"]``, a bad value named."""
    import types

    from vllm_dsv41 import Dsv41PluginConfig

    assert Dsv41PluginConfig().attention_kv_rounding == "fp8"
    vc = types.SimpleNamespace
    assert Dsv41PluginConfig.from_vllm_config(vc(additional_config=None)).attention_kv_rounding == "fp8"
    got = Dsv41PluginConfig.from_vllm_config(vc(additional_config={"dsv41": {"attention_kv_rounding": "bf16"}}))
    assert got.attention_kv_rounding == "bf16" and got.to_mapping()["attention_kv_rounding"] == "bf16"
    with pytest.raises(ValueError, match="additional_config 'dsv41': attention_kv_rounding: expected one of"):
        Dsv41PluginConfig.from_vllm_config(vc(additional_config={"dsv41": {"attention_kv_rounding": "fp4"}}))


def test_fp8_scale_rule_is_exact_on_bf16_amaxes() -> None:
    """Upstream computes the UE8M0 exponent as ``ceil(log2(amax * fp32(1/448)))`` (Triton) or from the ratio's
    bits (CuTe); ``fp8.py`` says they agree on every bf16 amax: the ratio is an exact power of two (amax 1.75 * 2^k)
    or far from one. Checked here over every positive finite bf16 value."""
    import torch

    from vllm_dsv41.ampere.fp8 import ue8m0_exponents

    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(torch.bfloat16).float()
    y = amax.clamp(min=1e-4) * torch.tensor(1 / 448, dtype=torch.float32)
    from_bits = ((y.view(torch.int32) + 0x7FFFFF) >> 23) - 127
    assert torch.equal(ue8m0_exponents(amax), from_bits)
    exact = torch.ceil(torch.log2(amax.double().clamp(min=float(torch.tensor(1e-4))) / 448)).int()
    assert torch.equal(from_bits, exact)  # and both equal the real-number rule


@pytest.mark.parametrize(
    ("mode", "cap", "ours"),
    [
        ("auto", (8, 6), True),
        ("auto", (8, 0), True),
        ("auto", (8, 9), True),
        ("auto", (9, 0), False),
        ("auto", (10, 0), False),
        ("auto", None, False),
        ("triton", (9, 0), True),
        ("triton", (10, 0), True),
        ("upstream", (8, 6), False),
    ],
)
def test_selection_by_compute_capability_and_force(mode: str, cap: tuple[int, int] | None, ours: bool) -> None:
    from vllm_dsv41.ampere.select import wants_triton

    assert wants_triton(mode, cap) is ours


def test_selection_rejects_unknown_mode() -> None:
    from vllm_dsv41.ampere.select import wants_triton

    with pytest.raises(ValueError, match="attention"):
        wants_triton("flashmla", (9, 0))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_scope_swaps_the_layer_class_and_restores_it() -> None:
    from vllm.models.deepseek_v41.nvidia import model as nv

    from vllm_dsv41.ampere.layer import DeepseekV41TritonAttention
    from vllm_dsv41.ampere.select import triton_attention_scope

    original = nv._select_dsv4_attn_cls
    with triton_attention_scope(False) as cls:
        assert cls is None and nv._select_dsv4_attn_cls is original
    with pytest.raises(KeyError), triton_attention_scope(True) as cls:
        assert cls is DeepseekV41TritonAttention
        assert nv._select_dsv4_attn_cls(object()) is DeepseekV41TritonAttention
        raise KeyError("restored even on error")
    assert nv._select_dsv4_attn_cls is original


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_layer_classes_fit_upstreams_interfaces() -> None:
    import inspect

    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionCGSupport

    from vllm_dsv41.ampere import layer

    # upstream constructs the indexer op with SparseAttnIndexer's arguments
    want = list(inspect.signature(SparseAttnIndexer.__init__).parameters)
    assert list(inspect.signature(layer.TritonIndexerOp.__init__).parameters) == want
    assert layer.TritonIndexer.attn_cls is layer.TritonIndexerOp
    # the compressor's insert, replaced for kv_rounding="fp8", is called as upstream's (attention.py, forward_kv)
    base = layer.TritonCompressor.__mro__[1]
    assert list(inspect.signature(layer.TritonCompressor.insert_cache).parameters) == list(
        inspect.signature(base.insert_cache).parameters
    )
    cls = layer.DeepseekV41TritonAttention
    assert cls.use_fp8_ds_mla_layout is False and cls.get_padded_num_q_heads(24) == 24
    for backend in (cls.backend_cls, cls.swa_backend_cls):
        assert backend.supports_compute_capability(DeviceCapability(8, 0))
        assert backend.supports_compute_capability(DeviceCapability(8, 6))
        assert not backend.supports_compute_capability(DeviceCapability(7, 5))
        assert backend.get_builder_cls()._cudagraph_support is AttentionCGSupport.NEVER
    # no FlashMLA tile-scheduler plan, for every layer type upstream's SWA builder reads
    sched = layer.TritonSWAMetadataBuilder.build_tile_scheduler(None, 4)  # type: ignore[arg-type]
    assert set(sched) >= {"swaonly", "c4a", "c128a", "c1a", "c2a"} and not any(sched.values())


_BUILD = """
import sys, torch
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm_dsv41.v41 import ampere_attention_scope, configure_exl3_names
vc = EngineArgs(model=sys.argv[1], load_format="dsv41", limit_mm_per_prompt={"image": 0}, max_model_len=1024,
                enforce_eager=True, additional_config={"dsv41": {"attention": "triton"}}).create_engine_config()
configure_exl3_names(vc.quant_config, vc.model_config.hf_config)
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{sys.argv[2]}", 0, backend="gloo")
    ensure_model_parallel_initialized(1, 1)
    from vllm.models.deepseek_v41.nvidia import model as nv
    with ampere_attention_scope(vc) as cls:
        buf = torch.empty(8, 512, dtype=torch.int32)
        layers = {i: nv._select_dsv4_attn_cls(vc)(vc, prefix=f"language_model.model.layers.{i}.attn",
                                                  topk_indices_buffer=buf) for i in (0, 2, 3)}
    print("CLASS", cls.__name__)
    print("COMPRESSORS", sorted(type(l.compressor).__name__ for l in layers.values() if l.compressor is not None),
          all(l.kv_fp8 for l in layers.values()), all(l.indexer.kv_fp8 for l in layers.values() if l.indexer))
    for i, l in layers.items():
        spec = l.get_kv_cache_spec(vc)
        swa = l.swa_cache_layer.get_kv_cache_spec(vc)
        idx = l.indexer.k_cache.get_kv_cache_spec(vc) if l.indexer is not None else None
        print("LAYER", i, l.compress_ratio, swa.dtype, swa.head_size,
              None if spec is None else (spec.dtype, spec.head_size, spec.tokens_per_state),
              None if idx is None else (idx.dtype, idx.head_size), type(l.indexer.indexer_op).__name__
              if l.indexer is not None else None, l.indexer.indexer_op.swa_prefix if l.indexer is not None else None)
"""


@pytest.mark.slow
def test_forced_attention_builds_bf16_layers_on_vllm(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``attention: "triton"`` in the plugin config: the V4.1 layers vLLM builds are ours, with bf16 KV specs, and
    with the default ``kv_rounding="fp8"`` our compressed-cache insert and the FP8 rounding on."""
    from pack_tools import build_pack
    from pack_tools.origin import ENGRAM, EXL3
    from pack_tools.presets.tiny_v41 import synth_tiny_v41

    root = tmp_path_factory.mktemp("ampere")
    synth_tiny_v41(root / "in")
    pack = build_pack(root / "in" / EXL3.dirname, root / "in" / ENGRAM.dirname, root / "pack", jobs=1)
    port = str(29500 + secrets.randbelow(400))
    r = subprocess.run([sys.executable, "-c", _BUILD, str(pack), port], capture_output=True, text=True, timeout=600)
    assert "CLASS DeepseekV41TritonAttention" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert "COMPRESSORS ['TritonCompressor', 'TritonCompressor'] True True" in r.stdout, r.stdout[-2000:]
    rows = {
        int(w[1]): w[2:] for w in (line.split(" ", 2) for line in r.stdout.splitlines() if line.startswith("LAYER"))
    }
    assert rows[0] == ["0 torch.bfloat16 512 None None None None"]
    assert rows[2] == [
        "2 torch.bfloat16 512 (torch.bfloat16, 512, 2) (torch.bfloat16, 128) TritonIndexerOp "
        "language_model.model.layers.2.attn.swa_cache"
    ]
    assert rows[3][0].startswith("1 torch.bfloat16 512 (torch.bfloat16, 512, 1) (torch.bfloat16, 128) TritonIndexerOp")


# ------------------------------------------------------------------------ on a GPU, at V4.1's attention sizes


def _cuda() -> Any:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


def _f64_attention(q: Any, rows: Any, lens: Any, scale: float, sink: Any) -> Any:
    """float64 sparse attention of q [T, H, D] over rows [T, K, D] (the first lens[t] of each), sink in the
    denominator (vectorized: the GPU tests' sizes are too large for the per-token reference)."""
    import torch

    k = rows.double()
    s = torch.einsum("thd,tkd->thk", q.double(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[1], device=k.device)[None, None, :] >= lens[:, None, None], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.double()[None, :])
    p = torch.exp(s - m[..., None])
    return torch.einsum("thk,tkd->thd", p, k) / (p.sum(-1) + torch.exp(sink.double()[None, :] - m))[..., None]


@pytest.mark.gpu
def test_gpu_sparse_attention_at_v41_sizes_vs_float64_and_flashmla() -> None:
    """64 heads of 512, a 128-token window plus 512 selected compressed rows, on the GPU: our kernel against
    float64, and against FlashMLA's sparse prefill kernel (bf16 rows: its one path without FP8) where it runs."""
    torch = _cuda()
    from vllm_dsv41.ampere import kernels

    g = torch.Generator(device="cuda").manual_seed(secrets.randbits(30))
    t, h, d, window, topk, n_rows, rows = 64, 64, 512, 128, 512, 8192, 64
    dev = "cuda"
    cache = torch.randn(n_rows // rows, rows, d, generator=g, device=dev).bfloat16()
    q = torch.randn(t, h, d, generator=g, device=dev).bfloat16()
    sink = torch.randn(h, generator=g, device=dev)
    perm = torch.stack([torch.randperm(n_rows, generator=g, device=dev)[: window + topk] for _ in range(t)]).int()
    swa_idx, cmp_idx = perm[:, :window].contiguous(), perm[:, window:].contiguous()
    swa_len = torch.randint(1, window + 1, (t,), generator=g, device=dev).int()
    cmp_len = torch.randint(0, topk + 1, (t,), generator=g, device=dev).int()
    scale = d**-0.5
    out = torch.empty(t, h, d, dtype=torch.bfloat16, device=dev)
    kernels.sparse_mqa_attention(q, out, scale, cache, swa_idx, swa_len, cache, cmp_idx, cmp_len, sink)
    # the reference: the rows in one list, invalid ones pushed past each token's length
    flat = cache.reshape(-1, d)
    k_idx = torch.full((t, window + topk), 0, dtype=torch.int64, device=dev)
    k_len = swa_len + cmp_len
    for i in range(t):
        sel = torch.cat([swa_idx[i, : swa_len[i]], cmp_idx[i, : cmp_len[i]]]).long()
        k_idx[i, : sel.numel()] = sel
    ref = _f64_attention(q, flat[k_idx], k_len, scale, sink)
    err = (out.double() - ref).abs()
    bound = 2**-7 * ref.abs() + 2**-7 * float(cache.abs().max())
    assert float((err / bound).max()) <= 1.0, f"max err {float(err.max()):.3g}"
    try:
        from vllm.v1.attention.ops.flashmla import flash_mla_sparse_fwd
    except ImportError as e:  # pragma: no cover - vLLM's CPU build
        pytest.skip(f"FlashMLA not importable: {e}")
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        return  # FlashMLA runs on sm_90/sm_100 only: the float64 check above is the test there
    idx = torch.where(torch.arange(window + topk, device=dev)[None, :] < k_len[:, None], k_idx, -1).int()
    fm = torch.empty_like(out)
    flash_mla_sparse_fwd(q, flat.view(-1, 1, d), idx.view(t, 1, -1), scale, attn_sink=sink, topk_length=k_len, out=fm)
    rel = float((out.float() - fm.float()).norm() / fm.float().norm())
    ref_rel = float((fm.double() - ref).norm() / ref.norm())
    print(f"ours vs FlashMLA sparse prefill: rel {rel:.2e} (FlashMLA vs float64: {ref_rel:.2e})")
    assert rel <= 4 * max(ref_rel, 2**-9)


@pytest.mark.gpu
def test_gpu_indexer_selection_at_v41_sizes_vs_float64() -> None:
    """32 index heads of 128, 8192 compressed entries, top-512: the Triton scores and top-k against float64
    scores; every chosen entry is at or above the exact 512th score (up to fp32 accumulation)."""
    torch = _cuda()
    from vllm_dsv41.ampere import ops

    g = torch.Generator(device="cuda").manual_seed(secrets.randbits(30))
    dev, nh, d, entries, rows, topk, ratio = "cuda", 32, 128, 8192, 64, 512, 1
    t = 16
    cache = torch.randn(entries // rows + 3, rows, d, generator=g, device=dev).bfloat16()
    bt = torch.randperm(entries // rows + 3, generator=g, device=dev)[: entries // rows].int()[None, :]
    q = torch.randn(t, nh, d, generator=g, device=dev).bfloat16()
    w = torch.randn(t, nh, generator=g, device=dev)
    pos = torch.randint(topk // 2, entries, (t,), generator=g, device=dev)
    pos[0] = entries - 1
    tok_req = torch.zeros(t, dtype=torch.int32, device=dev)
    out = torch.full((t, topk), -7, dtype=torch.int32, device=dev)
    ops.index_topk(q, w, cache, bt, tok_req, pos, ratio, [0, t], t, entries, topk, out)
    keys = cache[bt[0].long()].reshape(-1, d).double()  # entry j = row j of the request
    scores = torch.einsum("thd,nd->thn", q.double(), keys).relu().mul(w.double()[..., None]).sum(1)  # [T, N]
    for i in range(t):
        n = (int(pos[i]) + 1) // ratio
        s = scores[i, :n]
        chosen = out[i][out[i] >= 0].long()
        assert chosen.numel() == min(topk, n) and bool((chosen[1:] > chosen[:-1]).all())
        if n > topk:
            kth = torch.topk(s, topk).values[-1]
            assert float(s[chosen].min()) >= float(kth) - 1e-5 * float(s.abs().max()), f"token {i}"


def _fp8_record_rows(cache: Any, block: int) -> Any:
    """fp32 [blocks * block, 512] rows of a V4 ``fp8_ds_mla`` cache [blocks, block, 584] (values of a page first,
    576 B a row: 448 e4m3 + 64 bf16; then 8 UE8M0 bytes a row, 7 used), dequantized as FlashMLA reads them."""
    import torch

    pages = cache.reshape(cache.shape[0], -1)
    vals = pages[:, : block * 576].reshape(-1, 576)
    scales = pages[:, block * 576 : block * 584].reshape(-1, 8)[:, :7].float() - 127
    nope = vals[:, :448].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 7, 64)
    nope = (nope * torch.exp2(scales)[..., None]).reshape(-1, 448)
    return torch.cat([nope, vals[:, 448:].contiguous().view(torch.bfloat16).float()], 1)


@pytest.mark.gpu
def test_gpu_fp8_rounding_equals_upstreams_fp8_caches() -> None:
    """``kv_rounding="fp8"`` against upstream's own FP8 writers on a Hopper GPU (the served comparison's): every
    stored value of ours equals upstream's dequantized FP8 value, bit for bit (as bf16): window rows
    (``_C.fused_deepseek_v4_kv_rope_insert`` into the 584-byte record), compressed rows (``rope_quant_insert``),
    index keys (``indexer_k_norm_rope_store``, FP8 with an fp32 scale) and index queries
    (``fused_indexer_q_rope_quant``, the scale recovered from the folded weights)."""
    torch = _cuda()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("upstream's V4 fp8_ds_mla record is the sm_90 one")
    from vllm.models.deepseek_v41.common.ops import fused_indexer_q_rope_quant, indexer_k_norm_rope_store
    from vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache import rope_quant_insert

    from vllm_dsv41.ampere import kernels

    g = torch.Generator(device="cuda").manual_seed(secrets.randbits(30))
    dev, t, block, nb = "cuda", 96, 64, 4
    ang = torch.rand(4096, 32, generator=g, device=dev, dtype=torch.float64) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1).float()
    pos = torch.randperm(4096, generator=g, device=dev)[:t].sort().values
    slots = torch.randperm(nb * block, generator=g, device=dev)[:t].long()
    mags = torch.exp2(torch.randint(-12, 8, (t, 1), generator=g, device=dev).float())

    def differ(a: Any, b: Any) -> int:  # values whose bf16 bits differ
        return int((a.bfloat16().view(torch.int16) != b.bfloat16().view(torch.int16)).sum())

    rows: list[tuple[str, int, int]] = []  # (what, values differing, values compared)
    # window rows: the NoPE dims (the RoPE dims are bf16 in both, rotated by different code: CUDA vs Triton)
    kv = (torch.randn(t, 512, generator=g, device=dev) * mags).bfloat16()
    rec = torch.zeros(nb, block, 584, dtype=torch.uint8, device=dev)
    torch.ops._C.fused_deepseek_v4_kv_rope_insert(kv, rec, slots, pos, cs, block, None, False)
    ours = torch.zeros(nb, block, 512, dtype=torch.bfloat16, device=dev)
    kernels.rope_q_kv_insert(None, kv, pos, cs, ours, slots, fp8=True)
    up, mine = _fp8_record_rows(rec, block)[slots, :448], ours.reshape(-1, 512)[slots, :448]
    rows.append(("window rows (NoPE)", differ(up, mine), up.numel()))
    for ratio in (1, 2):  # compressed rows: the same record from upstream's Triton kernel, whole rows
        latent = (torch.randn(t, 512, generator=g, device=dev) * mags).bfloat16()
        rec = torch.zeros(nb, block, 584, dtype=torch.uint8, device=dev)
        rope_quant_insert(latent, pos, cs, rec, slots, ratio)
        ours = torch.zeros(nb, block, 512, dtype=torch.bfloat16, device=dev)
        kernels.compressed_kv_insert(latent, pos, cs, ours, slots, ratio, fp8=True)
        done = slots[(pos + 1) % ratio == 0]
        up, mine = _fp8_record_rows(rec, block)[done], ours.reshape(-1, 512)[done]
        rows.append((f"compressed rows ratio {ratio}", differ(up, mine), up.numel()))
    # index keys (FP8 cache: a page's 128-byte e4m3 rows, then one fp32 scale a row)
    k_pre = (torch.randn(t, 128, generator=g, device=dev) * mags).bfloat16()
    w = (1 + 0.1 * torch.randn(128, generator=g, device=dev)).bfloat16()
    rec = torch.zeros(nb, block, 132, dtype=torch.uint8, device=dev)
    indexer_k_norm_rope_store(k_pre, pos, cs, w, 1e-6, rec, slots, 2, False)
    pages = rec.reshape(nb, -1)
    vals = pages[:, : block * 128].reshape(-1, 128).view(torch.float8_e4m3fn).float()
    up = vals * pages[:, block * 128 :].reshape(-1, 4).contiguous().view(torch.float32)
    ours = torch.zeros(nb, block, 128, dtype=torch.bfloat16, device=dev)
    kernels.indexer_k_store(k_pre, pos, cs, w, 1e-6, ours, slots, 2, fp8=True)
    done = slots[(pos + 1) % 2 == 0]
    rows.append(("index keys", differ(up[done], ours.reshape(-1, 128)[done]), int(done.numel()) * 128))
    # index queries: upstream folds the power-of-two scale into the weights (CuTe kernel where CuTe-DSL is there)
    nh = 32
    q = (torch.randn(t, nh, 128, generator=g, device=dev) * mags[:, None]).bfloat16()
    iw = torch.randn(t, nh, generator=g, device=dev).abs() + 0.5
    q_fp8, w_out = fused_indexer_q_rope_quant(pos, q.clone(), cs, iw, 128**-0.5, nh**-0.5, use_fp4=False)
    scale = torch.exp2(torch.round(torch.log2(w_out.double() / (iw.double() * 128**-0.5 * nh**-0.5)))).float()
    mine, w_mine = q.clone(), torch.empty(t, nh, device=dev)
    kernels.indexer_q_rope(mine, pos, cs, iw, w_mine, 128**-0.5 * nh**-0.5, fp8=True)
    rows.append(("index queries", differ(q_fp8.float() * scale[..., None], mine), mine.numel()))
    report = "; ".join(f"{what}: {n} of {total} values differ" for what, n, total in rows)
    print(f"ours (kv_rounding=fp8) vs upstream's FP8 caches, dequantized: {report}")
    assert all(n == 0 for _, n, _ in rows), report


def _check_script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_ampere_check", HERE.parent / "scripts" / "gpu_ampere_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flipped(logits: Any, rng: Any, flips: int) -> Any:
    """``logits`` with the top two of ``flips`` random positions swapped (top-1 flips, a small KL)."""
    import numpy as np

    out = logits.copy()
    for i in rng.choice(logits.shape[0], size=flips, replace=False):
        a, b = np.argsort(out[i])[-2:]
        out[i, a], out[i, b] = out[i, b], out[i, a]
    return out


def test_ampere_check_gates_top1_at_the_upstream_runs_noise_floor(tmp_path: Path, capsys: Any) -> None:
    import numpy as np

    rng = np.random.default_rng(secrets.randbits(32))
    n, v = 2000, 64
    up = rng.standard_normal((n, v)).astype(np.float32)
    lens = np.array([n])
    layers = {"layer0": np.zeros(4, np.uint16)}
    runs = {"upstream": up, "triton": _flipped(up, rng, 12)}
    for name, logits in runs.items():
        (tmp_path / name).mkdir()
        np.savez_compressed(tmp_path / name / "logits.npz", logits=logits, prompt_lens=lens)
        np.savez_compressed(tmp_path / name / "layers.npz", **layers)
    check = _check_script()
    argv = ["compare", str(tmp_path / "upstream"), str(tmp_path / "triton"), "--min-top1", "0.999",
            "--max-kl-mean", "1.0"]  # fmt: skip
    assert check.main(argv) == 1  # 12 flips of 2,000 (0.994) against 0.999, no floor
    assert "FAIL" in capsys.readouterr().out
    # the upstream run's own floor: 10 flips from a last-bit change; the gate drops to 0.995 - 2 sqrt(11) / 2000
    np.savez_compressed(tmp_path / "upstream" / "logits_floor.npz", logits=_flipped(up, rng, 10), prompt_lens=lens)
    assert check.main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "noise floor" in out and "gating there" in out and "PASS" in out
    # a floor at or above the goal leaves the goal standing
    np.savez_compressed(tmp_path / "upstream" / "logits_floor.npz", logits=up, prompt_lens=lens)
    assert check.main(argv) == 1


def test_ampere_check_gates_top1_at_the_lower_of_its_two_floors(tmp_path: Path, capsys: Any) -> None:
    """The upstream run's attention floor (its attention outputs perturbed by a kernel's own error size) gates too:
    the lower of the two floors (each less two standard deviations of its flips) decides; neither lowers a goal
    it does not fall under."""
    import numpy as np

    rng = np.random.default_rng(secrets.randbits(32))
    n, v = 2000, 64
    up = rng.standard_normal((n, v)).astype(np.float32)
    lens = np.array([n])
    for name, logits in {"upstream": up, "triton": _flipped(up, rng, 30)}.items():
        (tmp_path / name).mkdir()
        np.savez_compressed(tmp_path / name / "logits.npz", logits=logits, prompt_lens=lens)
        np.savez_compressed(tmp_path / name / "layers.npz", layer0=np.zeros(4, np.uint16))
    check = _check_script()
    argv = ["compare", str(tmp_path / "upstream"), str(tmp_path / "triton"), "--min-top1", "0.999",
            "--max-kl-mean", "1.0"]  # fmt: skip
    np.savez_compressed(tmp_path / "upstream" / "logits_floor.npz", logits=_flipped(up, rng, 10), prompt_lens=lens)
    assert check.main(argv) == 1  # 30 flips (0.985) under the expert-sum floor's gate (0.995 - 2 sqrt(11) / 2000)
    capsys.readouterr()
    np.savez_compressed(tmp_path / "upstream" / "logits_attn_floor.npz", logits=_flipped(up, rng, 28),
                        prompt_lens=lens, rel=2.1e-3, achieved=2.5e-3)  # fmt: skip
    assert check.main(argv) == 0  # the attention floor: 28 flips; gate 0.986 - 2 sqrt(29) / 2000 = 0.9806
    out = capsys.readouterr().out
    assert "attention floor" in out and "2.500e-03" in out and "PASS" in out
    np.savez_compressed(tmp_path / "upstream" / "logits_attn_floor.npz", logits=_flipped(up, rng, 5),
                        prompt_lens=lens, rel=2.1e-3, achieved=2.5e-3)  # fmt: skip
    assert check.main(argv) == 1  # a tighter attention floor leaves the expert-sum floor's gate
    assert "FAIL" in capsys.readouterr().out


def test_ampere_check_perturbs_an_attention_output_by_the_asked_size() -> None:
    import torch

    check = _check_script()
    gen = torch.Generator()
    gen.manual_seed(secrets.randbits(32))
    o32 = torch.randn((64, 8, 512), generator=gen)
    for dtype, rel, lo, hi in ((torch.float32, 2.1e-3, 0.9, 1.1), (torch.bfloat16, 2.1e-3, 0.9, 2.5)):
        o = o32.to(dtype)
        before = o.float().clone()
        dd, oo = check.perturb_(o, rel, gen)
        achieved = (dd / oo) ** 0.5
        assert o.dtype == dtype and not torch.equal(o.float(), before)
        assert abs(float((o.float() - before).norm() / before.norm()) - achieved) < 1e-6
        assert lo * rel < achieved < hi * rel, (dtype, achieved)  # bf16: rounding dithers it, about the same size
