"""Named models that need no checkpoint: `tiny-random` (runs anywhere, says noise) and the real shapes.

Each preset is written as the `config.json` dict a checkpoint would carry (and the codec's as its
`speech_tokenizer/config.json`), so it goes through exactly the same parsing as a real directory. `0.6b` / `1.7b` carry the released shapes and special ids
(architecture note §2) with random weights: for benchmarks, not for listening.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import pre_tokenizers

from qtts_jax.codec.config import MODEL_TYPE, SAMPLE_RATE, SAMPLES_PER_FRAME
from qtts_jax.io.text import byte_level_bpe

LANGUAGES = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
    "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECT = {name: False for name in SPEAKERS} | {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

_CODEC_IDS = dict(
    codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154,
    codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
)


def decoder_config(hidden, inter, layers, heads, kv, head_dim, vocab, **extra):
    """A Qwen3 decoder stack's config.json entries (the talker's or the code predictor's), as every preset and the
    tests' reference model build them."""
    return dict(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, **extra,
    )


def model_config(
    *, size: str, kind: str, talker: dict, predictor: dict, text_vocab: int, text_hidden: int, text_ids: dict
) -> dict:
    """A config.json dict for a CustomVoice/Base/VoiceDesign model with the released special ids."""
    custom = kind == "custom_voice"
    return dict(
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=size,
        tts_model_type=kind,
        **text_ids,
        speaker_encoder_config={"enc_dim": talker["hidden_size"], "sample_rate": SAMPLE_RATE},
        talker_config=dict(
            talker,
            code_predictor_config=predictor,
            text_vocab_size=text_vocab,
            text_hidden_size=text_hidden,
            num_code_groups=16,
            rope_scaling={"interleaved": True, "mrope_section": _mrope_section(talker["head_dim"]), "rope_type": "default"},
            codec_language_id=LANGUAGES | (DIALECTS if custom else {}),
            spk_id=SPEAKERS if custom else {},
            spk_is_dialect=SPEAKER_DIALECT if custom else {},
            **_CODEC_IDS,
        ),
    )


