"""Fine-tuning a Base checkpoint into a single-speaker CustomVoice model (`qtts-jax finetune`).

One concept per module: `data` (the JSONL, checked, and its clips encoded into codes and x-vectors, cached),
`layout` (training sequences in the non-streaming prompt layout, padded into batches), `forward` (the loss from
the talker's Param state and a batch, through the `Talker` module's own teacher-forced forwards), `optimizer` (the
optax chain), `checkpoints` (orbax, every N steps, the last K kept), `train` (the loop and its loss curve),
`export` (a Hugging Face-layout CustomVoice directory).
"""
