"""Where a build writes: the partial directory, its resume state, the links to the inputs, the final rename.

A build runs in ``<out>.partial-<fingerprint>`` beside ``out`` and is renamed to ``out`` only when complete. An
interrupted build leaves only the partial directory (which ``verify`` rejects); the same build run again
resumes it, keeping every generated file whose recorded sha256 still matches (``.build-state.json``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from pack_tools.errors import PackError
from pack_tools.manifest import hash_file
from pack_tools.st import atomic_write_json

__all__ = ["STATE_NAME", "BuildState", "fsync_dir", "glob_escape", "link", "open_partial", "publish"]

STATE_NAME = ".build-state.json"


class BuildState:
    """``.build-state.json`` of a partial build: the generated files finished so far, with their sha256."""

    def __init__(self, partial: Path, fingerprint: str) -> None:
        self.path = partial / STATE_NAME
        self.fingerprint = fingerprint
        self.done: dict[str, str] = {}
        if self.path.exists():
            try:
                doc = json.loads(self.path.read_text())
                if doc.get("fingerprint") == fingerprint:
                    self.done = dict(doc.get("done", {}))
            except ValueError:
                self.done = {}

    def is_done(self, rel: str) -> bool:
        p = self.path.parent / rel
        return rel in self.done and p.is_file() and hash_file(p) == self.done[rel]

    def mark(self, rel: str) -> None:
        self.done[rel] = hash_file(self.path.parent / rel)
        atomic_write_json(self.path, {"fingerprint": self.fingerprint, "done": self.done})


def open_partial(out: Path, fingerprint: str, say: Callable[[str], None]) -> tuple[Path, BuildState]:
    """The partial directory of this build (resumed when the fingerprint matches; other partials removed)."""
    partial = out.parent / f"{out.name}.partial-{fingerprint[:16]}"
    for stale in out.parent.glob(f"{glob_escape(out.name)}.partial-*"):
        if stale != partial and stale.is_dir():
            say(f"removing stale partial build {stale.name} (different inputs or settings)")
            shutil.rmtree(stale)
    if partial.exists():
        say(f"resuming {partial.name}")
    partial.mkdir(exist_ok=True)
    return partial, BuildState(partial, fingerprint)


def publish(partial: Path, out: Path) -> None:
    """Rename the finished partial build to ``out`` (an existing ``out`` is replaced only after that)."""
    fsync_dir(partial)
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)
    fsync_dir(out.parent)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def link(path: Path, target: Path, mode: str) -> None:
    """A symlink ``path`` -> ``target`` (relative or absolute by ``mode``); an existing identical link is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = str(target) if mode == "absolute" else os.path.relpath(target, path.parent)
    if path.is_symlink():
        if os.readlink(path) == text:
            return
        path.unlink()
    elif path.exists():
        raise PackError(f"{path}: exists in the partial build and is not a link")
    os.symlink(text, path)


def fsync_dir(p: Path) -> None:
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
