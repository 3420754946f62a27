"""Checkpoints, one concept per module; the package itself imports nothing.

- :mod:`~gem_core.checkpoint.layout`: the on-disk protocol of ``RUN_DIR/checkpoints/`` (names,
  staging, atomic publish, recovery of interrupted saves).
- :mod:`~gem_core.checkpoint.retention`: which checkpoints a run keeps (last N, best NE).
- :mod:`~gem_core.checkpoint.digests`: the files' digests and their verification.
- :mod:`~gem_core.checkpoint.io`: reading checkpoint files without running code from them.
- :mod:`~gem_core.checkpoint.sharded_modules`: how sharded modules (TorchRec tables) are stored.
- :mod:`~gem_core.checkpoint.checkpointer`: the trainer's saves and loads, and reading a whole
  checkpoint in one process.
- :mod:`~gem_core.checkpoint.resume`: whether a checkpoint's run may continue in this one.
"""
