"""Reference-side helpers: a tiny, fully randomised ``Qwen3TTSTokenizerV2Model`` and its checkpoint on disk.

Import this only inside fixtures: importing ``qwen_tts`` takes several seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ref_masks  # noqa: F401  (installs the reference's masks built without vmap: every reference build comes here)
import torch

from qtts_jax.presets import tiny_codec_config

PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "sampling_rate": 24000,
    "padding_value": 0.0,
    "return_attention_mask": True,
}


def build_reference_codec(config_dict: dict | None = None, seed: int = 0):
    """The reference tokenizer model (eager attention, eval mode) with every parameter randomised."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    cfg = Qwen3TTSTokenizerV2Config(**(config_dict or tiny_codec_config()))
    for c in (cfg, cfg.encoder_config, cfg.decoder_config):
        c._attn_implementation = "eager"
    model = Qwen3TTSTokenizerV2Model(cfg).eval()
    randomize_(model, seed)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter (and the Mimi codebook buffers) with seeded random values.

    Default init is useless for parity: ``embedding_sum`` starts at zero, so the decoder outputs silence,
    and LayerScale / ConvNeXt gamma start near zero, hiding the transformer and ConvNeXt blocks.
    Weights get std gain/sqrt(fan-in): gain 1 keeps activations O(1); the vocoder's residual branches and
    its output conv get less, else the 12 residual units compound and the clamped audio saturates.
    """
    gen = torch.Generator().manual_seed(seed)
    gains = {id(unit.conv2.conv): 0.3 for unit in model.modules() if type(unit).__name__.endswith("ResidualUnit")}
    gains[id(model.decoder.decoder[-1].conv)] = 0.1
    for module in model.modules():
        kind = type(module).__name__
        tensors = list(module.named_parameters(recurse=False))
        # Mimi keeps its codebooks as persistent buffers; other buffers (RoPE inv_freq, flags) stay.
        tensors += [(n, b) for n, b in module.named_buffers(recurse=False) if n in ("cluster_usage", "embed_sum")]
        for leaf, tensor in tensors:
            shape = tensor.shape
            if leaf == "cluster_usage":
                value = _uniform(gen, shape, 0.5, 2.0)
            elif leaf in ("embedding_sum", "embed_sum"):
                value = _normal(gen, shape)
            elif leaf in ("alpha", "beta"):  # SnakeBeta, log space
                value = _normal(gen, shape, 0.3)
            elif "LayerScale" in kind or leaf == "gamma":
                value = _uniform(gen, shape, 0.2, 0.6)
            elif "Norm" in kind and leaf == "weight":
                value = _normal(gen, shape, 0.1, mean=1.0)
            elif leaf == "bias":
                value = _normal(gen, shape, 0.05)
            else:
                gain = gains.get(id(module), 1.0)
                value = _normal(gen, shape, gain / math.sqrt(_fan_in(module, tensor)))
            tensor.copy_(value.to(tensor.dtype))


def _normal(gen, shape, std=1.0, mean=0.0):
    return mean + std * torch.randn(shape, generator=gen)


def _uniform(gen, shape, lo, hi):
    return lo + (hi - lo) * torch.rand(shape, generator=gen)


def _fan_in(module: torch.nn.Module, weight: torch.Tensor) -> int:
    """Inputs summed into one output: in*k/stride for ConvTranspose1d (in, out, k); in*k for the rest."""
    if isinstance(module, torch.nn.ConvTranspose1d):
        return weight.shape[0] * weight.shape[2] // module.stride[0]
    return math.prod(weight.shape[1:])


def write_codec_checkpoint(directory: Path, model) -> Path:
    """Write ``model`` as the real repo's ``speech_tokenizer/`` folder: weights, full config, preprocessor."""
    directory = Path(directory)
    model.save_pretrained(directory)
    # save_pretrained drops fields equal to the class defaults; the released config.json spells them all.
    model.config.to_json_file(directory / "config.json", use_diff=False)
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    return directory
