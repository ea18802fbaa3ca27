"""Stand-in for kaldi fbank: reached only by the 25 Hz tokenizer, unused by 12 Hz models."""


def fbank(*args, **kwargs):
    raise NotImplementedError("torchaudio is stubbed for the parity tests; the 25 Hz tokenizer is not supported")
