"""qtts-jax: Qwen3-TTS (12 Hz) in JAX."""

from qtts_jax.model import Model, Result, load_model
from qtts_jax.request import Request, RequestError, VoicePrompt

__all__ = ["Model", "Request", "RequestError", "Result", "VoicePrompt", "load_model"]
