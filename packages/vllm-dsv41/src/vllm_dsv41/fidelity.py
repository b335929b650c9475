"""``python -m vllm_dsv41.fidelity PACK --runtime cpu --against all-in-vram``: one expert runtime against another.

The pack is loaded once; the model runs fixed prompts with the reference runtime, then with the tested one
(switched in place: the model's expert-runtime handle is a slot, so captured CUDA graphs call the new runtime
too), everything else identical. At every prompt position the full next-token distribution is compared:

* top-1 agreement (the two argmaxes are equal),
* KL(reference || tested), mean and max, in float64 from the fp32 logits,
* greedy continuations (``--greedy`` tokens from each of the first prompts) token for token.

The logits are read where vLLM computes them (the model's ``compute_logits``), so nothing is rounded to the
logprobs API's top-k. Prefix caching is off (both runtimes must compute every position).

What cannot be switched in place (where the Engram tables live, ``--engram``, fixed when the model is built) is
compared across two runs: ``--save-reference FILE`` runs only the reference and saves its logits and greedy
tokens; a later run with ``--reference FILE`` compares its ``--runtime`` against them (same pack, prompts and
settings; the prompts are checked). E.g. the served Engram path against the all-in-VRAM oracle::

    python -m vllm_dsv41.fidelity PACK --against all-in-vram --engram upstream --save-reference ref.npz
    python -m vllm_dsv41.fidelity PACK --runtime cpu --engram mmap --reference ref.npz --min-top1 0.999
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cpu_tier.config import PRECISIONS

__all__ = ["FidelityResult", "Reference", "compare_logits", "main", "record_reference", "run_fidelity"]

#: The diagnostic runtime ``--noise-floor`` compares with the oracle: the same dequantized experts, float64 sums.
NOISE_FLOOR_RUNTIME = "all-in-vram-f64"
#: The oracle with every layer dequantized per call (``AllInVramRuntime(dequantize="per-call")``): a check of that
#: path, which must equal the oracle (bit for bit on the CPU, to float32 rounding on CUDA, where cuBLAS may pick
#: other GEMM kernels; ``--runtime all-in-vram-per-call --against all-in-vram``).
PER_CALL_RUNTIME = "all-in-vram-per-call"
#: The runtime a model is built with when one of these oracle variants is the one tested (not config values).
_ORACLE_VARIANTS = {NOISE_FLOOR_RUNTIME: "all-in-vram", PER_CALL_RUNTIME: "all-in-vram"}
#: Text the fixed prompts are cut from (tokenized with the pack's tokenizer).
CORPUS = (
    "The capital of Japan is Tokyo. The capital of France is Paris. A mixture of experts routes each token to a "
    "few experts, and the experts that are used most stay in the cache of the graphics card while the others "
    "are computed by the processor straight from host memory. def add(a, b):\n    return a + b\n"
    "Seventeen times twenty-three is three hundred ninety-one. Engram tables hold hashed n-gram embeddings read "
    'from disk. {"name": "get_weather", "arguments": {"location": "Paris"}} The quick brown fox jumps over the '
    "lazy dog while the prefill streams every expert over the bus in fixed batches. "
)


@dataclasses.dataclass
class FidelityResult:
    runtime: str
    against: str
    positions: int
    top1_agreement: float
    kl_mean: float
    kl_max: float
    greedy_prompts: int
    greedy_tokens: int
    greedy_match: bool
    greedy_first_divergence: list[int | None]
    seconds: dict[str, float]
    greedy_reference: list[list[int]] = dataclasses.field(default_factory=list)
    greedy_runtime: list[list[int]] = dataclasses.field(default_factory=list)
    #: the reference's top-1 minus top-2 logit where the argmaxes differ (largest of them), and the share of all
    #: positions whose reference margin is below that: flips that only happen at near-ties are rounding, not error
    flip_margin_max: float = 0.0
    near_tie_share: float = 0.0
    #: the tested runtime's own counters at the end of its run (the tiered runtime's picks per path, steps, cache
    #: slots), empty for runtimes without them
    runtime_stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def table(self) -> str:
        rows = [
            ("runtime vs reference", f"{self.runtime} vs {self.against}"),
            ("scored positions", str(self.positions)),
            ("top-1 agreement", f"{self.top1_agreement:.6f}"),
            ("KL mean", f"{self.kl_mean:.3e}"),
            ("KL max", f"{self.kl_max:.3e}"),
            ("greedy continuations", f"{'match' if self.greedy_match else 'DIFFER'} ({self.greedy_prompts} x "
                                     f"{self.greedy_tokens} tokens; first divergence {self.greedy_first_divergence})"),
            ("top-1 flips", f"at reference margins <= {self.flip_margin_max:.3g} (logits; {self.near_tie_share:.2%} "
                            "of all positions have a margin that small)"),
        ]  # fmt: skip
        if self.runtime_stats.get("describe"):
            rows.append(("runtime counters", str(self.runtime_stats["describe"])))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def compare_logits(ref: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: whether the argmaxes agree, and KL(ref || test) in float64 (``[N, V]`` logits each)."""
    if ref.shape != test.shape:
        raise ValueError(f"logits shapes differ: {ref.shape} vs {test.shape}")
    a = ref.astype(np.float64)
    b = test.astype(np.float64)
    la = a - a.max(axis=1, keepdims=True)
    la -= np.log(np.exp(la).sum(axis=1, keepdims=True))
    lb = b - b.max(axis=1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(axis=1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(axis=1)
    return a.argmax(axis=1) == b.argmax(axis=1), np.maximum(kl, 0.0)


def make_prompts(tokenizer: Any, positions: int, length: int, bos: int | None) -> list[list[int]]:
    """Fixed prompts of ``length`` tokens (BOS first when the tokenizer has one) covering ``positions``."""
    ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    if not ids:
        raise ValueError("the tokenizer encodes the fixed corpus to nothing")
    n = max(1, math.ceil(positions / length))
    body = length - (bos is not None)
    prompts = []
    for p in range(n):
        start = (p * 97) % len(ids)
        seq = [ids[(start + i) % len(ids)] for i in range(body)]
        prompts.append(([bos] if bos is not None else []) + seq)
    return prompts


# ------------------------------------------------------------------------------ worker-side functions
# Module-level so they pickle into a multiprocess engine; they keep state in the worker process.

_STATE: dict[str, Any] = {"calls": [], "on": False}


def _exl3_config(model: torch.nn.Module) -> Any:
    from .quant import Exl3Config

    for m in model.modules():
        q = getattr(getattr(m, "quant_method", None), "quant_config", None)
        if isinstance(q, Exl3Config):
            return q
    raise RuntimeError("the model has no EXL3 layers (is this a dsv41 pack?)")


def _install(model: Any) -> str:
    if getattr(model, "_dsv41_fidelity", False):
        return "installed"
    orig = model.compute_logits

    def recording(hidden_states: torch.Tensor, *a: Any, **k: Any) -> Any:
        logits = orig(hidden_states, *a, **k)
        if _STATE["on"] and logits is not None:
            _STATE["calls"].append(logits.detach().float().cpu())
        return logits

    model.compute_logits = recording
    model._dsv41_fidelity = True
    return "installed"


def _record(model: torch.nn.Module, on: bool) -> None:
    _STATE["on"] = on
    if on:
        _STATE["calls"] = []


def _take(model: torch.nn.Module) -> list[np.ndarray]:
    calls = [c.numpy() for c in _STATE["calls"]]
    _STATE["calls"] = []
    return calls


def _switch(model: torch.nn.Module, runtime: str) -> str:
    """Make ``runtime`` the model's expert runtime (built from the model's host home)."""
    import dataclasses as dc

    from .experts import make_runtime

    q = _exl3_config(model)
    current, _ = q.expert_runtime()
    if current.name == runtime:
        return runtime
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    if runtime in _ORACLE_VARIANTS:  # the oracle's experts with float64 sums, or all per call (diagnostics)
        from .experts import AllInVramRuntime

        if runtime == NOISE_FLOOR_RUNTIME:
            new: Any = AllInVramRuntime(device, torch.float64)  # (dequantized at load or per call: "auto")
        else:
            new = AllInVramRuntime(device, dequantize="per-call")
    else:
        new = make_runtime(dc.replace(q.rank_plugin_config(), runtime=runtime), device, home=q.home(),
                           activation_dtype=q.activation_dtype)  # fmt: skip
    limits = _swiglu_limits(model)
    for layer in q.home().layers():
        new.add_layer(layer, limits.get(layer.layer))
    if hasattr(new, "allow_cache"):  # the engine is built: its KV cache exists, the tiered cache may allocate
        new.allow_cache()
    old = q.set_runtime(new)
    if old is not None and old is not new:
        old.close()
    return runtime


def _runtime_stats(model: torch.nn.Module) -> dict[str, Any]:
    """The current runtime's counters (``stats``, a dataclass) and cache size, where it has them."""
    rt, _ = _exl3_config(model).expert_runtime()
    stats = getattr(rt, "stats", None)
    if stats is None or not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        return {}
    out: dict[str, Any] = dataclasses.asdict(stats)
    out["describe"] = stats.describe() if hasattr(stats, "describe") else ""
    dec: Any = getattr(rt, "stats_decode", None)  # the tiered runtime's counters of decode-size calls alone
    if getattr(dec, "steps", 0) and hasattr(dec, "describe"):
        out["decode"] = dataclasses.asdict(dec)
        out["describe"] += "; decode-size calls only: " + dec.describe()
    cache = getattr(rt, "cache", None)
    out["cache_slots"] = int(cache.num_slots) if cache is not None else 0
    pf = getattr(rt, "prefill", None)  # the tiered runtime's staged prefill
    if pf is not None:
        out["prefill"] = {**dataclasses.asdict(pf.stats), "violations": list(pf.violations)}
        out["describe"] += "; staged prefill: " + pf.stats.describe()
    return out


def _swiglu_limits(model: torch.nn.Module) -> dict[int, float | None]:
    from .methods import Exl3HostExpertsMethod

    out: dict[int, float | None] = {}
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if isinstance(qm, Exl3HostExpertsMethod):
            out[qm.layer_index] = getattr(m, "swiglu_limit", None)
    return out


# ------------------------------------------------------------------------------------------ driver


@dataclasses.dataclass
class Reference:
    """One runtime's recorded outputs: the logits at every position of each prompt and the greedy tokens."""

    runtime: str
    prompts: list[list[int]]
    logits: list[np.ndarray]
    greedy: list[list[int]]
    greedy_tokens: int
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def save(self, path: str | Path) -> None:
        """Write as ``.npz`` (logits float32, prompts and greedy tokens int64, the rest as JSON)."""
        meta = {"runtime": self.runtime, "greedy_tokens": self.greedy_tokens, "settings": self.settings,
                "prompt_lengths": [len(p) for p in self.prompts], "greedy_lengths": [len(g) for g in self.greedy],
                "seconds": self.seconds}  # fmt: skip
        with open(path, "wb") as f:  # a file object: numpy would append ".npz" to a path without it
            np.savez(f, meta=np.array(json.dumps(meta)), logits=np.concatenate(self.logits).astype(np.float32),
                     prompts=np.array([t for p in self.prompts for t in p], np.int64),
                     greedy=np.array([t for g in self.greedy for t in g], np.int64))  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> Reference:
        """Read what :meth:`save` wrote; a file of another shape raises ValueError naming it."""
        try:
            with np.load(path) as z:
                meta = json.loads(str(z["meta"]))
                logits, prompts, greedy = z["logits"], z["prompts"], z["greedy"]
            lengths, glengths = meta["prompt_lengths"], meta["greedy_lengths"]
            if sum(lengths) != prompts.size or sum(lengths) != logits.shape[0] or sum(glengths) != greedy.size:
                raise ValueError("its arrays do not match its prompt and greedy lengths")
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a fidelity reference ({e})") from None
        cuts = np.cumsum(lengths)[:-1]
        gcuts = np.cumsum(glengths)[:-1]
        return cls(runtime=meta["runtime"], prompts=[p.tolist() for p in np.split(prompts, cuts)],
                   logits=list(np.split(logits, cuts)), greedy=[g.tolist() for g in np.split(greedy, gcuts)],
                   greedy_tokens=int(meta["greedy_tokens"]), settings=dict(meta.get("settings", {})),
                   seconds=float(meta.get("seconds", 0.0)))  # fmt: skip


def _prompts(llm: Any, positions: int, length: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return make_prompts(tok, positions, length, getattr(tok, "bos_token_id", None))


def record_reference(llm: Any, runtime: str, *, positions: int = 2048, length: int = 256, greedy_prompts: int = 4,
                     greedy_tokens: int = 32, settings: dict[str, Any] | None = None) -> Reference:  # fmt: skip
    """Run ``runtime`` on the fixed prompts of an already built ``LLM``: its logits and greedy tokens."""
    from vllm import SamplingParams

    llm.apply_model(_install)
    prompts = _prompts(llm, positions, length)
    greedy = SamplingParams(max_tokens=greedy_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.apply_model(functools.partial(_switch, runtime=runtime))
    logits = [_logits_of(llm, p) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:greedy_prompts]], greedy, use_tqdm=False)
    return Reference(runtime=runtime, prompts=prompts, logits=logits,
                     greedy=[list(o.outputs[0].token_ids) for o in outs], greedy_tokens=greedy_tokens,
                     settings=dict(settings or {}), seconds=time.perf_counter() - t0)  # fmt: skip


def _logits_of(llm: Any, ids: list[int]) -> np.ndarray:
    """The next-token logits at every position of ``ids`` (``[len(ids), V]``)."""
    from vllm import SamplingParams

    llm.apply_model(functools.partial(_record, on=True))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                 use_tqdm=False)  # fmt: skip
    llm.apply_model(functools.partial(_record, on=False))
    per_worker = [c for c in llm.apply_model(_take) if c]  # with pipeline stages only the last computes logits
    if len(per_worker) != 1:
        raise RuntimeError(f"expected the logits of one worker (the last pipeline stage), got {len(per_worker)}")
    calls = per_worker[0]
    n = len(ids)
    ones = [i for i, c in enumerate(calls) if c.shape[0] == 1]
    if not ones:
        raise RuntimeError(f"no sampling-logits call among {[c.shape[0] for c in calls]} rows")
    last = calls[ones[-1]]
    prompt = [c for i, c in enumerate(calls) if i != ones[-1]]
    rows = sum(c.shape[0] for c in prompt)
    if rows == n:  # vLLM's model runner V2 scores every prompt position, the last one included
        # (its last row is the sampled position again, from a batch of a different size: a bf16 head's rounding
        # differs between the two, so the prompt pass's own row is kept: every position from one batch)
        return np.concatenate(prompt, axis=0)
    if rows == n - 1:  # runner V1: positions 0..n-2, then the sampled position
        return np.concatenate([*prompt, last], axis=0)
    raise RuntimeError(
        f"expected {n - 1} or {n} prompt-logit rows for a {n}-token prompt, got calls of "
        f"{[c.shape[0] for c in calls]} rows"
    )


def run_fidelity(
    llm: Any,
    runtime: str,
    against: str,
    *,
    positions: int = 2048,
    length: int = 256,
    greedy_prompts: int = 4,
    greedy_tokens: int = 32,
    reference: Reference | None = None,
) -> FidelityResult:
    """Compare ``runtime`` against ``against`` on an already built ``LLM`` of a dsv41 pack.

    ``reference``: ``against``'s outputs recorded before (``record_reference``, possibly by another run with other
    build settings); its prompts must be this run's. The engine must run in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``main`` sets) or accept pickled callables: the comparison reaches
    into the model with ``LLM.apply_model``.
    """
    kw: dict[str, Any] = dict(positions=positions, length=length, greedy_prompts=greedy_prompts,
                              greedy_tokens=greedy_tokens)  # fmt: skip
    in_process = reference is None
    if reference is None:
        reference = record_reference(llm, against, **kw)
    else:
        if reference.prompts != _prompts(llm, positions, length):
            raise ValueError("the reference was recorded on other prompts (another pack, tokenizer, --positions "
                             "or --length)")  # fmt: skip
        want = min(greedy_prompts, len(reference.prompts))
        if reference.greedy_tokens != greedy_tokens or len(reference.greedy) != want:
            raise ValueError(f"the reference has {len(reference.greedy)} greedy continuations of "
                             f"{reference.greedy_tokens} tokens, this run asks for {greedy_prompts} x "
                             f"{greedy_tokens}")  # fmt: skip
        against = reference.runtime
    tested = record_reference(llm, runtime, **kw)
    stats = llm.apply_model(_runtime_stats)[0]
    if in_process:  # back to the reference runtime: closes the tested one (a tiered runtime writes its trace)
        llm.apply_model(functools.partial(_switch, runtime=against))
    seconds = {against: reference.seconds, runtime: tested.seconds}
    ref_logits, ref_greedy = reference.logits, reference.greedy
    test_logits, test_greedy = tested.logits, tested.greedy
    ref_all = np.concatenate(ref_logits)
    agree, kl = compare_logits(ref_all, np.concatenate(test_logits))
    top2 = np.sort(ref_all.astype(np.float64), axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    flip_margin = float(margin[~agree].max()) if (~agree).any() else 0.0
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
             for x, y in zip(ref_greedy, test_greedy, strict=True)]  # fmt: skip
    return FidelityResult(
        runtime=runtime, against=against, positions=int(agree.size), top1_agreement=float(agree.mean()),
        kl_mean=float(kl.mean()), kl_max=float(kl.max()), greedy_prompts=len(ref_greedy),
        greedy_tokens=greedy_tokens, greedy_match=all(f is None for f in first), greedy_first_divergence=first,
        seconds=seconds, greedy_reference=ref_greedy, greedy_runtime=test_greedy, flip_margin_max=flip_margin,
        near_tie_share=float((margin <= flip_margin).mean()) if flip_margin else 0.0, runtime_stats=stats,
    )  # fmt: skip


def build_llm(pack: str | Path, *, runtime: str = "all-in-vram", eager: bool = False, max_model_len: int = 1024,
              gpu_memory_gib: float | None = None, cpu_threads: int = 0, precision: str | None = None,
              dtype: str | None = None, extra: dict[str, Any] | None = None,
              tiered: dict[str, Any] | None = None, engram: str | None = None,
              pipeline_parallel_size: int = 1) -> Any:  # fmt: skip
    """An ``LLM`` of a dsv41 pack, set up the way the server runs it (loader, text-only, PIECEWISE graphs);
    ``tiered``: the tiered runtime's settings (``TieredConfig`` fields); ``engram``: where V4.1's Engram tables
    live (``Dsv41PluginConfig.engram``; None: the pack's setting); ``pipeline_parallel_size``: vLLM's pipeline
    stages (one GPU each; on vLLM's CPU build, one process each, which needs ``VLLM_CPU_OMP_THREADS_BIND`` set
    when the host has one NUMA node)."""
    from vllm import LLM

    pack = Path(pack)
    cfg = json.loads((pack / "config.json").read_text())
    v41 = "DeepseekV41ForCausalLM" in (cfg.get("architectures") or [])
    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {
        "model": str(pack),
        "load_format": "dsv41",
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "seed": 0,
        "additional_config": {"dsv41": {"runtime": runtime, "cpu": {"threads": cpu_threads}}},
    }
    if precision is not None:  # else the pack's setting, else the plugin's default ("auto": by the model's dtype)
        kw["additional_config"]["dsv41"]["cpu"]["precision"] = precision
    if tiered:
        kw["additional_config"]["dsv41"]["tiered"] = dict(tiered)
    if engram is not None:
        kw["additional_config"]["dsv41"]["engram"] = engram
    kw["dtype"] = dtype or ("bfloat16" if cuda else "float32")
    if v41:
        kw["limit_mm_per_prompt"] = {"image": 0}
    if eager or not cuda:
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    if cuda and gpu_memory_gib:
        kw["gpu_memory_utilization"] = gpu_memory_gib * (1 << 30) / torch.cuda.get_device_properties(0).total_memory
    if not cuda:
        kw["kv_cache_memory_bytes"] = 1 << 30  # vLLM-CPU otherwise reserves most of the host's memory
    if pipeline_parallel_size != 1:
        kw["pipeline_parallel_size"] = pipeline_parallel_size
        if not cuda:
            # vLLM 0.32's CPU model runner skips its warm-up run when eager (CompilationMode.NONE), and that run is
            # what allocates a later pipeline stage's intermediate-tensor buffer (AssertionError in
            # sync_and_gather_intermediate_tensors at the first step): trace once with dynamo, run eagerly.
            del kw["enforce_eager"]
            kw["compilation_config"] = {"mode": 2, "backend": "eager"}  # DYNAMO_TRACE_ONCE, eager backend
    kw.update(extra or {})
    return LLM(**kw)


def noise_floor_gate(min_top1: float, floor_top1: float, positions: int) -> float:
    """The top-1 gate a runtime can be held to on a model whose noise floor is ``floor_top1`` over ``positions``.

    No runtime can be asked to agree with the oracle better than the oracle agrees with itself when only the order
    of its float sums changes (the noise floor, ``--noise-floor``); and the floor is one sample: its flip count
    ``n`` (near-ties that a last-bit change turns over) varies from run to run by about ``sqrt(n)``, as does the
    tested runtime's. So where the floor is below ``min_top1`` the gate is the floor less two standard deviations
    of that count (``2 sqrt(n + 1)`` positions); where the floor reaches ``min_top1``, ``min_top1`` stands.
    Run 3 (H200): the staged prefill flipped 17 of 2,048 positions, the floor 15, both only at reference margins
    <= 0.109, with a mean KL below the floor's (1.76e-5 vs 1.94e-5): a gate at the floor itself failed it on
    sampling alone.
    """
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    if floor_top1 >= min_top1:
        return min_top1
    flips = round((1.0 - floor_top1) * positions)
    return floor_top1 - 2.0 * math.sqrt(flips + 1) / positions


def main(argv: list[str] | None = None) -> int:
    # The tool drives the model through ``LLM.apply_model``: run the engine in this process (a callable cannot
    # cross vLLM's engine-process boundary without pickle fallback). Set before vLLM is imported.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ap = argparse.ArgumentParser(prog="python -m vllm_dsv41.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("pack", help="the pack directory")
    ap.add_argument("--runtime", default="cpu",
                    help=f"the expert runtime under test (default cpu; also {PER_CALL_RUNTIME}, the oracle "
                         f"dequantizing every expert per call, or {NOISE_FLOOR_RUNTIME})")  # fmt: skip
    ap.add_argument("--against", default="all-in-vram", help="the reference runtime (default all-in-vram)")
    ap.add_argument("--positions", type=int, default=2048, help="scored prompt positions (default 2048)")
    ap.add_argument("--length", type=int, default=256, help="tokens per prompt (default 256)")
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (default: PIECEWISE on a GPU)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--gpu-memory-gib", type=float, default=None, help="cap vLLM's GPU memory (e.g. 24)")
    ap.add_argument("--cpu-threads", type=int, default=0)
    ap.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="the CPU tier's precision (default: the pack's setting, else the plugin's: \"auto\", fast for "
                    "a bf16/fp16 model, exact for a float32 one)")  # fmt: skip
    ap.add_argument("--noise-floor", action="store_true",
                    help=f"also compare {NOISE_FLOOR_RUNTIME} (the oracle's experts, float64 sums) with the reference: "
                         "what last-bit differences in the experts' output alone do to this model")  # fmt: skip
    ap.add_argument("--tiered", type=json.loads, default=None, metavar="JSON",
                    help='the tiered runtime\'s settings, e.g. \'{"cache_gib": 2, "split": "auto"}\'')  # fmt: skip
    ap.add_argument("--engram", choices=("mmap", "upstream"), default=None,
                    help="where V4.1's Engram tables live (Dsv41PluginConfig.engram; default: the pack's)")  # fmt: skip
    ap.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                    help="vLLM pipeline stages (one GPU each); compare with a --save-reference of 1 stage")  # fmt: skip
    ap.add_argument("--save-reference", type=Path, metavar="FILE",
                    help="run only the reference (--against); save its logits and greedy tokens to FILE")  # fmt: skip
    ap.add_argument("--reference", type=Path, metavar="FILE",
                    help="compare --runtime against a reference saved by --save-reference (not --against)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the result as JSON")
    ap.add_argument("--min-top1", type=float, default=None, help="exit 1 when top-1 agreement is below this")
    ap.add_argument("--max-kl-mean", type=float, default=None, help="exit 1 when the mean KL is above this")
    a = ap.parse_args(argv)
    from .config import vllm_env_for_pack

    for k, v in vllm_env_for_pack(a.pack, cuda_graphs=not a.eager).items():
        os.environ.setdefault(k, v)  # before vLLM is imported (see vllm_env_for_pack)
    if a.save_reference and a.reference:
        ap.error("--save-reference and --reference exclude each other")
    reference = Reference.load(a.reference) if a.reference else None
    # The model is built with the runtime under test: how the model calls its expert runtime is fixed when it is
    # built (with CUDA graphs a graph-safe runtime's calls are captured, and no other runtime could replace it),
    # while the graph-safe reference runs in the tested runtime's eager breaks (experts.call_path).
    built = a.against if a.save_reference else a.runtime
    llm = build_llm(a.pack, runtime=_ORACLE_VARIANTS.get(built, built), eager=a.eager,
                    max_model_len=a.max_model_len, gpu_memory_gib=a.gpu_memory_gib, cpu_threads=a.cpu_threads,
                    precision=a.precision, tiered=a.tiered, engram=a.engram,
                    pipeline_parallel_size=a.pipeline_parallel_size)  # fmt: skip
    kw: dict[str, Any] = dict(positions=a.positions, length=a.length, greedy_prompts=a.greedy_prompts,
                              greedy_tokens=a.greedy_tokens)  # fmt: skip
    if a.save_reference:
        settings = {"pack": str(a.pack), "engram": a.engram, "eager": a.eager, "precision": a.precision,
                    "pipeline_parallel_size": a.pipeline_parallel_size}  # fmt: skip
        ref = record_reference(llm, a.against, settings=settings, **kw)
        ref.save(a.save_reference)
        print(f"reference {a.against} ({settings}): {sum(x.shape[0] for x in ref.logits)} positions, "
              f"{len(ref.greedy)} greedy continuations -> {a.save_reference}", flush=True)  # fmt: skip
        return 0
    res = run_fidelity(llm, a.runtime, a.against, reference=reference, **kw)
    if reference is not None:
        print(f"reference from {a.reference}: {reference.runtime} ({reference.settings}); tested: {a.runtime} "
              f"(engram {a.engram or 'as the pack says'}, {a.pipeline_parallel_size} pipeline stages)",
              flush=True)  # fmt: skip
    print(res.table(), flush=True)
    doc: dict[str, Any] = dataclasses.asdict(res)
    min_top1 = a.min_top1
    if a.noise_floor:
        floor = run_fidelity(llm, NOISE_FLOOR_RUNTIME, a.against, positions=a.positions, length=a.length,
                             greedy_prompts=a.greedy_prompts, greedy_tokens=a.greedy_tokens)  # fmt: skip
        print("\nnoise floor (the oracle's experts with float64 sums, against the oracle):", flush=True)
        print(floor.table(), flush=True)
        doc["noise_floor"] = dataclasses.asdict(floor)
        if min_top1 is not None:
            gate = noise_floor_gate(min_top1, floor.top1_agreement, floor.positions)
            if gate < min_top1:
                print(f"\ntop-1 gate: {min_top1} is above what the noise floor allows ({floor.top1_agreement:.6f}, "
                      f"less two standard deviations of its flip count: {gate:.6f}); gating there",
                      flush=True)  # fmt: skip
                min_top1 = gate
    doc["gate"] = {"min_top1": min_top1, "max_kl_mean": a.max_kl_mean}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2))
    bad = (min_top1 is not None and res.top1_agreement < min_top1) or (
        a.max_kl_mean is not None and res.kl_mean > a.max_kl_mean
    )
    print(f"gate (top-1 >= {min_top1}, KL mean <= {a.max_kl_mean}): {'FAIL' if bad else 'pass'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
