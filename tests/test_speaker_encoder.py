"""Speaker encoder (log-mel + ECAPA-TDNN) against the reference, in fp32.

Relative error throughout: max |ours - ref| / max |ref| over the whole output.
"""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtts_jax import nn
from qtts_jax.io.checkpoint import hf_shapes, read_safetensors
from qtts_jax.io.errors import CheckpointError
from qtts_jax.speaker.config import SpeakerEncoderConfig
from qtts_jax.speaker.ecapa import bucket_samples, encode, min_samples, speaker_embedding
from qtts_jax.speaker.mel import FMAX, FMIN, HOP, N_FFT, N_MELS, SAMPLE_RATE, log_mel, mel_filterbank, num_frames
from qtts_jax.speaker.weights import load_speaker_encoder, random_speaker_encoder, speaker_encoder_table
from support import compiled_programs, compiles

TOL = 1e-5


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def audio(n: int, seed: int) -> np.ndarray:
    """Noise inside [-1, 1] (the reference warns outside it): every mel bin well above the log floor."""
    return np.clip(0.25 * np.random.default_rng(seed).standard_normal(n), -1, 1).astype(np.float32)


def state_tensors(encoder) -> dict:
    """The encoder's tensors under the names ``save_pretrained`` gives them inside the full model."""
    return {f"speaker_encoder.{k}": v.numpy() for k, v in encoder.state_dict().items()}


@pytest.fixture(scope="module")
def tiny():
    """seed -> (reference encoder, our config, our params loaded through the name table)."""
    from ref_speaker import TINY_CONFIG, build_reference_speaker_encoder

    built = {}

    def get(seed: int):
        if seed not in built:
            ref = build_reference_speaker_encoder(TINY_CONFIG, seed)
            cfg = SpeakerEncoderConfig.from_dict(TINY_CONFIG)
            built[seed] = ref, cfg, nn.split(load_speaker_encoder(state_tensors(ref), cfg))[1]
        return built[seed]

    return get


def test_filterbank_matches_librosa():
    import librosa

    for sr, n_fft, n_mels, fmin, fmax in [(SAMPLE_RATE, N_FFT, N_MELS, FMIN, FMAX), (16000, 512, 80, 20.0, 7600.0)]:
        ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
        ours = mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
        assert ours.dtype == ref.dtype and rel_err(ours, ref) <= 1e-7


@pytest.mark.parametrize("n", [4800, 12345, 48000])  # 12345 is not a multiple of the hop
def test_log_mel_matches_reference(n):
    from ref_speaker import reference_log_mel

    wav = audio(n, seed=n)
    ref = reference_log_mel(wav)[0].numpy()
    assert rel_err(log_mel(jnp.asarray(wav), n), ref) <= TOL
    # In a bucket-sized buffer with the length traced: the true frames are the same, reflected at the true end.
    padded = np.pad(wav, (0, bucket_samples(n) - n))
    bucketed = jax.jit(log_mel)(jnp.asarray(padded), n)
    assert bucketed.shape[0] == bucket_samples(n) // HOP and np.all(np.isfinite(bucketed))
    assert rel_err(bucketed[: num_frames(n)], ref) <= TOL


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n", [7000, 48000])
def test_xvector_matches_reference(tiny, seed, n):
    import torch
    from ref_speaker import reference_log_mel

    ref_encoder, cfg, params = tiny(seed)
    wav = audio(n, seed=100 + seed)
    mel = reference_log_mel(wav)
    with torch.no_grad():
        ref = ref_encoder(mel)[0].numpy()
    # The encoder alone on the reference's mel, then the whole path from audio.
    assert rel_err(encode(params, cfg, jnp.asarray(mel[0].numpy()), mel.shape[1]), ref) <= TOL
    ours = speaker_embedding(params, cfg, wav)
    assert ours.dtype == np.float32 and ours.shape == (cfg.enc_dim,)
    assert rel_err(ours, ref) <= TOL


def test_model_extract_speaker_embedding_from_checkpoint(reference_checkpoint):
    """A Base checkpoint written by save_pretrained: its config gives only enc_dim, so the defaults must be
    the released architecture; the reference model's own extract_speaker_embedding is the target."""
    model, directory = reference_checkpoint("base")
    spk = json.loads((directory / "config.json").read_text())["speaker_encoder_config"]
    cfg = SpeakerEncoderConfig.from_dict(spk)
    assert cfg.enc_dim == model.config.talker_config.hidden_size
    params = nn.split(load_speaker_encoder(read_safetensors(directory), cfg))[1]
    wav = audio(36000, seed=7)
    ref = model.extract_speaker_embedding(wav, sr=24000).float().numpy()
    assert rel_err(speaker_embedding(params, cfg, wav), ref) <= TOL


