"""What the model reads and writes: checkpoints (`checkpoint`: safetensors through the name tables, and back), the
text tokenizer (`text`), reference recordings for voice cloning (`reference_audio`) and WAV files (`audio`).

Nothing is re-exported here: the model's config reads `checkpoint`'s error and `reference_audio` needs the
request's, so importing every module from this file would put `qtts_jax.config` in an import circle."""
