"""The torchao float8 training calls: imported only when an FP8 recipe is used."""

from __future__ import annotations

import dataclasses
from typing import Any, Collection

import torch
from torch import nn

from gem_core.errors import GemError


def torchao_float8() -> Any:
    """``torchao.float8``, or an error that says why FP8 cannot run."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise GemError("FP8 recipes need torchao (pip install 'gem-precision[fp8]', "
                       f"torchao==0.18.0): {error}") from error
    return float8


def emulate_on(device: torch.device | str, float8_matmul: str) -> bool:
    """Whether FP8 matmuls are emulated (FP8 casts, float32 matmul) for ``float8_matmul``."""
    if float8_matmul == "auto":
        return torch.device(device).type == "cpu"
    return float8_matmul == "emulated"


def float8_config(recipe: str, *, emulate: bool = False,
                  fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's Float8LinearConfig for ``recipe`` (``tensorwise`` or ``rowwise``)."""
    float8 = torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def check_float8_runs(config: Any, device: torch.device) -> None:
    """Run one tiny FP8 linear forward and backward on ``device``, so that a device without FP8
    matmuls fails here with its reason instead of in the middle of a training step."""
    layer = nn.Linear(32, 32, bias=False).to(device)
    probe = float8_linear_class().from_float(layer, config=config)
    x = torch.randn(32, 32, device=device, requires_grad=True)
    try:
        probe(x).sum().backward()
    except (RuntimeError, NotImplementedError) as error:
        raise GemError(f"torchao float8 training does not run on {device}: {error}") from error


def to_float8(layer: nn.Linear, config: Any) -> nn.Module:
    """A Float8Linear sharing ``layer``'s parameters."""
    return float8_linear_class().from_float(layer, config=config)


def convert_layers(model: nn.Module, names: Collection[str], config: Any) -> nn.Module:
    """Swap exactly the linear layers named in ``names`` for torchao Float8Linear."""
    names = set(names)
    if not names:
        return model
    float8 = torchao_float8()
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda module, fqn: fqn in names)
    swapped = {fqn for fqn, m in model.named_modules() if isinstance(m, float8_linear_class())}
    if not names <= swapped:
        raise GemError(f"torchao did not convert {sorted(names - swapped)} to float8")
    return model


def float8_linear_class() -> type[nn.Module]:
    torchao_float8()  # the clear error when torchao is missing
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear
