"""Capacity studies: load a speech server over its public API, simulate playback, judge SLOs, size a fleet."""
