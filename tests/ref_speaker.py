"""Reference-side helpers for the speaker encoder: a tiny randomised ``Qwen3TTSSpeakerEncoder`` and its log-mel.

Import inside tests or fixtures only: importing ``qwen_tts`` takes seconds.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Every field the reference config has, at a size that runs in milliseconds; channel constraints as the
# reference needs them (SE-Res2Net blocks equal, their sum the MFA width).
TINY_CONFIG = dict(
    mel_dim=128, enc_dim=24, enc_channels=[32, 32, 32, 32, 96], enc_kernel_sizes=[5, 3, 3, 3, 1],
    enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=16, enc_res2net_scale=4, enc_se_channels=8,
    sample_rate=24000,
)


def build_reference_speaker_encoder(config: dict = TINY_CONFIG, seed: int = 0):
    """The reference ECAPA-TDNN (eval mode) with every parameter randomised."""
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder

    encoder = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**config)).eval()
    randomize_speaker_encoder_(encoder, seed)
    return encoder


@torch.no_grad()
def randomize_speaker_encoder_(encoder: torch.nn.Module, seed: int) -> None:
    """Seeded weights with O(1) activations: conv weights N(0, gain²/fan_in), biases N(0, 0.05²).

    There is no batch norm (the reference drops SpeechBrain's), so parameters are all there is. The input
    TDNN gets a smaller gain because log-mels sit around -5, not 0; the others get He's sqrt(2) for ReLU.
    """
    gen = torch.Generator().manual_seed(seed)
    first = encoder.blocks[0].conv.weight
    for name, tensor in encoder.named_parameters():
        if name.endswith("bias"):
            value = 0.05 * torch.randn(tensor.shape, generator=gen)
        else:
            gain = 0.3 if tensor is first else math.sqrt(2.0)
            value = gain * torch.randn(tensor.shape, generator=gen) / math.sqrt(math.prod(tensor.shape[1:]))
        tensor.copy_(value.to(tensor.dtype))


def reference_log_mel(wav: np.ndarray) -> torch.Tensor:
    """[1, T, 128] log-mel exactly as ``extract_speaker_embedding`` computes it (its hard-coded parameters)."""
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    mel = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                          hop_size=256, win_size=1024, fmin=0, fmax=12000)
    return mel.transpose(1, 2)
