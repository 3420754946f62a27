"""gem-precision's plugin module, named by its ``gem`` entry point. Registration only."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.registry import ImplementationSpec


def _bf16():
    from gem_precision.bf16 import BFloat16Recipe

    return BFloat16Recipe()


@hookimpl
def gem_register_precision_recipes(register) -> None:
    register(ImplementationSpec(
        name="bf16", load=_bf16, dtypes=("bfloat16",),
        description="bfloat16 autocast (FSDP2: bf16 params, fp32 reductions); fp32 master weights",
    ))
