"""The package's one configuration object (frozen; validated on construction)."""

from __future__ import annotations

import dataclasses
import re

__all__ = ["PackConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class PackConfig:
    """How ``build_pack`` turns the two input directories into a pack.

    Attributes
    ----------
    text_architecture : ``architectures[0]`` of the config the server loads: vLLM's V4.1 architecture name, so that
        everything vLLM keys on it stays on (Engram config, breakable CUDA graphs, the deepseek_v41 tokenizer);
        the plugin registers its model under the same name. The pack is served text-only (no vision tower).
    predecode : regexes (``re.search``) over native EXL3 module prefixes that bypass the quantized path and
        are shipped decoded to FP16 ``[out, in]`` in ``native-dense.safetensors`` (compressor and indexer
        projections, reference-system.md section 8). The grouped ``attn.wo_a.slice.G`` modules are always
        reconstructed, one ``woa-<root>.safetensors`` per layer / MTP stage.
    host_experts : ``"all"``: every routed expert of every decoder layer is host-resident (pinned RAM);
        ``"none"``: the host plan is empty (everything in VRAM; only for small models).
    link_mode : ``"relative"`` (default; survives moving the models root as a whole, e.g. a container
        mount) or ``"absolute"``.
    engram_link_prefix : prefix of the links to the Engram shards (their names collide with the checkpoint's
        shard names otherwise).
    hash_inputs : hash the whole content of every linked input file (slow: hundreds of GB) and record it in
        the manifest so ``verify --deep`` can check data bytes; hashes already known from a download receipt
        are recorded without hashing.
    """

    text_architecture: str = "DeepseekV41ForCausalLM"
    predecode: tuple[str, ...] = (r"\.attn\.compressor\.(wkv|wgate)$", r"\.attn\.indexer\.wk$")
    host_experts: str = "all"
    link_mode: str = "relative"
    engram_link_prefix: str = "engram-"
    hash_inputs: bool = False

    def __post_init__(self) -> None:
        if not self.text_architecture:
            raise ValueError("PackConfig.text_architecture: must not be empty")
        for p in self.predecode:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"PackConfig.predecode: invalid regex {p!r}: {e}") from None
        if self.host_experts not in ("all", "none"):
            raise ValueError(f"PackConfig.host_experts: expected 'all' or 'none', got {self.host_experts!r}")
        if self.link_mode not in ("relative", "absolute"):
            raise ValueError(f"PackConfig.link_mode: expected 'relative' or 'absolute', got {self.link_mode!r}")
        if not self.engram_link_prefix or "/" in self.engram_link_prefix:
            raise ValueError(
                f"PackConfig.engram_link_prefix: must be a non-empty file-name prefix, got {self.engram_link_prefix!r}"
            )
