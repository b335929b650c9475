"""The ``pack-tools`` command line: download, build, verify, inspect, synth.

Exit codes: 0 success; 1 ``verify`` found problems; 2 bad usage or bad input (the message names the file,
tensor or field); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pack_tools.errors import PackError

__all__ = ["main"]


def _err(msg: str) -> None:
    print(f"pack-tools: error: {msg}", file=sys.stderr)


def _log(quiet: bool):
    if quiet:
        return None
    from tqdm import tqdm

    return lambda msg: tqdm.write(f"pack-tools: {msg}", file=sys.stderr)  # keeps progress bars intact


def _parser() -> argparse.ArgumentParser:
    from pack_tools import __version__
    from pack_tools.origin import ENGRAM, EXL3, PACK_DIRNAME
    from pack_tools.presets import PRESETS

    p = argparse.ArgumentParser(
        prog="pack-tools",
        description="Download, build, verify, inspect and synthesize DeepSeek-V4.1-Flash EXL3 model packs.",
    )
    p.add_argument("--version", action="version", version=f"pack-tools {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser(
        "download",
        help="download the pinned inputs (resumable, only the needed files)",
        description=(
            f"Download {EXL3.repo_id}@{EXL3.revision[:12]} (EXL3 checkpoint, ~{EXL3.approx_bytes / 1e9:.0f} GB) "
            f"and {ENGRAM.repo_id}@{ENGRAM.revision[:12]} (Engram shards 47-48 + index + config, "
            f"~{ENGRAM.approx_bytes / 1e9:.0f} GB) into MODELS_ROOT/<name>. Interrupted downloads resume."
        ),
    )
    d.add_argument("--models-root", type=Path, required=True, help="directory receiving one folder per input")
    d.add_argument("--only", choices=["exl3", "engram"], action="append", help="download only this input (repeatable)")
    d.add_argument("--token-file", type=Path, help="file holding a Hugging Face token (never pass it inline)")
    d.add_argument("--workers", type=int, default=8, help="parallel file downloads (default 8)")
    d.add_argument("--dry-run", action="store_true", help="list the files and sizes, download nothing")
    d.add_argument("--quiet", action="store_true")

    b = sub.add_parser(
        "build",
        help="build the overlay pack from the two inputs",
        description=(
            "Build the pack: links to the input shards, merged index, text-only config, FP16 pre-decoded "
            "wo_a / compressor / indexer projections (decoded on the CPU), host plan, manifest. The build runs "
            "in OUT.partial-<id> and is renamed to OUT when complete; rerunning an interrupted build resumes it."
        ),
    )
    b.add_argument("--exl3", type=Path, required=True, help=f"EXL3 checkpoint directory (e.g. .../{EXL3.dirname})")
    b.add_argument("--engram", type=Path, required=True, help=f"Engram release directory (e.g. .../{ENGRAM.dirname})")
    b.add_argument("--out", type=Path, required=True, help=f"pack directory to create (e.g. .../{PACK_DIRNAME})")
    b.add_argument("--force", action="store_true", help="replace an existing pack (atomically)")
    b.add_argument("--jobs", type=int, default=1, help="decoding worker processes (default 1)")
    b.add_argument("--hash-inputs", action="store_true", help="hash all input bytes into the manifest (slow)")
    b.add_argument("--absolute-links", action="store_true", help="absolute instead of relative links")
    b.add_argument("--host-experts", choices=["all", "none"], default="all", help="host-resident routed experts")
    b.add_argument("--quiet", action="store_true")

    v = sub.add_parser(
        "verify",
        help="check a pack; one line per problem, exit 1 if any",
        description="Check the manifest, links, hashes, headers, indexed tensors, EXL3 sets and Engram tables.",
    )
    v.add_argument("pack", type=Path)
    v.add_argument("--deep", action="store_true", help="also hash input shards whose sha256 is recorded (slow)")
    v.add_argument("--max-lines", type=int, default=20, help="per-file cap on repeated tensor lines (default 20)")

    i = sub.add_parser(
        "inspect",
        help="layers, experts, bits, bytes per tier, Engram rows, RAM/VRAM/disk needs",
        description="Describe a pack or an input directory from its safetensors headers.",
    )
    i.add_argument("path", type=Path)
    i.add_argument("--json", action="store_true", help="print JSON instead of text")

    s = sub.add_parser(
        "synth",
        help="write a synthetic preset (deterministic by seed)",
        description=(
            "Presets: tiny-v41 (both build inputs with the real V4.1 names at tiny sizes), flash-layer (one "
            "Flash-shaped MoE layer, 384 experts H=5120 I=2304 mul1 K=3, ~5 GB), flash-v41 (both build inputs of a "
            "servable V4.1 of --layers real-size Flash layers, ~5.2 GB each), tiny-demo (a small "
            "vLLM-CPU-runnable demo pack)."
        ),
    )
    s.add_argument("--preset", required=True, choices=sorted(PRESETS))
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--experts", type=int, help="flash-layer: routed experts (default 384)")
    s.add_argument("--hidden", type=int, help="flash-layer: hidden size (default 5120)")
    s.add_argument("--intermediate", type=int, help="flash-layer: expert intermediate size (default 2304)")
    s.add_argument("--shard-mb", type=int, help="flash-layer / flash-v41: shard size in MiB (default 512 / 1024)")
    s.add_argument("--layers", type=int, help="flash-v41: real-size decoder layers (default 4, at least 3)")
    s.add_argument("--quiet", action="store_true")
    return p


def _cmd_download(a: argparse.Namespace) -> int:
    from pack_tools.download import download_inputs, plan_download

    token = None
    if a.token_file is not None:
        try:
            token = a.token_file.read_text().strip()
        except OSError as e:
            raise PackError(f"--token-file {a.token_file}: {e.strerror}") from None
    which = tuple(dict.fromkeys(a.only)) if a.only else ("exl3", "engram")
    if a.dry_run:
        for key, p in plan_download(which, token=token).items():
            repo = p["repo"]
            print(f"{key}: {repo.repo_id}@{repo.revision} -> {a.models_root / repo.dirname}")
            for f in p["files"]:
                print(f"  {f.size if f.size is not None else '?':>15}  {f.path}")
            print(f"  {p['bytes']:>15}  total")
        return 0
    got = download_inputs(a.models_root, which, token=token, max_workers=a.workers, log=_log(a.quiet))
    for key, path in got.items():
        print(f"{key}: {path}")
    return 0


def _cmd_build(a: argparse.Namespace) -> int:
    from pack_tools.build import build_pack
    from pack_tools.config import PackConfig

    cfg = PackConfig(
        host_experts=a.host_experts,
        link_mode="absolute" if a.absolute_links else "relative",
        hash_inputs=a.hash_inputs,
    )
    out = build_pack(
        a.exl3, a.engram, a.out, config=cfg, force=a.force, jobs=a.jobs, progress=not a.quiet, log=_log(a.quiet)
    )
    print(out)
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from pack_tools.verify import verify_pack

    if a.max_lines < 1:
        raise PackError("--max-lines: must be at least 1")
    problems = verify_pack(a.pack, deep=a.deep, max_lines_per_file=a.max_lines)
    for line in problems:
        print(line)
    if problems:
        print(f"pack-tools: {a.pack}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"OK {a.pack}")
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from pack_tools.inspection import format_inspect, inspect_pack

    info = inspect_pack(a.path)
    print(json.dumps(info, indent=2) if a.json else format_inspect(info))
    return 0


def _cmd_synth(a: argparse.Namespace) -> int:
    from pack_tools.presets import synth

    options: dict[str, object] = {}
    flash_opts = {"experts": a.experts, "hidden": a.hidden, "intermediate": a.intermediate}
    if a.shard_mb is not None:
        flash_opts["shard_bytes"] = a.shard_mb << 20
    given = {k: v for k, v in flash_opts.items() if v is not None}
    if a.preset == "flash-layer":
        options.update(given)
        options["progress"] = not a.quiet
    elif a.preset == "flash-v41" and set(given) <= {"shard_bytes"}:
        options.update(given)
        if a.layers is not None:
            options["layers"] = a.layers
        options["progress"] = not a.quiet
    elif given:
        key = next(iter(given))
        where = "flash-layer or flash-v41" if key == "shard_bytes" else "flash-layer"
        raise PackError(f"--{key.replace('_bytes', '-mb').replace('_', '-')}: only for --preset {where}")
    if a.layers is not None and a.preset != "flash-v41":
        raise PackError("--layers: only for --preset flash-v41")
    try:
        out = synth(a.preset, a.out, seed=a.seed, **options)
    except ValueError as e:
        raise PackError(str(e)) from None
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code."""
    args = _parser().parse_args(argv)
    handlers = {
        "download": _cmd_download,
        "build": _cmd_build,
        "verify": _cmd_verify,
        "inspect": _cmd_inspect,
        "synth": _cmd_synth,
    }
    try:
        return handlers[args.command](args)
    except PackError as e:
        _err(str(e))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
