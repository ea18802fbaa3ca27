"""Import-time stand-in for torchaudio, which cannot load beside torch 2.13.

The official reference imports ``torchaudio.compliance.kaldi`` only for its 25 Hz
tokenizer, which no 12 Hz checkpoint uses; the parity tests never reach it.
"""
