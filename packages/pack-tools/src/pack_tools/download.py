"""``download_inputs``: the pinned inputs (pack_tools.origin) through huggingface_hub, only the files needed.

``snapshot_download(repo_id, revision=<pinned commit>, allow_patterns=<the needed files>, local_dir=...)``
resumes interrupted downloads by itself. Before downloading, the repository's file list with sizes and LFS
sha256 is read at the pinned revision (``model_info(files_metadata=True)``); after it, every expected file
must exist with the listed size, and ``.pack-tools-input.json`` records repo, revision, files, sizes and
sha256 so that ``build`` can carry the hashes into the manifest (``verify --deep``).

The hub is injectable (:class:`Hub`), so tests run against a fake and never touch the network.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pack_tools.errors import PackError
from pack_tools.inputs import INPUT_RECEIPT
from pack_tools.origin import INPUTS, PinnedRepo
from pack_tools.st import atomic_write_json

__all__ = ["HfHub", "Hub", "RemoteFile", "default_hub", "download_inputs", "plan_download"]


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of a repository at a revision: path, size, and the LFS sha256 when it is an LFS file."""

    path: str
    size: int | None
    sha256: str | None


class Hub(Protocol):
    """What the downloader needs from a hub client."""

    def list_files(self, repo_id: str, revision: str, token: str | None) -> list[RemoteFile]: ...

    def snapshot_download(
        self,
        repo_id: str,
        revision: str,
        allow_patterns: list[str],
        local_dir: Path,
        max_workers: int,
        token: str | None,
    ) -> Path: ...


class HfHub:
    """:class:`Hub` over ``huggingface_hub`` (imported on first use)."""

    def list_files(self, repo_id: str, revision: str, token: str | None) -> list[RemoteFile]:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, token=token)
        out = []
        for s in info.siblings or []:
            lfs = getattr(s, "lfs", None)
            sha = None
            if lfs is not None:
                sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            out.append(RemoteFile(s.rfilename, getattr(s, "size", None), sha))
        return out

    def snapshot_download(
        self,
        repo_id: str,
        revision: str,
        allow_patterns: list[str],
        local_dir: Path,
        max_workers: int,
        token: str | None,
    ) -> Path:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=allow_patterns,
                local_dir=local_dir,
                max_workers=max_workers,
                token=token,
            )
        )


def default_hub() -> Hub:
    return HfHub()


def _wanted(files: list[RemoteFile], patterns: Sequence[str]) -> list[RemoteFile]:
    return [f for f in files if any(fnmatch.fnmatch(f.path, p) for p in patterns)]


def plan_download(
    which: Sequence[str] = ("exl3", "engram"), *, hub: Hub | None = None, token: str | None = None
) -> dict[str, dict[str, Any]]:
    """The files each pinned input needs at its revision, with sizes (no download).

    Raises PackError when a pinned pattern that names one exact file matches nothing (the revision lacks it).
    """
    h = hub or default_hub()
    out: dict[str, dict[str, Any]] = {}
    for key in which:
        repo = _repo(key)
        files = _wanted(h.list_files(repo.repo_id, repo.revision, token), repo.allow_patterns)
        missing = [
            p for p in repo.allow_patterns
            if not any(ch in p for ch in "*?[") and not any(f.path == p for f in files)
        ]  # fmt: skip
        if missing:
            raise PackError(
                f"{repo.repo_id}@{repo.revision[:12]}: {missing[0]}: not in the repository at this revision"
            )
        if not files:
            raise PackError(f"{repo.repo_id}@{repo.revision[:12]}: no file matches {list(repo.allow_patterns)}")
        out[key] = {
            "repo": repo,
            "files": files,
            "bytes": sum(f.size or 0 for f in files),
        }
    return out


def _repo(key: str) -> PinnedRepo:
    if key not in INPUTS:
        raise PackError(f"unknown input {key!r}; expected one of {', '.join(INPUTS)}")
    return INPUTS[key]


def download_inputs(
    models_root: str | Path,
    which: Sequence[str] = ("exl3", "engram"),
    *,
    hub: Hub | None = None,
    token: str | None = None,
    max_workers: int = 8,
    log: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Download the pinned inputs into ``models_root/<dirname>``; returns ``{key: directory}``.

    Parameters
    ----------
    models_root : directory that receives one subdirectory per input (``origin.PinnedRepo.dirname``).
    which : input keys, ``"exl3"`` and/or ``"engram"``.
    hub : hub client (default: huggingface_hub).
    token : Hugging Face token, or None for anonymous access (huggingface_hub may still use its own login).
    max_workers : parallel file downloads.
    log : receives one line per step.

    Raises
    ------
    PackError when a file is missing after the download or its size differs from the hub's listing.
    """
    h = hub or default_hub()
    say = log or (lambda _m: None)
    root = Path(models_root)
    root.mkdir(parents=True, exist_ok=True)
    plan = plan_download(which, hub=h, token=token)
    result: dict[str, Path] = {}
    for key, p in plan.items():
        repo: PinnedRepo = p["repo"]
        local = root / repo.dirname
        say(f"{repo.repo_id}@{repo.revision[:12]}: {len(p['files'])} files, {p['bytes'] / 1e9:.1f} GB -> {local}")
        h.snapshot_download(repo.repo_id, repo.revision, list(repo.allow_patterns), local, max_workers, token)
        files: dict[str, Any] = {}
        for f in p["files"]:
            path = local / f.path
            if not path.is_file():
                raise PackError(f"{local.name}/{f.path}: missing after the download (rerun to resume)")
            size = path.stat().st_size
            if f.size is not None and size != f.size:
                raise PackError(
                    f"{local.name}/{f.path}: {size} bytes, the hub lists {f.size} (incomplete; rerun to resume)"
                )
            files[f.path] = {"size": size, "sha256": f.sha256}
        atomic_write_json(
            local / INPUT_RECEIPT,
            {
                "source": "huggingface",
                "repo_id": repo.repo_id,
                "revision": repo.revision,
                "allow_patterns": list(repo.allow_patterns),
                "files": files,
            },
        )
        result[key] = local
    return result
