"""An unsharded copy of the model for evaluation, filled from the full state only while
evaluating.

Sharded engines (FSDP2, DeepSpeed ZeRO-3) gather parameters with collectives inside every forward,
but ranks see different numbers of evaluation batches, so ``predict`` must run none. The trainer
switches every rank to eval mode together (``engine.train(False)``): that collective moment is when
the full weights are gathered into this replica; switching back to training frees them again.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch
from torch import nn


class EvalReplica:
    def __init__(self, model: nn.Module) -> None:
        """Copy ``model`` before it is sharded; its storage is released at once (meta device)."""
        replica = copy.deepcopy(model)
        persistent = set(replica.state_dict())
        # Non-persistent buffers (constant index tables) are not in any state dict: keep them to
        # restore after materialising, they are small.
        self._constants = {name: buffer.detach().clone()
                           for name, buffer in replica.named_buffers() if name not in persistent}
        self._device = next(model.parameters()).device
        self.module = replica.to("meta")
        self.ready = False

    def fill(self, full_state: Callable[[], Mapping[str, Any]]) -> None:
        """Materialise the replica with ``full_state()`` (a collective on every rank)."""
        state = full_state()
        self.module.to_empty(device=self._device)
        self.module.load_state_dict(state)
        for name, value in self._constants.items():
            owner, _, leaf = name.rpartition(".")
            self.module.get_submodule(owner).register_buffer(leaf, value.to(self._device),
                                                             persistent=False)
        self.module.eval()
        self.ready = True

    def release(self) -> None:
        if self.ready:
            self.module.to("meta")
            self.ready = False

    def __call__(self, batch: Any) -> Any:
        if not self.ready:
            raise RuntimeError("predict() needs the engine in eval mode: call engine.train(False) "
                               "on every rank first (it gathers the full weights)")
        with torch.no_grad():
            return self.module(batch)
