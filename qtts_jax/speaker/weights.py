"""Speaker-encoder weights: the name table from ``speaker_encoder.*`` in the main ``model.safetensors`` onto
`SpeakerEncoder`'s state paths (convs channels last as w (k, in, out) and b (out,)):

    tdnn                 input TDNN
    blocks               per SE-Res2Net block (0, 1, ...): tdnn1, tdnn2; res2net (the scale-1 sub-convs stacked
                         on a leading axis); se {conv1, conv2}
    mfa                  multi-layer feature aggregation TDNN
    asp                  attentive statistics pooling: tdnn, conv
    fc                   final 1x1 conv to enc_dim
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from qtts_jax.io.checkpoint import CONV, Entry, load_module, load_table
from qtts_jax.speaker.config import SpeakerEncoderConfig
from qtts_jax.speaker.ecapa import SpeakerEncoder

PREFIX = "speaker_encoder"


def speaker_encoder_table(cfg: SpeakerEncoderConfig) -> tuple[list[Entry], dict[str, tuple[int, ...]]]:
    """The name table and our shape for every leaf."""
    entries: list[Entry] = []
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(hf: str, ours: str, k: int, cin: int, cout: int, stack: int = 0) -> None:
        lead = (stack,) if stack else ()
        entries.append(Entry(f"{PREFIX}.{hf}.weight", f"{ours}/w", CONV))
        entries.append(Entry(f"{PREFIX}.{hf}.bias", f"{ours}/b"))
        shapes[f"{ours}/w"] = (*lead, k, cin, cout)
        shapes[f"{ours}/b"] = (*lead, cout)

    ch, ks = cfg.enc_channels, cfg.enc_kernel_sizes
    conv("blocks.0.conv", "tdnn", ks[0], cfg.mel_dim, ch[0])
    for j in range(1, cfg.num_blocks + 1):
        hf, ours, c = f"blocks.{j}", f"blocks/{j - 1}", ch[j]
        sub = c // cfg.enc_res2net_scale
        conv(f"{hf}.tdnn1.conv", f"{ours}/tdnn1", 1, ch[j - 1], c)
        conv(f"{hf}.res2net_block.blocks.{{i}}.conv", f"{ours}/res2net", ks[j], sub, sub, cfg.enc_res2net_scale - 1)
        conv(f"{hf}.tdnn2.conv", f"{ours}/tdnn2", 1, c, c)
        conv(f"{hf}.se_block.conv1", f"{ours}/se/conv1", 1, c, cfg.enc_se_channels)
        conv(f"{hf}.se_block.conv2", f"{ours}/se/conv2", 1, cfg.enc_se_channels, c)
    conv("mfa.conv", "mfa", ks[-1], ch[-1], ch[-1])
    conv("asp.tdnn.conv", "asp/tdnn", 1, 3 * ch[-1], cfg.enc_attention_channels)
    conv("asp.conv", "asp/conv", 1, cfg.enc_attention_channels, ch[-1])
    conv("fc", "fc", 1, 2 * ch[-1], cfg.enc_dim)
    return entries, shapes


def load_speaker_encoder(tensors: Mapping[str, np.ndarray], cfg: SpeakerEncoderConfig,
                         dtype=np.float32) -> SpeakerEncoder:
    """`SpeakerEncoder` with the main checkpoint's ``speaker_encoder.*`` tensors (other tensors are ignored)."""
    entries, shapes = speaker_encoder_table(cfg)
    return load_module(lambda: SpeakerEncoder(cfg, dtype),
                       load_table(tensors, entries, shapes, np.float32, "speaker encoder"))


def random_speaker_encoder(cfg: SpeakerEncoderConfig, seed: int, dtype=np.float32) -> SpeakerEncoder:
    """`SpeakerEncoder` with seeded random weights (benchmarks): He-scaled convs, small biases."""
    rng = np.random.default_rng(seed)
    _, shapes = speaker_encoder_table(cfg)
    flat = {}
    for path, shape in shapes.items():
        if path.endswith("/b"):
            flat[path] = 0.05 * rng.standard_normal(shape)
        else:
            flat[path] = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[-3:-1]))
    return load_module(lambda: SpeakerEncoder(cfg, dtype), flat)
