"""What kind of pack a directory holds, how to serve each kind, and the tiny-demo pack's cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

from .config import ServerConfig
from .errors import ServerError

__all__ = ["DEMO", "KINDS", "V41", "PackKind", "ensure_demo_pack", "kind_vllm_args", "kind_vllm_env", "pack_kind"]

log = logging.getLogger("dsv41_server")


@dataclasses.dataclass(frozen=True, slots=True)
class PackKind:
    """How packs of one architecture are served."""

    name: str
    architectures: tuple[str, ...]
    device: str  # "cpu" or "cuda"
    dtype: str
    served_model_name: str
    max_model_len: int
    tool_call_parser: str
    reasoning_parser: str
    extra_vllm_args: tuple[str, ...] = ()


#: The tiny demo (Qwen3-MoE layout): its chat template writes Qwen3's ``<think>`` and JSON-in-``<tool_call>``
#: tool calls, which vLLM's ``qwen3`` reasoning parser and ``hermes`` tool parser read. float32 on CPU (bf16 attention
#: kernels crash on some AMX CPUs; see ../shared/reference/cpu-ci-feasibility.md), eager mode (torch.compile
#: would add ~45 s to every start on a small machine for a model this size).
DEMO = PackKind(
    name="tiny-demo",
    architectures=("Dsv41DemoForCausalLM",),
    device="cpu",
    dtype="float32",
    served_model_name="tiny-demo",
    max_model_len=2048,
    tool_call_parser="hermes",
    reasoning_parser="qwen3",
    extra_vllm_args=(
        "--enforce-eager",
        "--load-format",
        "dsv41",
        "--default-chat-template-kwargs",
        json.dumps({"enable_thinking": False}),
    ),
)

#: DeepSeek-V4.1-Flash EXL3 packs: vLLM's own V4.1 model (the plugin's subclass under its name), tokenizer mode and
#: parsers, on a GPU; text only; the plugin's loader (routed experts mapped from the pack, never read through vLLM);
#: PIECEWISE CUDA graphs (the routed-expert op is an eager break: FULL graphs would capture the CPU tier).
V41 = PackKind(
    name="deepseek-v4.1",
    architectures=("DeepseekV41ForCausalLM", "DeepseekV41LLMForCausalLM"),
    device="cuda",
    dtype="bfloat16",
    served_model_name="deepseek-v4.1-flash",
    max_model_len=65536,
    tool_call_parser="deepseek_v41",
    reasoning_parser="deepseek_v41",
    extra_vllm_args=(
        "--tokenizer-mode",
        "deepseek_v41",
        "--load-format",
        "dsv41",
        "--limit-mm-per-prompt",
        json.dumps({"image": 0}),
        "--compilation-config",
        json.dumps({"cudagraph_mode": "PIECEWISE"}),
    ),
)

KINDS: tuple[PackKind, ...] = (DEMO, V41)


# ------------------------------------------------------------------- per-kind vLLM arguments: the one place
# Everything that differs between pack kinds in how vLLM is started is built here (from the kinds above and
# the server's settings); serve.py adds only what every kind shares (model, host, port, plugin settings).


def kind_vllm_args(kind: PackKind, cfg: ServerConfig) -> list[str]:
    """The vLLM server arguments that depend on the pack kind."""
    argv = [
        "--dtype", kind.dtype,
        "--max-model-len", str(cfg.max_model_len or kind.max_model_len),
        "--tool-call-parser", kind.tool_call_parser,
        "--reasoning-parser", kind.reasoning_parser,
        *kind.extra_vllm_args,
    ]  # fmt: skip
    if kind.device == "cuda":
        from vllm_dsv41.config import DEFAULT_PREFILL_CHUNK_TOKENS

        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        argv += ["--max-num-batched-tokens", str(cfg.prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK_TOKENS)]
    elif cfg.prefill_chunk_tokens is not None:
        argv += ["--max-num-batched-tokens", str(cfg.prefill_chunk_tokens)]
    return argv


def kind_vllm_env(kind: PackKind, cfg: ServerConfig) -> dict[str, str]:
    """The vLLM environment variables that depend on the pack kind."""
    env: dict[str, str] = {}
    if kind.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        # vLLM always runs the engine core in a process of its own (the API server talks to it over ZMQ); this
        # puts the model worker inside that engine-core process instead of a third process.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif cfg.pack is not None:
        from vllm_dsv41 import vllm_env_for_pack

        # what the plugin needs vLLM to see before vLLM is imported (V4.1 with CUDA graphs: breakable graphs on)
        env.update(vllm_env_for_pack(cfg.pack))
    return env


def pack_kind(pack: Path) -> PackKind:
    """The kind of the pack at ``pack``, from ``config.json`` ``architectures``."""
    cfg_path = pack / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ServerError(f"{cfg_path}: missing; {pack} is not a pack") from None
    except (OSError, ValueError) as e:
        raise ServerError(f"{cfg_path}: unreadable ({e})") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    for kind in KINDS:
        if arch in kind.architectures:
            return kind
    known = [a for k in KINDS for a in k.architectures]
    raise ServerError(f"{cfg_path}: architecture {arch!r} is not one this server serves ({', '.join(known)})")


def _looks_like_demo(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text()).get("architectures") == list(DEMO.architectures)
    except (OSError, ValueError, AttributeError):
        return False


def _stale_settings(demo_dir: Path) -> list[str]:
    """The cached demo's plugin settings (config.json ``dsv41``) as this version reads them: [] if they parse,
    else the reason (a pack built by an older version keeps its old settings' shape)."""
    from vllm_dsv41.config import CONFIG_KEY, Dsv41PluginConfig

    try:
        cfg = json.loads((demo_dir / "config.json").read_text())
        Dsv41PluginConfig.from_mapping(cfg.get(CONFIG_KEY, {}), f"{demo_dir / 'config.json'} {CONFIG_KEY!r}")
    except (OSError, ValueError) as e:
        return [str(e)]
    return []


def ensure_demo_pack(demo_dir: Path, seed: int = 0) -> Path:
    """Reuse the tiny-demo pack in ``demo_dir`` if it verifies, else (re)build it there.

    A directory that exists but holds something other than a tiny-demo pack is never deleted.
    """
    from pack_tools import verify_pack
    from pack_tools.presets.tiny_demo import synth_tiny_demo

    if demo_dir.exists():
        if demo_dir.is_dir() and not any(demo_dir.iterdir()):
            demo_dir.rmdir()
        elif not _looks_like_demo(demo_dir):
            raise ServerError(f"{demo_dir}: exists and is not a tiny-demo pack; pass another --demo-dir or remove it")
        else:
            problems = verify_pack(demo_dir) or _stale_settings(demo_dir)
            if not problems:
                log.info("reusing the tiny-demo pack in %s", demo_dir)
                return demo_dir
            log.warning("the cached tiny-demo pack is damaged or from an older version (%s); rebuilding it",
                        problems[0])  # fmt: skip
            shutil.rmtree(demo_dir)
    log.info("building the tiny-demo pack in %s", demo_dir)
    return synth_tiny_demo(demo_dir, seed=seed)
