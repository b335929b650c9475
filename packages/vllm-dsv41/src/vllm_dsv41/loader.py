"""The plugin's model loader (``load_format="dsv41"``): routed experts mapped in place, everything else read.

vLLM's default loader reads every tensor of the checkpoint into memory and hands it to the model. For an EXL3
pack that would copy ~190 GiB of routed experts through Python. This loader instead

1. builds the host home of the experts (``ExpertHome``: the pack's expert byte ranges memory-mapped, and
   page-locked with CUDA on a GPU machine) and gives it to the model's ``Exl3Config``;
2. streams only the other tensors to ``model.load_weights`` (routed experts, and tensors the model's name
   mapper drops, such as MTP and vision weights, are skipped before they are read);
3. logs what it cost: the home's size and time, the dense part's time, the process's resident memory against
   the expert bytes, and what a full-size pack would take at the measured rate.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .home import ExpertHome, expert_tensor, process_memory

logger = init_logger("vllm.dsv41")

__all__ = ["FULL_PACK_EXPERT_BYTES", "LOAD_FORMAT", "Dsv41ModelLoader", "LoadReport"]

#: The ``load_format`` the plugin registers its loader under.
LOAD_FORMAT = "dsv41"
#: The routed experts of a full DeepSeek-V4.1-Flash pack at 3 bpw (pack-tools inspect of the real shape).
FULL_PACK_EXPERT_BYTES = 204_000_000_000
GiB = 1 << 30


class LoadReport(dict[str, Any]):
    """What one load cost (a dict, logged as one line and kept on the model as ``dsv41_load_report``)."""

    def line(self) -> str:
        r = self
        return (
            f"dsv41 load: routed experts {r['expert_bytes'] / GiB:.3f} GiB mapped from {r['home_files']} files in "
            f"{r['home_seconds']:.2f} s ({'page-locked with CUDA' if r['registered'] else 'not page-locked'}, "
            f"{r['home_rate_gbs']:.2f} GB/s); {r['dense_tensors']} other tensors read in {r['dense_seconds']:.2f} s "
            f"({r['dense_bytes'] / GiB:.3f} GiB); RSS after load {r['rss'] / GiB:.3f} GiB (anon "
            f"{r['rss_anon'] / GiB:.3f}, file {r['rss_file'] / GiB:.3f}) = expert bytes + "
            f"{(r['rss'] - r['expert_bytes']) / GiB:+.3f} GiB (goal <= +2 GiB); "
            f"a {FULL_PACK_EXPERT_BYTES / 1e9:.0f} GB "
            f"pack's experts at this rate: {r['full_pack_seconds']:.0f} s"
        )


class Dsv41ModelLoader(DefaultModelLoader):
    """``load_format="dsv41"``: see the module docstring."""

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        self._vllm_config = vllm_config
        return super().load_model(vllm_config, model_config, prefix)

    def download_model(self, model_config: Any) -> None:
        pack = Path(model_config.model)
        if not pack.is_dir():
            raise ValueError(f"{pack}: load_format 'dsv41' serves local packs only (a directory)")

    def load_weights(self, model: Any, model_config: Any) -> None:
        from .quant import Exl3Config

        pack = Path(model_config.model)
        quant = getattr(getattr(self, "_vllm_config", None), "quant_config", None)
        if not isinstance(quant, Exl3Config):
            raise ValueError(f"{pack}: load_format 'dsv41' loads EXL3 packs (quantization_config.quant_method "
                             f"'exl3'), this model's quantization is {type(quant).__name__}")  # fmt: skip
        cfg = quant.plugin_config()
        register = cfg.register_host_memory and torch.cuda.is_available()
        layers = _stage_layers(model, model_config, pack)
        before = process_memory()
        t0 = time.perf_counter()
        home = ExpertHome(pack, register=register, populate=True, layers=layers)
        t1 = time.perf_counter()
        quant.attach_home(home)
        logger.info("dsv41: host home: %s", home.describe())
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        unused = getattr(model, "is_unused_checkpoint_weight", None)
        counts = {"tensors": 0, "bytes": 0}
        loaded = model.load_weights(self._dense_weights(pack, mapper, counts, unused))
        t2 = time.perf_counter()
        del loaded
        mem = process_memory()
        rate = home.stats.expert_bytes / max(t1 - t0, 1e-9)
        report = LoadReport(
            expert_bytes=home.stats.expert_bytes, home_files=home.stats.files, home_seconds=t1 - t0,
            registered=home.registered, home_rate_gbs=rate / 1e9, dense_tensors=counts["tensors"],
            dense_bytes=counts["bytes"], dense_seconds=t2 - t1, rss=mem.get("VmRSS", 0),
            rss_anon=mem.get("RssAnon", 0), rss_file=mem.get("RssFile", 0), rss_before=before.get("VmRSS", 0),
            full_pack_seconds=FULL_PACK_EXPERT_BYTES / rate,
        )  # fmt: skip
        model.dsv41_load_report = report
        logger.info("%s", report.line())

    def _dense_weights(self, pack: Path, mapper: Any, counts: dict[str, int],
                       unused: Any = None) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """Every tensor of the pack but the routed experts, what the model's mapper drops and what the model says
        it does not load (``is_unused_checkpoint_weight``, vLLM's hook), file by file."""
        from safetensors import safe_open

        for path, names in _names_by_file(pack).items():
            keep = [n for n in names if expert_tensor(n) is None and not _dropped(mapper, n)
                    and not (unused is not None and unused(n))]  # fmt: skip
            if not keep:
                continue
            with safe_open(str(path), framework="pt") as f:
                for name in keep:
                    t = f.get_tensor(name)
                    counts["tensors"] += 1
                    counts["bytes"] += t.numel() * t.element_size()
                    yield name, t


def _stage_layers(model: Any, model_config: Any, pack: Path) -> tuple[int, ...] | None:
    """With pipeline parallelism, the MoE layers this stage built (checked against vLLM's partition): its home maps
    only their experts. None with one stage (the home maps every MoE layer of the pack)."""
    from .parallel import check_stage_layers, moe_layers_of, pp_layers, pp_position

    rank, size = pp_position()
    if size == 1:
        return None
    stage = pp_layers(model_config.hf_text_config.num_hidden_layers, rank, size)
    layers = check_stage_layers(moe_layers_of(model), stage, rank, size, pack)
    logger.info("dsv41: pipeline rank %d of %d: decoder layers [%d, %d), routed experts of MoE layers %s mapped",
                rank, size, stage.start, stage.stop, list(layers))  # fmt: skip
    return layers


def _dropped(mapper: Any, name: str) -> bool:
    if mapper is None:
        return False
    try:
        return not mapper.apply_list([name])
    except Exception:  # noqa: BLE001 - a mapper that cannot say keeps the tensor
        return False


def _names_by_file(pack: Path) -> dict[Path, list[str]]:
    index = pack / "model.safetensors.index.json"
    out: dict[Path, list[str]] = defaultdict(list)
    if index.is_file():
        for name, rel in json.loads(index.read_text())["weight_map"].items():
            out[pack / rel].append(name)
        return dict(sorted(out.items()))
    from engram_mmap.safetensors_header import read_header

    for f in sorted(pack.glob("*.safetensors")):
        out[f] = list(read_header(f))
    return dict(out)
