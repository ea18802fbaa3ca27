"""The runtime: the streaming engine's configuration and ladders (`config`), the compiled programs (`programs`), the
loop's pure decisions (`scheduler`), the published snapshot (`stats`) and the loop itself (`core`); one prepared
request (`job`), its stream handle and chunk schedule (`stream`), text that arrives in pieces (`live_text`), the
slots that fit in device memory (`sizing`) and the persistent compilation cache (`compile_cache`)."""

from qtts_jax.engine.config import EngineConfig, rung
from qtts_jax.engine.core import Engine, PromptTooLong
from qtts_jax.engine.programs import EngineState, init_state
from qtts_jax.engine.scheduler import Jitter, StepPlan, chunks_due, newcomers_that_fit, step_frames
from qtts_jax.engine.stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineState", "EngineStats", "Jitter", "PromptTooLong", "StepPlan",
           "chunks_due", "init_state", "newcomers_that_fit", "rung", "step_frames"]
