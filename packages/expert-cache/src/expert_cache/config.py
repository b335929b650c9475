"""The configuration of the package: :class:`ExpertCacheConfig` and the policy it chooses (frozen, validated).

``ExpertCacheConfig`` holds the geometry, size, planner, elastic and execution settings; its ``policy`` field is
one small config per residency policy (:class:`DecayedConfig`, :class:`LruConfig`, :class:`LfuConfig`,
:class:`ArcConfig`, :class:`HybridConfig`) holding that policy's own knobs only; :func:`policy_config` builds one
from a name. Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` (or ``TypeError``)
whose message starts with the field name, e.g. ``"admit_limit: must be >= 1, got 0"`` or
``"HybridConfig.halflives[1]: must be in (0.0, 1000000000.0], got -1.0"``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, TypeAlias

import numpy as np

from cpu_tier.geometry import V41_FLASH

__all__ = [
    "DSV41_FLASH_EXL3_3BPW",
    "MIN_SLOT_ALIGNMENT",
    "POLICIES",
    "ArcConfig",
    "DecayedConfig",
    "ExpertCacheConfig",
    "HybridConfig",
    "LfuConfig",
    "LruConfig",
    "PolicyConfig",
    "PolicyName",
    "ProjectionSpec",
    "policy_config",
]

PolicyName = Literal["decayed", "lru", "lfu", "arc", "hybrid"]
#: The least :attr:`ExpertCacheConfig.slot_alignment`: one 128-byte line, so every slot column suits vector loads.
MIN_SLOT_ALIGNMENT = 128
#: Every policy name :class:`ExpertCacheConfig` accepts (see :mod:`expert_cache.policies`).
POLICIES: tuple[PolicyName, ...] = ("decayed", "lru", "lfu", "arc", "hybrid")

_DTYPES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ProjectionSpec:
    """One weight tensor of an expert (one pointer-table column).

    Parameters
    ----------
    name
        A label, e.g. ``"w13"``; unique within a config.
    shape
        The shape of one expert's row of this projection, e.g. ``(2, 320, 144, 48)``.
    dtype
        One of ``uint8 int8 int16 float16 bfloat16 int32 float32 int64``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"projections.name: must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise ValueError(f"projections[{self.name}].shape: must be a non-empty tuple of ints, got {self.shape!r}")
        for d in self.shape:
            if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
                raise ValueError(
                    f"projections[{self.name}].shape: every dimension must be an int >= 1, got {self.shape!r}"
                )
        if self.dtype not in _DTYPES:
            raise ValueError(f"projections[{self.name}].dtype: must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's row of this projection."""
        return math.prod(self.shape) * self.itemsize


#: DeepSeek-V4.1-Flash routed experts (``cpu_tier.geometry.V41_FLASH``) in EXL3 3.0 bpw, as the reference system
#: stores them (section 2 of ../shared/reference/reference-system.md): w13 (gate+up) int16 ``[2, 320, 144, 48]``
#: = 8,847,360 B and w2 (down) int16 ``[144, 320, 48]`` = 4,423,680 B, 13,271,040 B (12.66 MiB) per expert.
DSV41_FLASH_EXL3_3BPW: tuple[ProjectionSpec, ...] = (
    ProjectionSpec("w13", (2, *V41_FLASH.trellis_shape("gate")), "int16"),
    ProjectionSpec("w2", V41_FLASH.trellis_shape("down"), "int16"),
)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: must be {rng}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise ValueError(f"{name}: must be in {left}{lo}, {hi}], got {value}")


# ---------------------------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True, slots=True)
class DecayedConfig:
    """``decayed``, the reference system's ``ec_step``: ``score = score * decay + picks`` once per replan."""

    name: ClassVar[PolicyName] = "decayed"
    decay: float = 0.9

    def __post_init__(self) -> None:
        _check_float("DecayedConfig.decay", self.decay, 0.0, 1.0, lo_open=True)


@dataclasses.dataclass(frozen=True, slots=True)
class LruConfig:
    """``lru``: priority = step of the last access (recency only; no knobs)."""

    name: ClassVar[PolicyName] = "lru"


@dataclasses.dataclass(frozen=True, slots=True)
class LfuConfig:
    """``lfu``: the count of steps a key was accessed in, halved every ``halve_every`` steps (LFU with aging)."""

    name: ClassVar[PolicyName] = "lfu"
    halve_every: int = 256

    def __post_init__(self) -> None:
        _check_int("LfuConfig.halve_every", self.halve_every, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class ArcConfig:
    """``arc``: ARC on the per-step access stream with capacity ``num_slots`` (no knobs)."""

    name: ClassVar[PolicyName] = "arc"


@dataclasses.dataclass(frozen=True, slots=True)
class HybridConfig:
    """``hybrid``: frequency + recency on several time scales (:class:`expert_cache.policies.HybridPolicy`).

    ``halflives`` are the candidate time scales (decode steps), ``score_halflife`` how long the shadow caches
    remember their hits, ``slow_halflife`` / ``slow_weight`` the slow rate added to every candidate,
    ``recency_bonus`` a bonus for keys routed in the last step, ``profile_path`` an optional ``.npz``
    routing-frequency profile (:func:`expert_cache.policies.save_profile`) the policy starts from, weighted by
    ``profile_weight``.
    """

    name: ClassVar[PolicyName] = "hybrid"
    halflives: tuple[float, ...] = (8.0, 16.0, 32.0, 64.0, 128.0)
    score_halflife: float = 256.0
    slow_halflife: float = 2048.0
    slow_weight: float = 0.1
    recency_bonus: float = 0.0
    profile_path: str | None = None
    profile_weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.halflives, tuple) or not self.halflives:
            raise ValueError(f"HybridConfig.halflives: must be a non-empty tuple of numbers, got {self.halflives!r}")
        for i, h in enumerate(self.halflives):
            _check_float(f"HybridConfig.halflives[{i}]", h, 0.0, 1e9, lo_open=True)
        _check_float("HybridConfig.score_halflife", self.score_halflife, 0.0, 1e9, lo_open=True)
        _check_float("HybridConfig.slow_halflife", self.slow_halflife, 0.0, 1e9, lo_open=True)
        if self.slow_halflife < max(self.halflives):
            raise ValueError(
                f"HybridConfig.slow_halflife: must be >= max(halflives) = {max(self.halflives)}, "
                f"got {self.slow_halflife}"
            )
        _check_float("HybridConfig.slow_weight", self.slow_weight, 0.0, 1e6)
        _check_float("HybridConfig.recency_bonus", self.recency_bonus, 0.0, 1e6)
        if self.profile_path is not None and (not isinstance(self.profile_path, str) or not self.profile_path):
            raise ValueError(
                f"HybridConfig.profile_path: must be None or a non-empty path string, got {self.profile_path!r}"
            )
        _check_float("HybridConfig.profile_weight", self.profile_weight, 0.0, 1e9)


PolicyConfig: TypeAlias = DecayedConfig | LruConfig | LfuConfig | ArcConfig | HybridConfig
_POLICY_CONFIGS: dict[str, type[Any]] = {
    c.name: c for c in (DecayedConfig, LruConfig, LfuConfig, ArcConfig, HybridConfig)
}


def policy_config(name: PolicyName, **knobs: Any) -> PolicyConfig:
    """The config of the policy ``name`` with ``knobs`` (its fields), e.g. ``policy_config("lfu", halve_every=64)``."""
    cls = _POLICY_CONFIGS.get(name)
    if cls is None:
        raise ValueError(f"policy: must be one of {list(POLICIES)}, got {name!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    for k in knobs:
        if k not in fields:
            raise ValueError(f"{cls.__name__}.{k}: the {name!r} policy has no such knob (it has {fields or 'none'})")
    return cls(**knobs)


# ------------------------------------------------------------------------------------------ the cache


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertCacheConfig:
    """Configuration of one expert cache (geometry, size, policy, elastic lifecycle).

    Geometry
        ``num_layers`` MoE layers of ``num_experts`` routed experts each. An expert's weights are either the
        ``projections`` (one pointer-table column each) or, when ``projections`` is empty, one opaque ``uint8``
        row of ``slot_bytes`` bytes (projection name ``"weights"``).
    Size
        ``num_slots`` VRAM slots, shared by all layers. ``num_slots = 0`` derives the count at allocation:
        ``(budget - margin_bytes) // slot_stride`` with ``budget = vram_budget_bytes``, or, when that is 0 too, the
        free device memory the cache is given (``ExpertCache(..., free_bytes=)``, default the device's free memory
        at construction; CUDA only). ``max_slots`` (0 = no cap) caps the derived count.
    Policy (:mod:`expert_cache.policies`)
        ``policy`` (a :data:`PolicyConfig`: which policy, with its own knobs) ranks (layer, expert) pairs; every
        ``replan_every`` steps the planner wants the top ``num_slots`` pairs resident, admits at most
        ``admit_limit`` of them, and evicts a resident only when ``priority(new) > hysteresis * priority(victim)``.
        A step therefore queues at most ``admit_limit`` fills (``admit_limit * expert_bytes`` over the copy engine),
        except a re-warm (below).
    Elastic lifecycle
        With ``elastic``, a step of more than ``prefill_tokens`` scheduled tokens releases the whole pool before it
        runs (the memory goes back to the allocator), and the pool is refilled after ``rewarm_after`` consecutive
        steps of at most ``prefill_tokens`` tokens. ``rewarm_set = "kept"`` re-admits the residents remembered at
        release (the reference); ``"top"`` admits the current top ``num_slots`` by priority. ``rewarm_limit``
        (0 = no limit, the reference) caps the re-warm's admissions, best first; the replans that follow fill the
        remaining free slots (at most ``admit_limit`` each), so that no step queues more than
        ``max(admit_limit, rewarm_limit)`` fills.
        ``observe_prefill`` lets the routing of big (prefill) steps feed the policy, weighted by ``prefill_weight``.
    Execution
        ``async_fill``: slot fills run on a side stream and a newcomer's pointers move to its slot at the first
        step boundary after its copy finished (no stall); otherwise the compute stream waits for the fill at the
        replan. ``async_observe``: a replan does not wait for the GPU; it snapshots the routing counters (a
        device-to-host copy on the compute stream) and plans with the snapshot of the *previous* replan, so the
        policy sees its data one replan interval late (releases and re-warms still see everything). Without it,
        each replan waits for the compute stream once, like the reference.
    Alignment
        ``slot_alignment`` (a power of two, >= 128; default 256): the pool's base and every projection column
        inside every slot start on a ``slot_alignment`` byte boundary (each column is padded to a multiple of it),
        so a kernel may use 16-byte vector loads, ``cp.async`` and TMA on any slot pointer and reads whole 128-byte
        lines. Home pointers carry only the home's own alignment (``ExpertCache.home_alignment``).

    Defaults are the reference system's (``DSV41_EC_*``: decayed counts with decay 0.9, every 16, admit 48,
    hysteresis 1.0, margin 900 MB, prefill threshold 512 tokens, re-warm after 4 decode steps).
    """

    num_layers: int
    num_experts: int
    projections: tuple[ProjectionSpec, ...] = ()
    slot_bytes: int = 0
    num_slots: int = 0
    vram_budget_bytes: int = 0
    margin_bytes: int = 900 * 2**20
    max_slots: int = 0
    policy: PolicyConfig = DecayedConfig()
    replan_every: int = 16
    admit_limit: int = 48
    hysteresis: float = 1.0
    elastic: bool = False
    prefill_tokens: int = 512
    rewarm_after: int = 4
    rewarm_set: Literal["kept", "top"] = "kept"
    rewarm_limit: int = 0
    observe_prefill: bool = False
    prefill_weight: float = 1.0
    async_fill: bool = True
    async_observe: bool = False
    slot_alignment: int = 256

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_experts", self.num_experts, 1)
        if not isinstance(self.projections, tuple):
            raise TypeError(f"projections: must be a tuple of ProjectionSpec, got {type(self.projections).__name__}")
        for p in self.projections:
            if not isinstance(p, ProjectionSpec):
                raise TypeError(f"projections: every item must be a ProjectionSpec, got {type(p).__name__}")
        names = [p.name for p in self.projections]
        if len(set(names)) != len(names):
            raise ValueError(f"projections: names must be unique, got {names}")
        _check_int("slot_bytes", self.slot_bytes, 0)
        if self.projections and self.slot_bytes:
            raise ValueError("slot_bytes: give either projections or slot_bytes, not both")
        if not self.projections and not self.slot_bytes:
            raise ValueError("slot_bytes: one of projections or slot_bytes (> 0) is required")
        _check_int("num_slots", self.num_slots, 0)
        _check_int("vram_budget_bytes", self.vram_budget_bytes, 0)
        _check_int("margin_bytes", self.margin_bytes, 0)
        _check_int("max_slots", self.max_slots, 0)
        if self.num_slots > self.num_layers * self.num_experts:
            raise ValueError(
                f"num_slots: must be <= num_layers * num_experts = {self.num_layers * self.num_experts}, "
                f"got {self.num_slots}"
            )
        if not isinstance(self.policy, tuple(_POLICY_CONFIGS.values())):
            raise TypeError(
                f"policy: must be one of DecayedConfig, LruConfig, LfuConfig, ArcConfig, HybridConfig "
                f"(policy_config(name) builds one from one of {list(POLICIES)}), got {self.policy!r}"
            )
        _check_int("replan_every", self.replan_every, 1, 1024)
        _check_int("admit_limit", self.admit_limit, 1)
        _check_float("hysteresis", self.hysteresis, 1.0, 1e6)
        if self.policy.name in ("lru", "arc") and self.hysteresis != 1.0:
            raise ValueError(
                f"hysteresis: policy {self.policy.name!r} ranks by recency, where a ratio means nothing; "
                f"must be 1.0, got {self.hysteresis}"
            )
        if not isinstance(self.elastic, bool):
            raise TypeError(f"elastic: must be a bool, got {type(self.elastic).__name__}")
        _check_int("prefill_tokens", self.prefill_tokens, 1)
        _check_int("rewarm_after", self.rewarm_after, 0)
        if self.rewarm_set not in ("kept", "top"):
            raise ValueError(f"rewarm_set: must be 'kept' or 'top', got {self.rewarm_set!r}")
        _check_int("rewarm_limit", self.rewarm_limit, 0)
        if not isinstance(self.observe_prefill, bool):
            raise TypeError(f"observe_prefill: must be a bool, got {type(self.observe_prefill).__name__}")
        _check_float("prefill_weight", self.prefill_weight, 0.0, 1e9)
        if not isinstance(self.async_fill, bool):
            raise TypeError(f"async_fill: must be a bool, got {type(self.async_fill).__name__}")
        if not isinstance(self.async_observe, bool):
            raise TypeError(f"async_observe: must be a bool, got {type(self.async_observe).__name__}")
        _check_int("slot_alignment", self.slot_alignment, 1)
        if self.slot_alignment & (self.slot_alignment - 1) or self.slot_alignment < MIN_SLOT_ALIGNMENT:
            raise ValueError(
                f"slot_alignment: must be a power of two >= {MIN_SLOT_ALIGNMENT}, got {self.slot_alignment}"
            )

    # ---- derived geometry -------------------------------------------------------------------------------------

    @property
    def num_keys(self) -> int:
        """``num_layers * num_experts``: the number of (layer, expert) pairs; key = ``layer * num_experts + expert``."""
        return self.num_layers * self.num_experts

    @property
    def projection_specs(self) -> tuple[ProjectionSpec, ...]:
        """The projections, or the single opaque ``("weights", (slot_bytes,), "uint8")`` one."""
        if self.projections:
            return self.projections
        return (ProjectionSpec("weights", (self.slot_bytes,), "uint8"),)

    @property
    def projection_offsets(self) -> tuple[int, ...]:
        """Byte offset of each projection inside a slot (each aligned to ``slot_alignment``)."""
        offs, pos = [], 0
        for p in self.projection_specs:
            offs.append(pos)
            pos += -(-p.nbytes // self.slot_alignment) * self.slot_alignment
        return tuple(offs)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (sum over projections, no padding): what a slot fill copies."""
        return sum(p.nbytes for p in self.projection_specs)

    @property
    def slot_stride(self) -> int:
        """Bytes between two slots of the pool (projections padded to ``slot_alignment``)."""
        return sum(-(-p.nbytes // self.slot_alignment) * self.slot_alignment for p in self.projection_specs)

    def resolve_num_slots(self, free_bytes: int | None = None) -> int:
        """The slot count to allocate.

        Parameters
        ----------
        free_bytes
            Free device memory, used only when ``num_slots == 0`` and ``vram_budget_bytes == 0``.

        Returns
        -------
        int
            ``num_slots`` if set, else ``(budget - margin_bytes) // slot_stride`` capped by ``max_slots`` and by
            ``num_keys`` (never below 0).
        """
        if self.num_slots:
            return self.num_slots
        budget = self.vram_budget_bytes
        if budget == 0:
            if free_bytes is None:
                raise ValueError(
                    "num_slots: is 0 and vram_budget_bytes is 0, so the free device memory is needed; "
                    "set num_slots or vram_budget_bytes on a CPU device"
                )
            budget = int(free_bytes)
        n = max(0, (budget - self.margin_bytes) // self.slot_stride)
        if self.max_slots:
            n = min(n, self.max_slots)
        return min(n, self.num_keys)
