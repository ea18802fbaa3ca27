"""The streaming engine: configuration and ladders (`config`), the compiled programs (`programs`), the loop's pure
decisions (`scheduler`), the published snapshot (`stats`) and the loop itself (`core`)."""

from qtts_jax.engine.config import EngineConfig, rung
from qtts_jax.engine.core import Engine, PromptTooLong
from qtts_jax.engine.programs import EngineState, init_state
from qtts_jax.engine.scheduler import Jitter, StepPlan, chunks_due, newcomers_that_fit, step_frames
from qtts_jax.engine.stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineState", "EngineStats", "Jitter", "PromptTooLong", "StepPlan",
           "chunks_due", "init_state", "newcomers_that_fit", "rung", "step_frames"]
