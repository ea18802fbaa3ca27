"""The runtime: the streaming engine's configuration and ladders (`config`), the compiled programs (`programs`), the
device state and program table the loop calls (`runner`), the cost model (`costs`) and what the loop measures for
it (`measurements`), the loop's pure decisions (`scheduler`) and an iteration's typed plan (`plan`), admission into
free slots (`admission`), the plan's device half and what it gives back (`iteration`), the codec call (`decoding`),
the audio hand-out on the sender thread (`handout`), the streams' records of what came back (`bookkeeping`), live
text moved to the device (`trailing`), the warm-up (`warmup`), the published snapshot (`stats`) and the loop itself
(`core`); request preparation (`preparation`), one prepared request (`job`), its stream handle and chunk schedule
(`stream`), the slots that fit in device memory (`sizing`) and the persistent compilation cache (`compile_cache`);
and the boundary a server reaches the engine's core through, in a
process of its own or on a thread: the messages both ways (`messages`), their transports (`links`), the model's host
half (`host_model`), the core's side (`core_host`), the server's side (`core_client`) and the core's process
(`core_process`)."""

from qtts_jax.engine.config import EngineConfig, rung
from qtts_jax.engine.core import Engine
from qtts_jax.engine.preparation import PromptTooLong
from qtts_jax.engine.programs import EngineState, init_state
from qtts_jax.engine.runner import Calibration, DeviceRunner, FirstOutcome, Runner, StepOutcome
from qtts_jax.engine.scheduler import Jitter, StepPlan, chunks_due, newcomers_that_fit, step_frames
from qtts_jax.engine.stats import EngineStats

__all__ = ["Calibration", "DeviceRunner", "Engine", "EngineConfig", "EngineState", "EngineStats", "FirstOutcome", "Jitter",
           "PromptTooLong", "Runner", "StepOutcome", "StepPlan", "chunks_due", "init_state",
           "newcomers_that_fit", "rung", "step_frames"]
