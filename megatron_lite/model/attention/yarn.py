"""YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), DeepSeek-V3's form.

Rotary frequencies that turn fewer than --yarn-beta-slow times over the original context
(--yarn-original-max-position-embeddings) are slowed by --rotary-scaling-factor (interpolated), those that turn
more than --yarn-beta-fast times are kept (extrapolated), and a linear ramp over the frequency index blends the
two between those bounds (rounded outwards to whole indices, unless --no-yarn-correction-range-round-to-int, as
gpt-oss trains: transformers' `truncate: false`). The rotated part of queries and keys is scaled by
mscale(factor, --mscale) / mscale(factor, --mscale-all-dim), with mscale(s, m) = 0.1 m ln s + 1, through cos and
sin; multi-latent attention multiplies its softmax scale by mscale(factor, --mscale-all-dim)^2. With a factor
of 1 both scales are 1 and the frequencies plain RoPE's.

These are Megatron-Core's YarnRotaryEmbedding and MLA softmax scale, and transformers' rope_type "yarn" with its
DeepSeek-V3 attention scaling (tests/test_mla.py compares against it). Plain attention takes the same rotation with
--position-embedding-type yarn (gpt-oss; tests/test_gpt_oss.py), its softmax scale unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from megatron_lite.config.sections import ModelConfig


def yarn_mscale(scale: float, mscale: float) -> float:
    """0.1 * mscale * ln(scale) + 1, or 1 when the context is not stretched (scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnScaling(NamedTuple):
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    base: float
    round_to_int: bool = True

    @classmethod
    def of(cls, config: ModelConfig) -> YarnScaling:
        return cls(config.rotary_scaling_factor, config.yarn_original_max_position_embeddings, config.yarn_beta_fast,
                   config.yarn_beta_slow, config.mscale, config.mscale_all_dim, config.rotary_base,
                   config.yarn_correction_range_round_to_int)

    def _correction_dim(self, rotations: float, dim: int) -> float:
        """The frequency index (of dim / 2) whose wavelength fits `rotations` times into the original context."""
        turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(self.base))

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """RoPE's inverse frequencies [dim / 2] -> YaRN's."""
        dim = 2 * inv_freq.numel()
        low, high = self._correction_dim(self.beta_fast, dim), self._correction_dim(self.beta_slow, dim)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp  # 1 for the fast (high-frequency) dimensions, which are kept
        return inv_freq / self.factor * (1 - extrapolated) + inv_freq * extrapolated

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (so on the rotated query and key dimensions)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    def softmax_scale(self, query_key_dim: int) -> float:
        """Multi-latent attention's softmax scale: mscale(factor, mscale_all_dim)^2 / sqrt(query-key head dim)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 / math.sqrt(query_key_dim)
