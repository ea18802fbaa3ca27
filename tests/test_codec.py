"""Parity of the JAX 12 Hz tokenizer decoder with the live reference (tiny random model, fp32).

Error metric throughout: max |ours - reference| / max |reference| over all samples.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import safetensors.numpy

from qtts_jax import nn
from qtts_jax.io.checkpoint import hf_shapes, read_safetensors
from qtts_jax.io.errors import CheckpointError
from qtts_jax.codec.config import CodecConfig
from qtts_jax.presets import tiny_codec_config
from qtts_jax.codec.decoder import chunked_decode, decode
from qtts_jax.codec.weights import codec_decoder_table, load_codec_decoder

TOL = 1e-5
SPF = 1920  # samples per frame at the real rates the tiny config keeps


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def random_codes(seed: int, frames: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(batch, frames, 16), dtype=np.int64)


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
def decoder(checkpoint, cfg):
    return load_codec_decoder(checkpoint, cfg)


@pytest.fixture(scope="module")
def params(decoder):
    return nn.split(decoder)[1]


def reference_full(reference, codes: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return reference.decoder(torch.from_numpy(codes).transpose(1, 2)).squeeze(1).numpy()


def test_loader_matches_reference_modules(reference, checkpoint, cfg, decoder):
    """Our leaves equal the reference modules' own tensors, in our layouts."""
    import torch

    d, ref = cfg.decoder, reference.decoder
    assert (d.num_hidden_layers, d.hidden_size, d.head_dim, d.sliding_window) == (2, 16, 8, 72)
    assert cfg.decode_upsample_rate == d.samples_per_frame == SPF
    assert (checkpoint / "preprocessor_config.json").is_file()

    def np_(t):
        return t.detach().numpy()

    rest = ref.quantizer.rvq_rest.vq.layers
    with torch.no_grad():
        table4 = np_(rest[3]._codebook.decode(torch.arange(d.codebook_size)))  # codebook 4 = rest layer 3
    np.testing.assert_allclose(decoder.quantizer.codebooks[4], table4, rtol=1e-6)
    assert decoder.quantizer.codebooks.shape == (16, 2048, d.rvq_dim)
    np.testing.assert_array_equal(decoder.quantizer.first_proj, np_(ref.quantizer.rvq_first.output_proj.weight)[:, :, 0].T)

    layer1 = ref.pre_transformer.layers[1]
    np.testing.assert_array_equal(decoder.transformer.layers.q[1], np_(layer1.self_attn.q_proj.weight).T)
    np.testing.assert_array_equal(decoder.transformer.layers.mlp_scale[1], np_(layer1.mlp_layer_scale.scale))

    up = decoder.upsample[1]
    np.testing.assert_array_equal(up.conv.w, np_(ref.upsample[1][0].conv.weight).transpose(2, 0, 1))
    np.testing.assert_array_equal(up.convnext.dwconv.w, np_(ref.upsample[1][1].dwconv.conv.weight).transpose(2, 1, 0))

    block = decoder.vocoder.blocks[2]
    ref_block = ref.decoder[3].block
    np.testing.assert_array_equal(block.snake.alpha, np_(ref_block[0].alpha))
    np.testing.assert_array_equal(block.conv.w, np_(ref_block[1].conv.weight).transpose(2, 0, 1))
    np.testing.assert_array_equal(block.units[1].conv1.w, np_(ref_block[3].conv1.conv.weight).transpose(2, 1, 0))
    assert len(decoder.vocoder.blocks) == 4 and all(len(b.units) == 3 for b in decoder.vocoder.blocks)


def test_decoder_state_is_exactly_the_checkpoint(checkpoint, cfg, decoder):
    """Every parameter of the module is filled, through the name table or (the codebooks) from the raw sums and
    usages, at its shape, and every decoder tensor of the checkpoint fills one, but for the RVQs' input
    projections: only encoding through the decoder's quantizer would read them."""
    entries, shapes = codec_decoder_table(cfg)
    state = nn.state_shapes(decoder)
    raw = {path for path in shapes if path.startswith("raw/")}
    assert set(state) == set(shapes) - raw | {"quantizer/codebooks", "quantizer/first_proj", "quantizer/rest_proj"}
    assert all(state[path] == shapes[path] for path in set(shapes) - raw)
    tensors = read_safetensors(checkpoint)
    unused = {f"decoder.quantizer.{rvq}.input_proj.weight" for rvq in ("rvq_first", "rvq_rest")}
    assert hf_shapes(entries, shapes) == {k: v.shape for k, v in tensors.items()
                                          if k.startswith("decoder.") and k not in unused}


