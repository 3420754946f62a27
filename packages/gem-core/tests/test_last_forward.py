"""The holder of what a training forward leaves for the trainer (gem_core.model.last_forward)."""

import copy

import pytest
import torch

from gem_core.model.last_forward import LastForward


def test_a_deep_copy_starts_empty_where_the_source_holds_graph_tensors():
    weight = torch.tensor([1.5, -2.0], requires_grad=True)
    last = LastForward(loss=None, stats={})
    last.loss = (weight * 3.0).sum()  # a non-leaf tensor: deepcopy of it raises
    last.stats["tokens"] = weight.detach() + 1.0
    with pytest.raises(RuntimeError):
        copy.deepcopy(last.loss)
    copied = copy.deepcopy(last)
    assert copied.loss is None and copied.stats == {}
    assert float(last.loss) == pytest.approx(-1.5)  # the source keeps its values
    copied.stats["tokens"] = torch.ones(1)
    assert torch.equal(last.stats["tokens"], torch.tensor([2.5, -1.0]))  # no shared dict


def test_clear_and_unknown_fields():
    last = LastForward(loss=None)
    last.loss = torch.tensor(2.0)
    last.clear()
    assert last.loss is None
    with pytest.raises(AttributeError, match="no field 'los'.*loss"):
        last.los = torch.tensor(1.0)
