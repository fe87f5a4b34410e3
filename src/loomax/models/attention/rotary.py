"""Rotary position embeddings (RoPE) and their context-extension variants (``model.rope.type``).

Frequencies follow the Hugging Face ``rotate_half`` convention: the first and second
halves of ``head_size`` are the two coordinates of each rotated pair, so exported weights
need no permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import draccus
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from loomax.errors import BadFileError
from loomax.models.axes import HeadSize


@dataclass(frozen=True)
class RotaryConfig(draccus.ChoiceRegistry):
    """Rotary embeddings; ``type`` picks the frequency scaling (default: none)."""

    theta: float = 10000.0
    """Base of the rotary frequencies (`rope_theta`)."""

    def __post_init__(self):
        if self.theta <= 1:
            raise ValueError(f"model.rope.theta must be > 1, got {self.theta}")

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "default"

    def base_inv_freq(self, head_size: int) -> np.ndarray:
        return 1.0 / (self.theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size))

    def inv_freq(self, head_size: int) -> np.ndarray:
        """Angular frequency of each of the ``head_size // 2`` rotated pairs."""
        return self.base_inv_freq(head_size)

    def attention_factor(self) -> float:
        """Scale applied to cos and sin (YaRN's attention temperature; 1 elsewhere)."""
        return 1.0

    def hf_rope_scaling(self) -> dict[str, Any] | None:
        """The ``rope_scaling`` entry of a Hugging Face config.json."""
        return None

    @staticmethod
    def from_hf_config(hf: dict[str, Any]) -> RotaryConfig:
        """The rotary config of an HF ``config.json``: transformers >= 5 writes one
        ``rope_parameters`` mapping (with ``rope_theta``), older versions ``rope_theta`` and
        ``rope_scaling``."""
        params = hf.get("rope_parameters")
        if not params:
            return RotaryConfig.from_hf(hf.get("rope_theta", 10000.0), hf.get("rope_scaling"))
        if (
            not isinstance(params, dict)
            or "rope_theta" not in params
            and any(isinstance(v, dict) for v in params.values())
        ):
            raise BadFileError(
                "config.json: rope_parameters per layer type are not supported (one rope for all layers)"
            )
        params = dict(params)
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        return RotaryConfig.from_hf(theta, params)

    @staticmethod
    def from_hf(theta: float, rope_scaling: dict[str, Any] | None) -> RotaryConfig:
        """The config matching HF's ``rope_theta`` and ``rope_scaling``."""
        if not rope_scaling:
            return DefaultRotary(theta=theta)
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        fields = {k: v for k, v in rope_scaling.items() if k not in ("rope_type", "type")}
        classes = {
            "default": DefaultRotary,
            "linear": LinearRotary,
            "llama3": Llama3Rotary,
            "yarn": YarnRotary,
        }
        if kind not in classes:
            raise BadFileError(
                f"rope_scaling type {kind!r} is not supported (have {sorted(classes)})"
            )
        known = set(classes[kind].__dataclass_fields__)
        unknown = set(fields) - known
        if unknown:
            raise BadFileError(f"rope_scaling ({kind}): unsupported fields {sorted(unknown)}")
        return classes[kind](theta=theta, **fields)


@RotaryConfig.register_subclass("default")
@dataclass(frozen=True)
class DefaultRotary(RotaryConfig):
    """Plain RoPE (Su et al. 2021)."""


@RotaryConfig.register_subclass("linear")
@dataclass(frozen=True)
class LinearRotary(RotaryConfig):
    """Position interpolation: every frequency divided by ``factor``."""

    factor: float = 1.0
    """Context-extension factor."""

    def inv_freq(self, head_size: int) -> np.ndarray:
        return self.base_inv_freq(head_size) / self.factor

    def hf_rope_scaling(self) -> dict[str, Any]:
        return {"rope_type": "linear", "factor": self.factor}


