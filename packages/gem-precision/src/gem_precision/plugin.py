"""gem-precision's plugin module, named by its ``gem`` entry point. Registration only: torchao and
the recipes are imported by ``load`` when a run picks them. ``bf16`` declares no options (gem-core
refuses any ``[precision.options]`` key for it); the FP8 recipes declare their classes of
:mod:`gem_precision.options`."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.registry import ImplementationSpec, lazy


def _bf16():
    from gem_precision.bf16 import BFloat16Recipe

    return BFloat16Recipe()


def _fp8(recipe: str):
    def load():
        from gem_precision.fp8 import Float8Recipe

        return Float8Recipe(recipe)
    return load


def _fp8_auto():
    from gem_precision.auto import Float8AutoRecipe

    return Float8AutoRecipe()


def _compare():
    from gem_precision.compare import compare

    return compare


@hookimpl
def gem_register_precision_recipes(register) -> None:
    register(ImplementationSpec(
        name="bf16", load=_bf16, activation_dtype="bfloat16",
        description="bfloat16 autocast (FSDP2: bf16 params, fp32 reductions); fp32 master weights",
    ))
    options = {"tensorwise": "Fp8Options", "rowwise": "Fp8RowwiseOptions"}
    for recipe in ("tensorwise", "rowwise"):
        register(ImplementationSpec(
            name=f"fp8-{recipe}", load=_fp8(recipe), activation_dtype="float32",
            requires=("torchao",), options=lazy("gem_precision.options", options[recipe]),
            description=f"selective FP8 linears (torchao, {recipe} scaling); heads, embeddings, "
                        "norms and excluded modules stay fp32",
        ))
    register(ImplementationSpec(
        name="fp8-auto", load=_fp8_auto, activation_dtype="float32", requires=("torchao",),
        options=lazy("gem_precision.options", "Fp8AutoOptions"),
        description="FP8 (torchao) only for the linears whose measured error on calibration "
                    "batches is under thresholds; prints the per-layer table",
    ))


@hookimpl
def gem_register_cli_commands(register) -> None:
    register(ImplementationSpec(
        name="precision.compare", load=_compare,
        description="train one model under fp32, bf16, fp8-rowwise and fp8-auto; NE drift table",
    ))
