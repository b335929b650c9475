"""The pinned inputs of a DeepSeek-V4.1-Flash pack (../shared/origin/, reference-system.md section 8)."""

from __future__ import annotations

import dataclasses

__all__ = ["ENGRAM", "EXL3", "INPUTS", "PACK_DIRNAME", "PinnedRepo"]


@dataclasses.dataclass(frozen=True, slots=True)
class PinnedRepo:
    """One Hugging Face repository at one commit, and the files a pack needs from it.

    ``allow_patterns`` are fnmatch patterns as ``huggingface_hub.snapshot_download`` takes them.
    ``dirname`` is the local directory name under the models root; the pack links into it.
    """

    key: str
    repo_id: str
    revision: str
    allow_patterns: tuple[str, ...]
    dirname: str
    approx_bytes: int

    def __post_init__(self) -> None:
        if len(self.revision) != 40 or any(c not in "0123456789abcdef" for c in self.revision):
            raise ValueError(f"revision of {self.repo_id} must be a full 40-hex commit, got {self.revision!r}")


#: The EXL3 3.0 bpw checkpoint (routed experts 3 bpw mul1, head 6 bpw, MTP 4 bpw, dense modules EXL3 too).
#: Everything a server loads: shards, index, config, quantization config, tokenizer and chat template files.
EXL3 = PinnedRepo(
    key="exl3",
    repo_id="Mia-AiLab/DeepSeek-V4.1-Flash-EXL3-3.0bpw",
    revision="c5534b90602b4090980a1c3ded1eb3b4d99a38d5",
    allow_patterns=("*.safetensors", "*.json", "*.jinja", "*.model", "*.txt", "*.py"),
    dirname="Mia-DeepSeek-V4.1-Flash-EXL3-3.0bpw",
    approx_bytes=219_300_000_000,
)

#: The original release, only for its Engram tables (shards 47-48) plus the files describing them.
ENGRAM = PinnedRepo(
    key="engram",
    repo_id="deepseek-ai/DeepSeek-V4.1-Flash",
    revision="2cba9e42aa026125f3ed06c6d98c1db82f7ca027",
    allow_patterns=(
        "config.json",
        "model.safetensors.index.json",
        "inference/engram.py",
        "model-00047-of-00048.safetensors",
        "model-00048-of-00048.safetensors",
    ),
    dirname="DeepSeek-V4.1-Flash-engram",
    approx_bytes=203_100_000_000,
)

INPUTS: dict[str, PinnedRepo] = {EXL3.key: EXL3, ENGRAM.key: ENGRAM}

#: Default name of the built pack under the models root (it sits beside the two input directories).
PACK_DIRNAME = "DSV41-Flash-EXL3-pack"
