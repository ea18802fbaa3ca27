"""Stand-in package; see torchaudio/__init__.py."""
