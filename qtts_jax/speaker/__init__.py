"""Base models' speaker encoder: 24 kHz audio -> log-mel -> ECAPA-TDNN x-vector (the voice-clone speaker prompt)."""
