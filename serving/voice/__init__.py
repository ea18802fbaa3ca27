"""Voices a Base model registers (the store on disk) and OpenAI voice names mapped to this model's voices."""
