"""What the model reads and writes: checkpoints (`checkpoint`: safetensors through the name tables, and back; `errors`:
the error of one that cannot be loaded), the text tokenizer (`text`), reference recordings for voice cloning
(`reference_audio`) and WAV files (`audio`).

Nothing is re-exported here: the model's config reads `errors` and `reference_audio` needs the request's error, so
importing every module from this file would put `qtts_jax.config` in an import circle."""
