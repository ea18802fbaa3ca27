"""The talker, the network that turns a prompt into codes: the Qwen3 decoder stack (`transformer`) that it and its
code predictor share, the `Talker` module (`talker`: text embedding, prefill, decode step) holding the 15-step
`CodePredictor` (`code_predictor`), token selection with per-row parameters (`sampling`), and the Hugging Face
name table that fills its state from a checkpoint (`weights`). Its public names are re-exported here; modules of
this package import each other by module path, never through this file."""

from qtts_jax.talker.code_predictor import CodePredictor
from qtts_jax.talker.sampling import SamplingParams
from qtts_jax.talker.talker import Talker
from qtts_jax.talker.transformer import DecoderStack, KVCache
from qtts_jax.talker.weights import load_talker, name_table, random_talker

__all__ = ["CodePredictor", "DecoderStack", "KVCache", "SamplingParams", "Talker", "load_talker", "name_table",
           "random_talker"]
