"""Pallas kernels, each beside a batched pure-jnp reference with the same signature (tested on CPU
with ``interpret=True``); the engine picks one by flag after benchmarking both on the platform."""
