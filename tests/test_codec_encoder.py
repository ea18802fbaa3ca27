"""Parity of the JAX 12 Hz tokenizer encoder (Mimi) with the live reference (tiny random model, fp32).

Activations: max |ours - reference| / max |reference|. Codes are an argmin, so a float-rounding difference
can flip a code only where the reference's best and second-best codewords are nearly equally far. The
test measures each gap on the reference side (float64, along the reference's own residual path) and
demands equality wherever that gap exceeds MARGIN; a near-tie also exempts the later codebooks of its RVQ
in that frame, whose residuals depend on it. Near-ties must be rare (none occur for the clips here).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy

from qtts_jax import nn
from qtts_jax.io.checkpoint import hf_shapes, read_safetensors
from qtts_jax.io.errors import CheckpointError
from qtts_jax.codec.config import CodecConfig, CodecEncoderConfig
from qtts_jax.codec.encoder import CodecEncoder, encode, encode_latents
from qtts_jax.codec.encoder_weights import codec_encoder_table, load_codec_encoder, random_codec_encoder
from qtts_jax.presets import real_codec_config, real_codec_encoder_config, tiny_codec_config

TOL = 1e-5
# Relative to |residual|^2 + |codeword|^2, the size of the terms the reference's cdist rounds. Our latent
# is within ~1e-6 of the reference's, which moves a relative gap by at most ~2e-6: 1e-5 is 5x that.
MARGIN = 1e-5
LENGTHS = (12_000, 24_000, 32_887)  # 0.5 s, 1 s, 1.37 s; 32887 leaves a partial stride at every strided conv


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def clip(n: int, seed: int = 0) -> np.ndarray:
    """Voice-like test audio: a gliding 120-180 Hz harmonic tone under a syllable envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 24_000
    phase = 2 * np.pi * np.cumsum(150 + 30 * np.sin(2 * np.pi * 0.7 * t)) / 24_000
    tone = sum(np.sin(k * phase + rng.uniform(0, 2 * np.pi)) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    return (0.2 * envelope * tone + 0.01 * rng.standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(reference_codec):
    return reference_codec


@pytest.fixture(scope="module")
def checkpoint(codec_checkpoint):
    return codec_checkpoint


@pytest.fixture(scope="module")
def cfg(checkpoint):
    return CodecConfig.from_file(checkpoint)


@pytest.fixture(scope="module")
def params(checkpoint, cfg):
    return nn.split(load_codec_encoder(checkpoint, cfg))[1]


def run_reference(model, checkpoint, wav: np.ndarray) -> tuple[np.ndarray, dict]:
    """Codes [T, 16] from the reference's public wrapper (``Qwen3TTSTokenizer.encode`` of a 24 kHz numpy
    clip: feature extractor, then ``model.encode(values, padding_mask)``), and the Mimi stage outputs."""
    import torch
    from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer
    from transformers import AutoFeatureExtractor

    tokenizer = Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.device = model, torch.device("cpu")
    tokenizer.feature_extractor = AutoFeatureExtractor.from_pretrained(checkpoint)
    mimi, acts = model.encoder, {}
    hooks = [
        mimi.encoder.register_forward_hook(lambda m, i, o: acts.__setitem__("seanet", o[0].T.numpy())),
        mimi.encoder_transformer.register_forward_hook(lambda m, i, o: acts.__setitem__("transformer", o[0][0].numpy())),
        mimi.downsample.register_forward_hook(lambda m, i, o: acts.__setitem__("latent", o[0].T.numpy())),
    ]
    try:
        (codes,) = tokenizer.encode(wav, sr=24_000).audio_codes
    finally:
        for h in hooks:
            h.remove()
    return codes.numpy(), acts


@pytest.fixture(scope="module")
def reference_runs(reference, checkpoint):
    return {n: run_reference(reference, checkpoint, clip(n, seed=n)) for n in LENGTHS}


def uncertain_codes(latent: np.ndarray, codes: np.ndarray, quantizer: dict, n_semantic: int) -> np.ndarray:
    """[T, Q] bool: the reference's choice there (or earlier in the same RVQ and frame) is a near-tie."""
    latent = latent.astype(np.float64)
    books = np.asarray(quantizer["codebooks"], np.float64)
    near = np.zeros(codes.shape, bool)
    for proj, span in [("semantic_proj", range(n_semantic)), ("acoustic_proj", range(n_semantic, codes.shape[1]))]:
        residual = latent @ np.asarray(quantizer[proj], np.float64)
        tied = np.zeros(len(latent), bool)
        for q in span:
            chosen = books[q][codes[:, q]]
            distance = ((residual[:, None, :] - books[q][None]) ** 2).sum(-1)
            best, second = np.sort(distance, axis=1)[:, :2].T
            scale = (residual**2).sum(-1) + (chosen**2).sum(-1)
            tied |= (second - best) <= MARGIN * scale
            near[:, q] = tied
            residual = residual - chosen
    return near


def test_config_and_loader_match_reference(reference, cfg, params):
    """The tiny encoder keeps the release's layout (32 codebooks, 16 kept, RVQ input projection); our
    leaves equal the reference modules' tensors, in our layouts."""
    import torch

    e, mimi = cfg.encoder, reference.encoder
    assert (e.num_quantizers, cfg.encoder_valid_num_quantizers, e.num_semantic_quantizers) == (32, 16, 1)
    assert (e.frame_size, e.hop_length, e.downsample_kernel, e.frame_rate) == (1920, 960, 4, 12.5)
    assert e.codebook_dim != e.hidden_size and mimi.quantizer.acoustic_residual_vector_quantizer.input_proj is not None

    def np_(t):
        return t.detach().numpy()

    def conv_w(module):  # torch (out, in, k) -> ours (k, in, out)
        return np_(module.conv.weight).transpose(2, 1, 0)

    seanet, layers = params["seanet"], mimi.encoder.layers
    assert len(seanet["stages"]) == 4 and all(len(s["blocks"]) == 2 for s in seanet["stages"].values())
    # layers: 0 conv, then per stage [block, block, ELU, conv]; stage 1's second block (dilation 2) is 6.
    np.testing.assert_array_equal(seanet["stages"][1]["blocks"][1]["conv1"]["w"], conv_w(layers[6].block[1]))
    np.testing.assert_array_equal(seanet["stages"][1]["down"]["w"], conv_w(layers[8]))
    np.testing.assert_array_equal(seanet["conv_out"]["b"], np_(layers[18].conv.bias))
    ours, layer1 = params["transformer"]["layers"], mimi.encoder_transformer.layers[1]
    np.testing.assert_array_equal(ours["k"][1], np_(layer1.self_attn.k_proj.weight).T)
    np.testing.assert_array_equal(ours["mlp_norm"]["bias"][1], np_(layer1.post_attention_layernorm.bias))
    np.testing.assert_array_equal(params["downsample"]["w"], conv_w(mimi.downsample))

    quantizer, acoustic = params["quantizer"], mimi.quantizer.acoustic_residual_vector_quantizer
    assert quantizer["codebooks"].shape == (16, 2048, e.codebook_dim)
    np.testing.assert_array_equal(quantizer["acoustic_proj"], np_(acoustic.input_proj.weight)[:, :, 0].T)
    with torch.no_grad():
        table = np_(acoustic.layers[4].codebook.decode(torch.arange(e.codebook_size)))  # codebook 5 = acoustic 4
    np.testing.assert_allclose(quantizer["codebooks"][5], table, rtol=1e-6)


def test_encoder_state_is_exactly_the_checkpoint(checkpoint, cfg, params):
    """Every parameter of the module is filled, through the name table or (the codebooks) from the raw sums and
    usages, at its shape; every encoder tensor of the checkpoint fills one, but for the codebooks past the 16
    the tokenizer keeps, the codebooks' `initialized` flags (Mimi's training state, no weights) and the RVQs'
    output projections (only decoding through the encoder's quantizer would read them)."""
    entries, shapes = codec_encoder_table(cfg)
    state = nn.state_shapes(nn.merge(nn.graph_of(CodecEncoder, cfg), params))
    raw = {path for path in shapes if path.startswith("raw/")}
    assert set(state) == set(shapes) - raw | {"quantizer/codebooks", "quantizer/semantic_proj", "quantizer/acoustic_proj"}
    assert all(state[path] == shapes[path] for path in set(shapes) - raw)
    kept = cfg.encoder_valid_num_quantizers - cfg.encoder.num_semantic_quantizers
    tensors = {k: v.shape for k, v in read_safetensors(checkpoint).items() if k.startswith("encoder.")}
    past = {k for k in tensors if (m := re.search(r"acoustic_residual_vector_quantizer\.layers\.(\d+)\.", k))
            and int(m[1]) >= kept}
    flags = {k for k in tensors if k.endswith(".codebook.initialized")}
    output = {f"encoder.quantizer.{rvq}_residual_vector_quantizer.output_proj.weight" for rvq in ("semantic", "acoustic")}
    assert past and hf_shapes(entries, shapes) == {k: v for k, v in tensors.items() if k not in past | flags | output}


@pytest.mark.parametrize("n", LENGTHS)
def test_activations_match_reference(params, cfg, reference_runs, n):
    _, ref = reference_runs[n]
    ours = encode_latents(params, cfg, clip(n, seed=n))
    assert ours.seanet.shape == (-(-n // 960), 16) and ours.latent.shape == (-(-n // 1920), 16)
    for stage in ("seanet", "transformer", "latent"):
        assert rel_err(getattr(ours, stage), ref[stage]) <= TOL, stage


@pytest.mark.parametrize("n", LENGTHS)
def test_codes_match_reference(params, cfg, reference_runs, n):
    ref_codes, ref = reference_runs[n]
    ours = encode(params, cfg, clip(n, seed=n))
    assert ours.shape == ref_codes.shape == (-(-n // 1920), 16) and ours.dtype == np.int32
    uncertain = uncertain_codes(ref["latent"], ref_codes, params["quantizer"], cfg.encoder.num_semantic_quantizers)
    assert uncertain.mean() <= 0.02, "near-ties should be rare; the margin or the randomisation is off"
    np.testing.assert_array_equal(ours[~uncertain], ref_codes[~uncertain])


def test_reference_keeps_the_first_16_of_32_codebooks(reference, reference_runs):
    """Mimi's own encode gives 32 codebooks; the tokenizer's codes are its first 16, frames unchanged."""
    import torch

    n = LENGTHS[1]
    with torch.no_grad():
        full = reference.encoder.encode(torch.from_numpy(clip(n, seed=n))[None, None]).audio_codes[0].numpy()
    assert full.shape == (32, -(-n // 1920))
    np.testing.assert_array_equal(reference_runs[n][0], full[:16].T)


def test_bucket_padding_changes_nothing(params, cfg):
    """Right-padding to a bucket equals the unpadded run to float rounding (different shapes, different
    XLA tiling): same codes. 32887 samples end mid-stride at every strided conv."""
    wav = clip(LENGTHS[2], seed=1)
    exact = encode_latents(params, cfg, wav, bucket_frames=None)
    for bucket in (16, 64):
        padded = encode_latents(params, cfg, wav, bucket_frames=bucket)
        for stage in ("seanet", "transformer", "latent"):
            assert rel_err(getattr(padded, stage), getattr(exact, stage)) <= 1e-6, (bucket, stage)
        codes = encode(params, cfg, wav, bucket_frames=bucket)
        np.testing.assert_array_equal(codes, encode(params, cfg, wav, bucket_frames=None))


def test_reference_ignores_the_sliding_window(reference, checkpoint, reference_runs):
    """transformers 4.57's Mimi builds a plain causal mask: a window of 8 steps changes nothing on a 1 s
    clip (25 steps), so the port attends to all past steps."""
    from ref_codec import build_reference_codec

    config = tiny_codec_config()
    config["encoder_config"]["sliding_window"] = 8
    narrow = build_reference_codec(config, seed=0)
    n = LENGTHS[1]
    _, acts = run_reference(narrow, checkpoint, clip(n, seed=n))
    np.testing.assert_array_equal(acts["transformer"], reference_runs[n][1]["transformer"])


@pytest.fixture
def tensors(checkpoint):
    return dict(read_safetensors(checkpoint, "model"))


def write_variant(tmp_path, checkpoint, tensors):
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(
    "name",
    [
        "encoder.encoder_transformer.layers.1.input_layernorm.bias",
        "encoder.encoder.layers.13.block.3.conv.weight",
        "encoder.quantizer.acoustic_residual_vector_quantizer.layers.14.codebook.cluster_usage",
        "encoder.quantizer.semantic_residual_vector_quantizer.input_proj.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path, checkpoint, cfg, tensors, name):
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"'{name}' is missing"):
        load_codec_encoder(write_variant(tmp_path, checkpoint, tensors), cfg)


def test_codebooks_past_the_kept_16_are_not_read(tmp_path, checkpoint, cfg, tensors):
    for name in [k for k in tensors if ".acoustic_residual_vector_quantizer.layers.15." in k]:
        del tensors[name]
    load_codec_encoder(write_variant(tmp_path, checkpoint, tensors), cfg)


def test_misshaped_tensor_names_both_shapes(tmp_path, checkpoint, cfg, tensors):
    name = "encoder.downsample.conv.weight"
    assert tensors[name].shape == (16, 16, 4)
    tensors[name] = tensors[name][:, :, :3]
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(16, 16, 3\), expected \(16, 16, 4\)"):
        load_codec_encoder(write_variant(tmp_path, checkpoint, tensors), cfg)


def test_encoder_config_defaults_are_mimis():
    """Missing fields take MimiConfig's defaults, which are the released encoder (§2.3)."""
    from transformers import MimiConfig

    mimi, ours = MimiConfig(), CodecEncoderConfig.from_dict({})
    for field in dataclasses.fields(CodecEncoderConfig):
        expected = getattr(mimi, field.name)
        assert getattr(ours, field.name) == (tuple(expected) if isinstance(expected, list) else expected), field.name
    assert CodecEncoderConfig.from_dict(real_codec_encoder_config()) == ours
    assert CodecConfig.from_dict(real_codec_config()).encoder == ours


def test_codec_config_encoder_fields(checkpoint):
    d = json.loads((checkpoint / "config.json").read_text())
    assert "_frame_rate" in d["encoder_config"]  # save_pretrained's spelling of frame_rate
    encoder_keys = ("encoder_config", "encoder_valid_num_quantizers", "encode_downsample_rate")
    no_encoder = {k: v for k, v in d.items() if k not in encoder_keys}
    cfg = CodecConfig.from_dict(no_encoder)
    assert (cfg.encoder, cfg.encoder_valid_num_quantizers, cfg.encode_downsample_rate) == (None, 16, 1920)
    with pytest.raises(CheckpointError, match="encode_downsample_rate 960"):
        CodecConfig.from_dict({**d, "encode_downsample_rate": 960})
    with pytest.raises(CheckpointError, match="hidden_act"):
        CodecConfig.from_dict({**d, "encoder_config": {**d["encoder_config"], "hidden_act": "silu"}})


def test_random_params_at_released_shape():
    """Benchmarks' real-shape weights run: 0.2 s gives 3 frames of 16 codes in range."""
    cfg = CodecConfig.from_dict(real_codec_config())
    codes = encode(nn.split(random_codec_encoder(cfg, seed=0))[1], cfg, clip(4_800), bucket_frames=None)
    assert codes.shape == (3, 16) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < 2048
