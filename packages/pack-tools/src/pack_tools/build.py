"""``build_pack``: the overlay pack the server loads, from the EXL3 checkpoint and the Engram shards.

The pack (reference-system.md section 8, our own implementation), and the module that makes each part:

* links (never copies) to every file of the EXL3 checkpoint except the ones the pack writes itself
  (:data:`pack_tools.model_config.WRITTEN_BY_PACK`), and to the two Engram shards
  (``engram-model-000NN-of-00048.safetensors``) - :mod:`pack_tools.staging`;
* ``woa-<root>.safetensors`` and ``native-dense.safetensors``: EXL3 linears reconstructed to FP16 with
  ``cpu_tier.exl3`` (no GPU) - :mod:`pack_tools.reconstruct`;
* ``config.json`` (text-only architecture, EXL3 quantization config at the top level and in ``text_config``),
  ``quantization_config.json`` - :mod:`pack_tools.model_config`;
* ``model.safetensors.index.json`` (every tensor the server loads, merged over the linked shards and the
  generated files) and ``host-plan.json`` (the host-resident routed experts per MoE layer) -
  :mod:`pack_tools.layout`;
* ``pack.json``: what was built from what (here); ``manifest.json``: hashes of everything, written last -
  :mod:`pack_tools.manifest`.

Inputs are scanned and checked by :mod:`pack_tools.inputs`. The build runs in ``<out>.partial-<fingerprint>``
beside ``out`` and is renamed to ``out`` only when complete (:mod:`pack_tools.staging`): an interrupted build
leaves only the partial directory (which ``verify`` rejects); running the same build again resumes it,
keeping every decoded file whose recorded hash still matches.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pack_tools.config import PackConfig
from pack_tools.errors import PackError
from pack_tools.inputs import (
    INPUT_RECEIPT,
    BuildInputs,
    fingerprint,
    fingerprint_inputs,
    input_info,
    known_input_sha256,
    read_inputs,
)
from pack_tools.layout import HOST_PLAN, host_plan, write_index
from pack_tools.manifest import MANIFEST_NAME, write_manifest
from pack_tools.model_config import WRITTEN_BY_PACK, write_model_config
from pack_tools.reconstruct import DecodePlan, plan_decoding, run_decoding
from pack_tools.st import atomic_write_json
from pack_tools.staging import link, open_partial, publish

__all__ = ["INPUT_RECEIPT", "PACK_INFO", "build_pack", "fingerprint_inputs"]

PACK_INFO = "pack.json"

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    return None


def build_pack(
    exl3_dir: str | os.PathLike[str],
    engram_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    config: PackConfig | None = None,
    force: bool = False,
    jobs: int = 1,
    progress: bool = False,
    log: Log | None = None,
) -> Path:
    """Build the pack ``out`` from the EXL3 checkpoint ``exl3_dir`` and the Engram release ``engram_dir``.

    Parameters
    ----------
    exl3_dir : directory of the EXL3 checkpoint (config.json, shards, tokenizer files).
    engram_dir : directory holding the original release's ``model.safetensors.index.json`` and the shards with
        the Engram tables.
    out : the pack directory to create.
    config : build settings (:class:`PackConfig`).
    force : replace an existing ``out`` (atomically: the old pack stays in place until the new one is done).
    jobs : worker processes for the EXL3 -> FP16 decoding (one task per ``wo_a`` root or dense module); the
        output does not depend on it.
    progress : show a progress bar on stderr.
    log : receives one line per build step.

    Returns
    -------
    ``out`` as a Path.

    Raises
    ------
    PackError naming the file, tensor or field at fault for any bad input, or when ``out`` exists and
    ``force`` is false.
    """
    from pack_tools import __version__

    cfg = config or PackConfig()
    say = log or _quiet
    if jobs < 1:
        raise PackError(f"jobs: must be at least 1, got {jobs}")
    exl3 = Path(exl3_dir).resolve()
    engram = Path(engram_dir).resolve()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out = out.parent.resolve() / out.name  # physical paths on both sides, so relative links resolve
    if out.exists() and not force:
        raise PackError(f"{out}: already exists (use --force to rebuild it)")

    inputs = read_inputs(exl3, engram)
    fp = fingerprint(inputs.ex, inputs.en, cfg, __version__)
    partial, state = open_partial(out, fp, say)

    # ---- links to every input file the pack does not write itself
    link_names: dict[str, Path] = {}
    for rel in inputs.ex.files:
        if rel not in WRITTEN_BY_PACK:
            link_names[rel] = exl3 / rel
    engram_links: dict[str, str] = {}
    for file in sorted(set(inputs.engram_keys.values())):
        name = cfg.engram_link_prefix + Path(file).name
        if name in link_names:
            raise PackError(f"{exl3.name}/{name}: collides with the Engram link name; choose another prefix")
        link_names[name] = engram / file
        engram_links[file] = name
    for name, target in link_names.items():
        link(partial / name, target, cfg.link_mode)
    say(f"linked {len(link_names)} input files")

    # ---- FP16 reconstructions (in this process, or in `jobs` worker processes)
    plan = plan_decoding(inputs.where, inputs.tc, cfg.predecode)
    clash = plan.generated & set(link_names)
    if clash:
        raise PackError(f"{exl3.name}/{min(clash)}: input file name collides with a generated file")
    run_decoding(plan, exl3, inputs.where, inputs.tc, partial, state, jobs=jobs, progress=progress, say=say)

    # ---- index, config, quantization config, host plan
    weight_map = write_index(partial, inputs, plan, engram_links)
    quant = write_model_config(
        partial, inputs.source_cfg, inputs.tc, plan.modules, inputs.where, inputs.ex.headers,
        plan.predecoded_sources, cfg.text_architecture,
    )  # fmt: skip
    hplan = host_plan(weight_map, inputs.tc.get("num_hidden_layers"), cfg.host_experts)
    atomic_write_json(partial / HOST_PLAN, hplan)

    # ---- pack.json (what was built from what), then the manifest, then the rename
    atomic_write_json(
        partial / PACK_INFO,
        _pack_info(__version__, fp, cfg, inputs, plan, weight_map, link_names, quant, hplan),
    )
    state.path.unlink(missing_ok=True)
    write_manifest(partial, known_sha256=known_input_sha256(inputs, link_names, engram_links),
                   hash_links=cfg.hash_inputs)  # fmt: skip
    say(f"wrote {MANIFEST_NAME}")
    publish(partial, out)
    say(f"pack ready: {out}")
    return out


def _pack_info(
    version: str,
    fp: str,
    cfg: PackConfig,
    inputs: BuildInputs,
    plan: DecodePlan,
    weight_map: dict[str, str],
    link_names: dict[str, Path],
    quant: dict[str, Any],
    hplan: dict[str, list[int]],
) -> dict[str, Any]:
    """``pack.json``: the tool, fingerprint and settings, the inputs, counts, and what was generated."""
    return {
        "format": "pack-tools-pack",
        "version": 1,
        "built_by": f"pack-tools {version}",
        "fingerprint": fp,
        "config": dataclasses.asdict(cfg),
        "inputs": {
            "exl3": input_info(inputs.ex),
            "engram": input_info(inputs.en),
        },
        "counts": {
            "indexed_tensors": len(weight_map),
            "linked_files": len(link_names),
            "dense_exl3_modules": len(quant["non_routed_exl3"]["layers"]),
            "woa_roots": len(plan.roots),
            "native_dense_tensors": len(plan.dense_predecode),
            "host_plan_layers": len(hplan),
        },
        "generated": {
            "woa": {plan.woa_files[r]: f"{r}.attn.wo_a.weight" for r in plan.roots},
            "native_dense": [f"{p}.weight" for p in plan.dense_predecode],
            "note": "FP16 [out, in] reconstructions of EXL3 linears with cpu_tier.exl3 (float64 inside, "
            "rounded to fp16 once); wo_a is the concatenation of its o_groups slices along dim 0.",
        },
    }
