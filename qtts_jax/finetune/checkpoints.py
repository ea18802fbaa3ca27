"""Training checkpoints with orbax: the parameters, the optimiser state and the loss curve so far, every N steps,
the last K kept.

Saves are synchronous, and orbax writes each one under a temporary name that it renames once complete, so a run
killed at any moment leaves only whole checkpoints behind (and the next run clears the partial one).
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: Path, every: int, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)
        self.every = every

    def save(self, step: int, state, meta: dict, last: bool = False) -> bool:
        """Saves when ``step`` is a multiple of N, or the ``last``; True if it did. (Orbax's own interval
        policy would also save a run's first step.)"""
        if step % self.every and not last:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self.manager.save(step, args=args, force=True)

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, step: int, like) -> tuple[object, dict]:
        """(state shaped as ``like``, meta) of a saved step."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(like), meta=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored.state, restored.meta

    def restore_meta(self, step: int) -> dict:
        """The meta of a saved step alone (checked before the state is read)."""
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def close(self) -> None:
        self.manager.close()