def _mrope_section(head_dim: int) -> list[int]:
    """[24, 20, 20] at head_dim 128 (released); a split summing to head_dim / 2 for tiny models."""
    half = head_dim // 2
    return [24, 20, 20] if head_dim == 128 else [half - 2 * (half // 4), half // 4, half // 4]


_REAL_TEXT_IDS = dict(
    im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
    tts_bos_token_id=151672, tts_eos_token_id=151673,
)


def real_config(size: str, kind: str = "custom_voice") -> dict:
    """Released shapes: "0b6" (talker 1024) or "1b7" (talker 2048, predictor 1024)."""
    hidden, inter = {"0b6": (1024, 3072), "1b7": (2048, 6144)}[size]
    return model_config(
        size=size, kind=kind,
        talker=decoder_config(hidden, inter, 28, 16, 8, 128, 3072, max_position_embeddings=32768),
        predictor=decoder_config(1024, 3072, 5, 16, 8, 128, 2048, max_position_embeddings=65536),
        text_vocab=151936, text_hidden=2048, text_ids=_REAL_TEXT_IDS,
    )


# tiny-random's tokenizer: the 256 byte symbols, merges that make "assistant" one token (the prompt
# layout relies on <|im_start|> assistant \n being three tokens), and the special tokens after them.
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]


def tiny_tokenizer_parts() -> tuple[dict[str, int], list[tuple[str, str]], dict[int, dict]]:
    """(vocab, merges, added tokens) of the tiny byte-level BPE; also written into test checkpoints."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    word = "assistant"
    for i in range(1, len(word)):
        merges.append((word[:i], word[i]))
        vocab.setdefault(word[: i + 1], len(vocab))
    added = {len(vocab) + i: {"content": s, "special": True} for i, s in enumerate(_TINY_SPECIALS)}
    return vocab, merges, added


def tiny_config(kind: str = "custom_voice", size: str = "1b7") -> dict:
    """Small dims, real codec vocabulary (3072 / 2048, 16 groups) and special ids; predictor narrower."""
    vocab, _, added = tiny_tokenizer_parts()
    ids = {v["content"]: k for k, v in added.items()}
    text_ids = dict(
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"], tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"], tts_eos_token_id=ids["<tts_text_eod>"],
    )
    return model_config(
        size=size, kind=kind,
        talker=decoder_config(64, 128, 2, 4, 2, 16, 3072),
        predictor=decoder_config(32, 64, 2, 4, 1, 16, 2048),
        text_vocab=len(vocab) + len(added), text_hidden=48, text_ids=text_ids,
    )


def preset_configs(name: str) -> tuple[dict, dict]:
    """(config.json, speech_tokenizer/config.json) dicts of a preset: tiny-random[-base], 0.6b[-base], 1.7b[-base]."""
    kind = "base" if name.endswith("-base") else "custom_voice"
    size = name.removesuffix("-base")
    if size == "tiny-random":
        return tiny_config(kind), tiny_codec_config()
    return real_config({"0.6b": "0b6", "1.7b": "1b7"}[size], kind), real_codec_config()


# Top-level fields of the released file: 16 of the encoder's codebooks, and the family's audio rates.
_RELEASED_TOP_LEVEL = {
    "model_type": MODEL_TYPE,
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": SAMPLE_RATE,
    "output_sample_rate": SAMPLE_RATE,
    "decode_upsample_rate": SAMPLES_PER_FRAME,
    "encode_downsample_rate": SAMPLES_PER_FRAME,
}


def tiny_codec_config(num_hidden_layers: int = 2) -> dict:
    """A complete tiny ``speech_tokenizer/config.json``: small widths, but the real codebook layout and rates.

    Keeping 2048 codes x 16 quantizers and rates [8,5,4,3]x[2,2] (1920 samples per frame at 24 kHz) makes
    tiny runs exercise the same indexing, chunking and output lengths as the released model.
    The tiny ``encoder_config`` (Mimi) keeps the released structure where it matters for the port: 32
    codebooks of which 16 are kept, an RVQ input projection (codebook_dim != hidden_size), and, beyond the
    release, two residual layers per stage (dilation 2) and grouped-query attention.
    """
    return {
        **_RELEASED_TOP_LEVEL,
        "decoder_config": {
            "codebook_size": 2048,
            "codebook_dim": 32,
            "num_quantizers": 16,
            "num_semantic_quantizers": 1,
            "latent_dim": 32,
            "decoder_dim": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "attention_bias": False,
            "sliding_window": 72,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "layer_scale_initial_scale": 0.01,
            "max_position_embeddings": 8000,
            "hidden_act": "silu",
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
        },
        "encoder_config": {
            "sampling_rate": SAMPLE_RATE,
            "frame_rate": SAMPLE_RATE / SAMPLES_PER_FRAME,
            "audio_channels": 1,
            "hidden_size": 16,
            "num_filters": 4,
            "num_residual_layers": 2,
            "upsampling_ratios": [8, 6, 5, 4],
            "codebook_size": 2048,
            "codebook_dim": 8,
            "vector_quantization_hidden_dimension": 8,
            "num_quantizers": 32,
            "num_semantic_quantizers": 1,
            "upsample_groups": 16,
            "num_hidden_layers": 2,
            "intermediate_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 250,
        },
    }


def real_codec_encoder_config() -> dict:
    """The released ``encoder_config`` (architecture note §2.3): HF ``MimiConfig`` defaults, spelled out."""
    return {
        "sampling_rate": SAMPLE_RATE, "frame_rate": SAMPLE_RATE / SAMPLES_PER_FRAME, "audio_channels": 1, "num_filters": 64,
        "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
        "residual_kernel_size": 3, "dilation_growth_rate": 2, "use_causal_conv": True, "pad_mode": "constant",
        "compress": 2, "trim_right_ratio": 1.0, "use_conv_shortcut": False, "hidden_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
        "intermediate_size": 2048, "hidden_act": "gelu", "norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 250, "max_position_embeddings": 8000, "attention_bias": False,
        "layer_scale_initial_scale": 0.01, "codebook_size": 2048, "codebook_dim": 256,
        "vector_quantization_hidden_dimension": 256, "num_quantizers": 32, "num_semantic_quantizers": 1,
        "upsample_groups": 512,
    }


def real_codec_config() -> dict:
    """The released ``speech_tokenizer/config.json`` (architecture note §2.3), for random-weight benchmarks
    at the real shapes."""
    return {
        **_RELEASED_TOP_LEVEL,
        "encoder_config": real_codec_encoder_config(),
        "decoder_config": {
            "codebook_size": 2048, "codebook_dim": 512, "num_quantizers": 16, "num_semantic_quantizers": 1,
            "latent_dim": 1024, "decoder_dim": 1536, "hidden_size": 512, "intermediate_size": 1024,
            "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64,
            "attention_bias": False, "sliding_window": 72, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
            "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000, "hidden_act": "silu",
            "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        },
    }


def write_tiny_tokenizer(directory: Path) -> None:
    """The tiny byte-level BPE as a checkpoint ships a slow tokenizer: vocab.json + merges.txt +
    tokenizer_config.json (the special tokens), and the processor class the reference wrapper reads."""
    vocab, merges, added = tiny_tokenizer_parts()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(i): {"content": v["content"], "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, v in added.items()
        },
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "bos_token": None, "model_max_length": 32768, "clean_up_tokenization_spaces": False,
        "errors": "replace", "split_special_tokens": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3TTSProcessor"}))


def tiny_speaker_config():
    """A small ECAPA-TDNN (the released one has 512/1536 channels); enc_dim is set to the talker width."""
    from qtts_jax.speaker.config import SpeakerEncoderConfig

    return SpeakerEncoderConfig(enc_channels=(32, 32, 32, 32, 96), enc_attention_channels=16, enc_res2net_scale=4,
                                enc_se_channels=8)


def tiny_tokenizer():
    return byte_level_bpe(*tiny_tokenizer_parts())
