"""Text tokenizer: the checkpoint's Qwen2 byte-level BPE through the `tokenizers` library.

A checkpoint ships either `tokenizer.json` or `vocab.json` + `merges.txt` (+ `tokenizer_config.json`
listing the added special tokens). For the latter we assemble the same pipeline transformers builds
when it converts a slow Qwen2 tokenizer: NFC, the Qwen2 split regex, byte-level BPE.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from qtts_jax.io.errors import CheckpointError

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TextTokenizer:
    """encode(str) -> list of ids, with special tokens such as <|im_start|> recognised in the text."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Each token of `encode(text)` as the (start, end) characters of `text` it covers."""
        return self._tok.encode(text, add_special_tokens=False).offsets

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @classmethod
    def from_directory(cls, directory: Path) -> "TextTokenizer":
        directory = Path(directory)
        if (directory / "tokenizer.json").is_file():
            return cls(Tokenizer.from_file(str(directory / "tokenizer.json")))
        vocab_path, merges_path = directory / "vocab.json", directory / "merges.txt"
        for path in (vocab_path, merges_path):
            if not path.is_file():
                raise CheckpointError(f"missing file: {path} (and no tokenizer.json)")
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        lines = merges_path.read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
        config_path = directory / "tokenizer_config.json"
        added = json.loads(config_path.read_text())["added_tokens_decoder"] if config_path.is_file() else {}
        return cls(byte_level_bpe(vocab, merges, {int(k): v for k, v in added.items()}))


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[int, dict]) -> Tokenizer:
    """The Qwen2 fast-tokenizer pipeline; `added` maps id -> {"content", "special"} as in tokenizer_config."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for token_id, info in sorted(added.items()):
        content = info["content"]
        token = AddedToken(content, special=info.get("special", False), normalized=info.get("normalized", False))
        tok.add_special_tokens([token]) if token.special else tok.add_tokens([token])
        if tok.token_to_id(content) != token_id:
            raise CheckpointError(
                f"tokenizer_config.json: added token {content!r} should have id {token_id}, "
                f"got {tok.token_to_id(content)}"
            )
    return tok