@RotaryConfig.register_subclass("llama3")
@dataclass(frozen=True)
class Llama3Rotary(RotaryConfig):
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""

    factor: float = 8.0
    """Context-extension factor."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / this are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / this are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained with."""

    def inv_freq(self, head_size: int) -> np.ndarray:
        inv = self.base_inv_freq(head_size)
        wavelen = 2 * math.pi / inv
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        ramp = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, ramp, scaled)

    def hf_rope_scaling(self) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@RotaryConfig.register_subclass("yarn")
@dataclass(frozen=True)
class YarnRotary(RotaryConfig):
    """YaRN (Peng et al. 2023): interpolate low frequencies, extrapolate high ones, temper attention."""

    factor: float = 4.0
    """Context-extension factor."""
    original_max_position_embeddings: int = 4096
    """Context length the model was pretrained with."""
    beta_fast: float = 32.0
    """Rotations above which a pair is extrapolated (kept)."""
    beta_slow: float = 1.0
    """Rotations below which a pair is fully interpolated."""
    mscale: float | None = None
    """With `mscale_all_dim` (DeepSeek): cos/sin times (0.1 mscale ln factor + 1) / (the same with mscale_all_dim)."""
    mscale_all_dim: float | None = None
    """DeepSeek's softmax temperature: MLA's scale times (0.1 mscale_all_dim ln factor + 1) squared."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (false: gpt-oss's exact ends)."""

    def _correction_dim(self, rotations: float, head_size: int) -> float:
        old = self.original_max_position_embeddings
        return head_size * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

    def inv_freq(self, head_size: int) -> np.ndarray:
        extrapolated = self.base_inv_freq(head_size)
        interpolated = extrapolated / self.factor
        low = self._correction_dim(self.beta_fast, head_size)
        high = self._correction_dim(self.beta_slow, head_size)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_size - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_size // 2) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1 = extrapolate (high frequency), 0 = interpolate
        return interpolated * (1 - keep) + extrapolated * keep

    def mscale_of(self, mscale: float = 1.0) -> float:
        """YaRN's temperature ``0.1 * mscale * ln(factor) + 1`` (1 without extension)."""
        return 0.1 * mscale * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def attention_factor(self) -> float:
        if self.mscale and self.mscale_all_dim:  # as transformers' YaRN (DeepSeek-V2/V3)
            return self.mscale_of(self.mscale) / self.mscale_of(self.mscale_all_dim)
        return self.mscale_of()

    def hf_rope_scaling(self) -> dict[str, Any]:
        return {
            "rope_type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            **{k: getattr(self, k) for k in ("mscale", "mscale_all_dim") if getattr(self, k)},
            **({} if self.truncate else {"truncate": False}),
        }


def apply_rotary(x: NamedArray, positions: NamedArray, rope: RotaryConfig) -> NamedArray:
    """Rotate ``x`` (axes include ``head_size``) by angle ``position * inv_freq`` per pair.

    ``positions`` is an integer array with a ``position`` axis (any offset: decoding passes
    ``start + arange``), and optionally batch axes (each row's own: packed documents'
    positions, ``sequence_layout.document_positions``).
    """
    D = x.resolve_axis(HeadSize)
    half = D.size // 2
    inv = jnp.asarray(rope.inv_freq(D.size), jnp.float32)
    angles = positions.array.astype(jnp.float32)[..., None] * inv  # [..., position, half]
    factor = rope.attention_factor()
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1) * factor
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1) * factor
    names = (*(a.name for a in positions.axes), HeadSize)
    cos, sin = hax.named(cos.astype(x.dtype), names), hax.named(sin.astype(x.dtype), names)
    x1, x2 = x[HeadSize, :half], x[HeadSize, half:]
    rotated = hax.concatenate(HeadSize, [-x2, x1])
    return x * cos + rotated * sin


__all__ = [
    "DefaultRotary",
    "LinearRotary",
    "Llama3Rotary",
    "RotaryConfig",
    "YarnRotary",
    "apply_rotary",
]
