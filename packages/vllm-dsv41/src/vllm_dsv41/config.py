"""``Dsv41PluginConfig``: the plugin's one configuration object.

It reaches the plugin through vLLM's own configuration, never through environment variables:

* the pack's ``config.json`` may carry pack defaults in a ``"dsv41"`` object (an attribute of vLLM's
  ``hf_config``);
* the server passes overrides as ``additional_config={"dsv41": {...}}`` (vLLM's ``--additional-config``).

Overrides win field by field. Unknown fields and bad values raise ``ValueError`` naming the field and where it
came from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

#: The key under which the plugin's settings live in ``config.json`` and in vLLM's ``additional_config``.
CONFIG_KEY = "dsv41"

Isa = Literal["auto", "scalar", "avx2", "avx512", "amx"]
Precision = Literal["exact", "fast"]
_ISAS: tuple[str, ...] = ("auto", "scalar", "avx2", "avx512", "amx")
_PRECISIONS: tuple[str, ...] = ("exact", "fast")


@dataclasses.dataclass(frozen=True, slots=True)
class Dsv41PluginConfig:
    """How the plugin runs the routed experts.

    Attributes
    ----------
    cpu_threads : worker threads of the CPU expert tier; 0 means one per CPU this process may run on.
    cpu_cores : CPUs to pin those threads to (empty: no pinning).
    cpu_isa : kernel variant of the CPU expert tier: "auto" picks the best one the CPU runs ("scalar" is the
        portable fallback; "amx" adds the AMX-INT8 kernel on Sapphire Rapids and newer).
    cpu_amx_min_tokens : with the "amx" variant, the fewest tokens per expert chunk that run the AMX kernel (1..9,
        9 = never; cpu-tier's ``CpuTierConfig.amx_min_tokens``).
    precision : "exact" (float32 activations; relative error <= 1e-5 against the numpy reference) or "fast"
        (integer activations on the MUL1 path; relative RMS error <= 5e-3, see cpu-tier's README).
    spin_us : how long idle CPU workers spin before sleeping, in microseconds.
    """

    cpu_threads: int = 0
    cpu_cores: tuple[int, ...] = ()
    cpu_isa: Isa = "auto"
    precision: Precision = "exact"
    spin_us: int = 50
    cpu_amx_min_tokens: int = 6

    def __post_init__(self) -> None:
        _check_int("cpu_threads", self.cpu_threads, minimum=0)
        if not isinstance(self.cpu_cores, tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in self.cpu_cores
        ):
            raise ValueError(f"cpu_cores: expected a tuple of CPU numbers >= 0, got {self.cpu_cores!r}")
        if len(set(self.cpu_cores)) != len(self.cpu_cores):
            raise ValueError(f"cpu_cores: CPU numbers repeat in {self.cpu_cores!r}")
        if self.cpu_isa not in _ISAS:
            raise ValueError(f"cpu_isa: expected one of {_ISAS}, got {self.cpu_isa!r}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision: expected one of {_PRECISIONS}, got {self.precision!r}")
        _check_int("spin_us", self.spin_us, minimum=0)
        _check_int("cpu_amx_min_tokens", self.cpu_amx_min_tokens, minimum=1)
        if self.cpu_amx_min_tokens > 9:
            raise ValueError(f"cpu_amx_min_tokens: expected 1..9 (9 = never), got {self.cpu_amx_min_tokens}")

    @property
    def effective_threads(self) -> int:
        """The thread count the CPU tier will use (``cpu_threads``, else the CPUs this process may use)."""
        if self.cpu_threads:
            return self.cpu_threads
        if self.cpu_cores:
            return len(self.cpu_cores)
        return len(os.sched_getaffinity(0))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str = "config") -> Dsv41PluginConfig:
        """Build from a JSON-like mapping; ``source`` names where it came from in error messages."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: expected an object of plugin settings, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{source}: unknown field {unknown[0]!r}; known fields: {sorted(fields)}")
        kwargs = dict(values)
        if "cpu_cores" in kwargs and isinstance(kwargs["cpu_cores"], list):
            kwargs["cpu_cores"] = tuple(kwargs["cpu_cores"])
        try:
            return cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_mapping(self) -> dict[str, Any]:
        """The JSON-able form (what the server puts under ``additional_config["dsv41"]``)."""
        d = dataclasses.asdict(self)
        d["cpu_cores"] = list(self.cpu_cores)
        return d

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> Dsv41PluginConfig:
        """Merge the pack defaults (``hf_config.dsv41``) with the overrides (``additional_config["dsv41"]``)."""
        merged: dict[str, Any] = {}
        model_config = getattr(vllm_config, "model_config", None)
        hf_config = getattr(model_config, "hf_config", None)
        pack = getattr(hf_config, CONFIG_KEY, None)
        if pack is not None:
            merged.update(cls.from_mapping(pack, f"config.json {CONFIG_KEY!r}").to_mapping())
        extra = getattr(vllm_config, "additional_config", None) or {}
        if isinstance(extra, Mapping) and CONFIG_KEY in extra:
            override = extra[CONFIG_KEY]
            cls.from_mapping(override, f"additional_config {CONFIG_KEY!r}")  # validate on its own first
            merged.update(override)
        return cls.from_mapping(merged, "merged plugin config")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
