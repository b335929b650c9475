"""Checks run before vLLM starts: each returns its problems as sentences; ``preflight`` joins them into one.

vLLM is not imported here, so a server that cannot start says why within a second or two instead of after a
minute of engine start-up (or as a traceback from inside it).
"""

from __future__ import annotations

import dataclasses
import errno
import resource
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import MIN_API_KEY_CHARS, ServerConfig
from .errors import ServerError
from .packs import PackKind

__all__ = [
    "PreflightResult",
    "check_api_key",
    "check_cpu",
    "check_gpu",
    "check_host_ram",
    "check_memlock",
    "check_pack",
    "check_pipeline",
    "check_port",
    "plugin_config",
    "preflight",
]

GiB = 1 << 30
#: Host memory vLLM itself needs beside the pack (engine, API server, tokenizer, activations): measured about
#: 3 GB resident for the tiny demo on CPU; GPU serving adds the CUDA context and pinned staging buffers.
RUNTIME_OVERHEAD = {"cpu": 3 * GiB, "cuda": 8 * GiB}
#: What the CPU expert tier's SIMD kernels need (a V4.1 pack on scalar kernels would be unusably slow).
REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")
MAX_PACK_LINES = 5


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightResult:
    """What preflight learnt that serving needs."""

    api_key: str | None
    pack_info: dict[str, Any]
    warnings: tuple[str, ...] = ()


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


#: pack-tools' mark on a file the manifest does not list (a problem for ``pack-tools verify``, not for serving:
#: vLLM reads only the files the pack's config and index name, except ``*.safetensors`` without an index).
UNTRACKED_MARK = "(untracked file)"


def check_pack(pack: Path) -> tuple[list[str], list[str]]:
    """``pack-tools verify`` of the pack: (problems, warnings).

    Problems are grouped by file: a file's first problem is shown with a count of the rest, which most often
    follow from it (a truncated file damages every tensor after the cut); at most ``MAX_PACK_LINES`` files.
    Untracked files other than ``*.safetensors`` are warnings: they do not stop the server.
    """
    from pack_tools import verify_pack

    by_file: dict[str, list[str]] = {}
    warnings: list[str] = []
    for p in verify_pack(pack):
        name = p.split(": ", 1)[0]
        if p.endswith(UNTRACKED_MARK) and not name.endswith(".safetensors"):
            warnings.append(f"pack {pack}: {p}; the server ignores it")
            continue
        by_file.setdefault(name, []).append(p)
    shown = []
    for name, problems in list(by_file.items())[:MAX_PACK_LINES]:
        more = len(problems) - 1
        tail = f" (+{more} more line{'s' * (more > 1)} about {name}, likely following from this one)" if more else ""
        shown.append(f"pack {pack} fails verification: {problems[0]}{tail}")
    if len(by_file) > MAX_PACK_LINES:
        shown.append(f"... and problems in {len(by_file) - MAX_PACK_LINES} more files")
    if shown:
        shown.append(f"(every problem: pack-tools verify {pack})")
    return shown, warnings


def plugin_config(pack: Path, overrides: Mapping[str, Any]) -> Any:
    """The ``Dsv41PluginConfig`` the engine will build: the pack's ``config.json`` ``dsv41`` plus ``overrides``."""
    import json

    from vllm_dsv41 import CONFIG_KEY, Dsv41PluginConfig
    from vllm_dsv41.config import merge_settings

    try:
        pack_defaults = json.loads((pack / "config.json").read_text()).get(CONFIG_KEY) or {}
    except (OSError, ValueError, AttributeError):
        pack_defaults = {}  # reported by the pack verification
    Dsv41PluginConfig.from_mapping(pack_defaults, f"{pack / 'config.json'} {CONFIG_KEY!r}")
    return Dsv41PluginConfig.from_mapping(merge_settings(pack_defaults, overrides), "plugin settings")


