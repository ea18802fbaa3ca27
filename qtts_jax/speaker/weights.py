"""Speaker-encoder parameters: the name table from ``speaker_encoder.*`` in the main ``model.safetensors``.

Pytree (convs channels last as w (k, in, out) and b (out,)):

    tdnn                 input TDNN
    blocks               list per SE-Res2Net block: tdnn1, tdnn2; res2net (the scale-1 sub-convs stacked
                         on a leading axis); se {conv1, conv2}
    mfa                  multi-layer feature aggregation TDNN
    asp                  attentive statistics pooling: tdnn, conv
    fc                   final 1x1 conv to enc_dim
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax.checkpoint import CONV, Entry, load_table, unflatten
from qtts_jax.speaker.config import SpeakerEncoderConfig

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


def load_speaker_params(tensors: Mapping[str, np.ndarray], cfg: SpeakerEncoderConfig, dtype=np.float32) -> dict:
    """Speaker-encoder pytree from the main checkpoint's tensors (other tensors are ignored)."""
    entries, shapes = speaker_encoder_table(cfg)
    tree = load_table(tensors, entries, shapes, np.float32, "speaker encoder")
    return _finish(tree, cfg, dtype)


def random_speaker_params(cfg: SpeakerEncoderConfig, seed: int, dtype=np.float32) -> dict:
    """Seeded random weights at the config's shapes (benchmarks): He-scaled convs, small biases."""
    rng = np.random.default_rng(seed)
    _, shapes = speaker_encoder_table(cfg)
    flat = {}
    for path, shape in shapes.items():
        if path.endswith("/b"):
            flat[path] = 0.05 * rng.standard_normal(shape)
        else:
            flat[path] = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[-3:-1]))
    return _finish(unflatten(flat), cfg, dtype)


def _finish(tree: dict, cfg: SpeakerEncoderConfig, dtype) -> dict:
    tree["blocks"] = [tree["blocks"][str(j)] for j in range(cfg.num_blocks)]
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), tree)
