"""The error of a checkpoint that cannot be loaded, apart from the loader: every config reader raises it, and
reading a config.json needs none of the loader's imports (JAX, Flax, safetensors)."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or tensor."""