def _pack_config(pack: Path) -> dict[str, Any]:
    import json

    try:
        cfg = json.loads((pack / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # reported by the pack verification
    return cfg if isinstance(cfg, dict) else {}


def check_cpu(plugin: Any, require_simd: bool) -> list[str]:
    """The CPU expert tier can start as configured, with a SIMD kernel variant when ``require_simd``."""
    isa = plugin.cpu.isa
    try:
        from cpu_tier import cpu_features, runnable_isas

        isas = runnable_isas()
        features = cpu_features()
    except ValueError as e:
        return [f"CPU expert tier settings: {e}"]
    except Exception as e:  # the native probe is missing or broken: cpu-tier is not built
        return [f"cannot query the CPU through cpu-tier ({type(e).__name__}: {e}); is cpu-tier built?"]
    if isa != "auto" and isa not in isas:
        return [f"--cpu-isa {isa}: this CPU runs only {', '.join(isas)}"]
    if require_simd and isa in ("auto", "scalar") and isas[0] == "scalar":
        missing = [f for f in REQUIRED_CPU_FEATURES if not features.get(f)]
        return [
            f"this CPU lacks {', '.join(missing) or 'the SIMD features'} that the CPU expert tier's fast kernels "
            f"need ({'+'.join(REQUIRED_CPU_FEATURES)}); only the scalar kernels would run"
        ]
    return []


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_ram(need: int, available: int | None = None) -> list[str]:
    """At least ``need`` bytes of host memory are available (``MemAvailable``)."""
    available = _mem_available() if available is None else available
    if available is None:
        return ["cannot read MemAvailable from /proc/meminfo to check host RAM"]
    if available < need:
        return [f"host RAM: this pack needs about {_gib(need)} and {_gib(available)} is available"]
    return []


def check_memlock(need: int, limit: int | None = None) -> list[str]:
    """The locked-memory limit admits ``need`` bytes of pinned host memory."""
    if limit is None:
        limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if limit == resource.RLIM_INFINITY or limit >= need:
        return []
    return [
        f"locked-memory limit is {_gib(limit)} but the pinned host experts need {_gib(need)}; "
        "raise it (ulimit -l unlimited; docker: --ulimit memlock=-1)"
    ]


def check_gpu(vram_need: int, utilization: float) -> list[str]:
    """A CUDA GPU is visible and ``utilization`` of its memory holds ``vram_need`` bytes of weights."""
    try:
        import torch
    except ImportError as e:
        return [f"this pack needs an NVIDIA GPU, and torch cannot be imported ({e})"]
    if not torch.cuda.is_available():
        return [
            "this pack needs an NVIDIA GPU and none is visible to torch "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
        ]
    _, total = torch.cuda.mem_get_info()
    usable = int(total * utilization)
    if usable < vram_need:
        return [
            f"VRAM: the pack's GPU-resident weights need {_gib(vram_need)}, "
            f"{utilization:.0%} of {torch.cuda.get_device_name()}'s {_gib(total)} is {_gib(usable)}"
        ]
    return []


def check_pipeline(stages: int, plugin: Any, kind: PackKind, pack_config: Mapping[str, Any],
                   gpus: int | None = None) -> list[str]:  # fmt: skip
    """``stages`` pipeline stages can serve this pack: a GPU pack, a GPU per stage (``gpus``: visible CUDA devices,
    None = ask torch), at least one layer per stage, and the CPU tier's cores splittable between the stages
    (``vllm_dsv41.parallel.rank_cpu_config``: its errors name the setting)."""
    from vllm_dsv41.parallel import rank_cpu_config

    problems: list[str] = []
    if stages > 1 and kind.device != "cuda":
        return [f"--pipeline-parallel-size {stages}: pipeline stages run one per GPU, for GPU packs; the "
                f"{kind.name} pack is served by one CPU process"]  # fmt: skip
    if stages > 1:
        if gpus is None:
            try:
                import torch

                gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            except ImportError:
                gpus = 0
        if gpus < stages:
            problems.append(f"--pipeline-parallel-size {stages}: needs {stages} GPUs (one per stage), "
                            f"{gpus} visible")  # fmt: skip
        text = pack_config.get("text_config")
        layers = (text if isinstance(text, Mapping) else pack_config).get("num_hidden_layers")
        if isinstance(layers, int) and layers < stages:
            problems.append(f"--pipeline-parallel-size {stages}: the pack has {layers} layers, fewer than the stages")
    for rank in range(stages):
        try:
            rank_cpu_config(plugin, rank, stages)
        except ValueError as e:
            flag = "--pp-cores" if str(e).startswith("pp_cpus") else "--cpu-cores / --cpu-threads"
            problems.append(f"CPU expert tier cores for {stages} pipeline stage{'s' * (stages > 1)} ({flag}): {e}")
            break
    return problems


def check_api_key(cfg: ServerConfig) -> tuple[str | None, list[str]]:
    """The API key from ``cfg.api_key_file``; required when binding beyond loopback."""
    path = cfg.api_key_file
    if path is None:
        if cfg.loopback:
            return None, []
        return None, [
            f"--host {cfg.host} makes the server reachable from other machines: "
            "give an API key with --api-key-file FILE (a file holding the key, readable only by you)"
        ]
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        return None, [f"--api-key-file {path}: cannot read it ({e.strerror or e})"]
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None, [
            f"--api-key-file {path}: other users can access it (mode {stat.filemode(st.st_mode)}); chmod 600 it"
        ]
    key = text.strip()
    if not key:
        return None, [f"--api-key-file {path}: the file is empty"]
    if any(c.isspace() for c in key):
        return None, [f"--api-key-file {path}: the key must be one line without spaces"]
    if not cfg.loopback and len(key) < MIN_API_KEY_CHARS:
        return None, [
            f"--api-key-file {path}: the key has {len(key)} characters; a server reachable from other machines "
            f"needs at least {MIN_API_KEY_CHARS} (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        ]
    return key, []


def check_port(host: str, port: int) -> list[str]:
    """``host:port`` can be bound now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return [f"{host}:{port} is already in use; choose another --port"]
            return [f"cannot listen on {host}:{port} ({e.strerror or e})"]
    return []


def preflight(cfg: ServerConfig, pack: Path, kind: PackKind) -> PreflightResult:
    """Run every check for serving ``pack`` (of ``kind``) with ``cfg``; raise one ``ServerError`` listing all
    problems, else return what serving needs."""
    from pack_tools import PackError, inspect_pack

    problems: list[str] = []
    api_key, p = check_api_key(cfg)
    problems += p
    problems += check_port(cfg.host, cfg.port)
    pack_problems, warnings = check_pack(pack)
    if not pack_problems:
        from vllm_dsv41.home import expert_problems

        pack_problems = [f"pack {pack}: {p}" for p in expert_problems(pack)[:MAX_PACK_LINES]]
    problems += pack_problems
    info: dict[str, Any] = {}
    if not pack_problems:
        try:
            info = inspect_pack(pack)
        except PackError as e:
            problems.append(f"cannot inspect pack {pack}: {e}")
    try:
        plugin = plugin_config(pack, cfg.plugin_overrides)
    except ValueError as e:
        problems.append(str(e))
    else:
        problems += check_cpu(plugin, require_simd=kind.device == "cuda")
        problems += check_pipeline(cfg.pipeline_parallel_size, plugin, kind, _pack_config(pack))
    if info:
        host = int(info["host_ram_bytes"])
        vram = int(info["vram_bytes"])
        if kind.device == "cpu":
            need = host + vram + cfg.kv_cache_gib * GiB + RUNTIME_OVERHEAD["cpu"]
            problems += check_host_ram(need)
        else:
            problems += check_host_ram(host + RUNTIME_OVERHEAD["cuda"])
            problems += check_memlock(host)
            problems += check_gpu(vram // cfg.pipeline_parallel_size, cfg.gpu_memory_utilization)  # per stage
    if problems:
        head = f"cannot serve {pack} ({kind.name}):"
        raise ServerError(head + "".join(f"\n  - {p}" for p in problems))
    return PreflightResult(api_key=api_key, pack_info=info, warnings=tuple(warnings))