def test_shortest_audio_is_the_references(tiny):
    """Below min_samples the reference's reflect padding fails; we refuse it up front and agree at it."""
    import torch
    from ref_speaker import reference_log_mel

    ref_encoder, cfg, params = tiny(0)
    n = min_samples(cfg)
    with torch.no_grad(), pytest.raises(RuntimeError):
        ref_encoder(reference_log_mel(audio(n - 1, seed=0)))
    with pytest.raises(ValueError, match="too short"):
        speaker_embedding(params, cfg, audio(n - 1, seed=0))
    with torch.no_grad():
        ref = ref_encoder(reference_log_mel(audio(n, seed=0)))[0].numpy()
    assert num_frames(n) < 64 <= num_frames(bucket_samples(n))  # mostly padding frames
    assert rel_err(speaker_embedding(params, cfg, audio(n, seed=0)), ref) <= TOL


def test_buckets_cover_1_to_30_s_in_6_compilations():
    lengths = range(SAMPLE_RATE, 30 * SAMPLE_RATE + 1, 97)
    buckets = {bucket_samples(n) for n in lengths}
    assert sorted(buckets) == [64 * HOP * 2**k for k in range(1, 7)]
    assert all(n <= bucket_samples(n) < 2 * max(n, 64 * HOP) for n in lengths)
    assert bucket_samples(64 * HOP) == 64 * HOP and bucket_samples(64 * HOP + 1) == 128 * HOP


def test_one_compilation_per_bucket_and_each_length_the_references(tiny):
    """Lengths sharing a bucket compile once and each equals the reference on its own length, including
    the bucket's full length (no padding frames) and one sample past it (the next bucket, T frames of 2T)."""
    import torch
    from ref_speaker import reference_log_mel

    ref_encoder, cfg, params = tiny(1)
    boundary = 128 * HOP
    same_bucket = [64 * HOP + 1, 20000, boundary - HOP // 2, boundary]
    assert {bucket_samples(n) for n in same_bucket} == {boundary} and bucket_samples(boundary + 1) == 2 * boundary
    # Unbucketed: the buffer is exactly the audio (a compilation per length, outside speaker_embedding's cache).
    unbucketed = jax.jit(lambda p, wav: encode(p, cfg, log_mel(wav, wav.shape[0]), num_frames(wav.shape[0])))
    jax.clear_caches()  # no bucket an earlier test compiled
    for i, n in enumerate([*same_bucket, boundary + 1]):
        wav = audio(n, seed=200 + i)
        with torch.no_grad():
            ref = ref_encoder(reference_log_mel(wav))[0].numpy()
        with compiles() as seen:
            ours = speaker_embedding(params, cfg, wav)
        assert rel_err(ours, ref) <= TOL, n
        assert rel_err(ours, unbucketed(params, jnp.asarray(wav))) <= 2e-6, n  # float rounding only
        assert bool(compiled_programs(seen)) == (i == 0 or n > boundary), n  # a bucket's first length compiles


def test_state_is_exactly_the_checkpoint(tiny):
    """Every parameter of the module is filled through the name table at its shape, and every speaker-encoder
    tensor of the checkpoint fills one."""
    ref_encoder, cfg, _ = tiny(0)
    entries, shapes = speaker_encoder_table(cfg)
    assert nn.state_shapes(load_speaker_encoder(state_tensors(ref_encoder), cfg)) == shapes
    assert hf_shapes(entries, shapes) == {k: v.shape for k, v in state_tensors(ref_encoder).items()}


def test_missing_or_misshaped_tensor_is_named(tiny):
    ref_encoder, cfg, _ = tiny(0)
    name = "speaker_encoder.blocks.2.res2net_block.blocks.1.conv.weight"
    tensors = state_tensors(ref_encoder)
    del tensors[name]
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}' is missing")):
        load_speaker_encoder(tensors, cfg)
    tensors = state_tensors(ref_encoder)
    name = "speaker_encoder.asp.tdnn.conv.bias"
    tensors[name] = tensors[name][:-1]
    with pytest.raises(CheckpointError, match=re.escape(f"'{name}' has shape")):
        load_speaker_encoder(tensors, cfg)


def test_config_defaults_and_random_params(tiny):
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    ref = Qwen3TTSSpeakerEncoderConfig().to_dict()
    ours = SpeakerEncoderConfig.from_dict({})
    for field in ("mel_dim", "enc_dim", "enc_channels", "enc_kernel_sizes", "enc_dilations",
                  "enc_attention_channels", "enc_res2net_scale", "enc_se_channels", "sample_rate"):
        value = getattr(ours, field)
        assert (list(value) if isinstance(value, tuple) else value) == ref[field], field
    assert hash(SpeakerEncoderConfig.from_dict(ref)) == hash(ours)  # static jit argument

    _, cfg, loaded = tiny(0)
    random = nn.split(random_speaker_encoder(cfg, seed=0))[1]
    assert jax.tree.map(np.shape, random) == jax.tree.map(np.shape, loaded)
    assert np.all(np.isfinite(speaker_embedding(random, cfg, audio(4000, seed=0))))


def test_importable_without_torch_or_librosa():
    code = ("import sys; sys.modules['torch'] = sys.modules['librosa'] = None; "
            "import qtts_jax.speaker.ecapa, qtts_jax.speaker.weights")
    subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