def test_full_decode_matches_reference(reference, cfg, params):
    codes = random_codes(1, 90)  # longer than the 72-frame attention window
    ref = reference_full(reference, codes)
    assert np.mean(np.abs(ref) >= 1.0) < 0.01, "random model saturates; parity would be meaningless"
    ours = decode(params, cfg, codes)
    assert ours.shape == (1, 90 * SPF) and ours.dtype == np.float32
    assert rel_err(ours, ref) <= TOL


def test_chunked_decode_matches_reference_decode(reference, cfg, params):
    import torch

    codes = random_codes(2, 330)  # crosses the 300-frame chunk boundary
    with torch.no_grad():
        ref = reference.decode(torch.from_numpy(codes)).audio_values[0].numpy()
    ours = np.asarray(chunked_decode(params, cfg, codes))
    assert ours.shape == (1, 330 * SPF)
    assert rel_err(ours[0], ref) <= TOL
    # Chunking must actually matter here, or this test could not tell it from a full decode.
    full = np.asarray(decode(params, cfg, codes))
    assert np.abs(full[:, 300 * SPF :] - ours[:, 300 * SPF :]).max() > 1e-3
    assert rel_err(ours[:, : 300 * SPF], full[:, : 300 * SPF]) <= TOL


def test_batch_rows_are_independent(cfg, params):
    codes = np.concatenate([random_codes(1, 90), random_codes(3, 90)])
    batched = np.asarray(decode(params, cfg, codes))
    for row in range(2):
        single = np.asarray(decode(params, cfg, codes[row : row + 1]))
        assert rel_err(batched[row], single[0]) <= TOL
    assert np.abs(batched[0] - batched[1]).max() > 0.1


@pytest.fixture
def tensors(checkpoint):
    return dict(read_safetensors(checkpoint, "model"))


def write_variant(tmp_path, checkpoint, tensors):
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(
    "name",
    ["decoder.pre_transformer.layers.1.mlp.up_proj.weight", "decoder.quantizer.rvq_rest.vq.layers.3._codebook.cluster_usage"],
)
def test_missing_tensor_is_named(tmp_path, checkpoint, cfg, tensors, name):
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"'{name}' is missing"):
        load_codec_decoder(write_variant(tmp_path, checkpoint, tensors), cfg)


def test_misshaped_tensor_names_both_shapes(tmp_path, checkpoint, cfg, tensors):
    name = "decoder.decoder.2.block.1.conv.weight"  # second vocoder block's transposed conv, 32 -> 16, k 10
    assert tensors[name].shape == (32, 16, 10)
    tensors[name] = tensors[name][:, :, :9]
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(32, 16, 9\), expected \(32, 16, 10\)"):
        load_codec_decoder(write_variant(tmp_path, checkpoint, tensors), cfg)


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=str(tmp_path / "config.json")):
        CodecConfig.from_file(tmp_path)


def test_config_lacking_a_field_is_refused(checkpoint, tmp_path):
    d = json.loads((checkpoint / "config.json").read_text())
    del d["decoder_config"]["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="hidden_size"):
        CodecConfig.from_file(tmp_path)


@pytest.mark.parametrize("field, value", [("input_sample_rate", 16000), ("output_sample_rate", 48000),
                                          ("decode_upsample_rate", 960)])
def test_config_with_other_audio_rates_is_refused(field, value):
    """Stream timing, the server and the studies use codec.config's SAMPLE_RATE and SAMPLES_PER_FRAME."""
    with pytest.raises(CheckpointError, match=f"{value}.*this port serves 24000 Hz audio in frames of 1920 samples"):
        CodecConfig.from_dict({**tiny_codec_config(), field: value})
