"""Speaker-encoder (ECAPA-TDNN) configuration, read from ``config.json``'s ``speaker_encoder_config``.

The released files give only ``enc_dim`` and ``sample_rate``; every other field comes from the
reference class's defaults, which are therefore the released architecture and are copied here exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from qtts_jax.io.errors import CheckpointError
from qtts_jax.codec.config import SAMPLE_RATE


@dataclasses.dataclass(frozen=True)
class SpeakerEncoderConfig:
    """Layer i of ``enc_channels``/``enc_kernel_sizes``/``enc_dilations``: 0 is the input TDNN, the middle
    ones are SE-Res2Net blocks, the last is the multi-layer feature aggregation (MFA) TDNN."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self) -> None:
        ch, scale = self.enc_channels, self.enc_res2net_scale
        if not len(ch) == len(self.enc_kernel_sizes) == len(self.enc_dilations) >= 3:
            raise CheckpointError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations "
                                  "need one equal length of at least 3")
        # The reference has no shortcut convs: residuals and the MFA concat only work with these shapes.
        if any(c != ch[0] or c % scale for c in ch[1:-1]) or sum(ch[1:-1]) != ch[-1]:
            raise CheckpointError(f"speaker_encoder_config: enc_channels {ch} must be equal in the SE-Res2Net "
                                  f"blocks, divisible by enc_res2net_scale={scale}, and sum to the MFA width")

    @property
    def num_blocks(self) -> int:
        """SE-Res2Net blocks between the input TDNN and the MFA."""
        return len(self.enc_channels) - 2

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpeakerEncoderConfig":
        """Missing fields take the reference defaults; keys that are not fields (HF bookkeeping) are ignored."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in d:
                value = d[f.name]
                kwargs[f.name] = tuple(int(v) for v in value) if isinstance(f.default, tuple) else int(value)
        return cls(**kwargs)
