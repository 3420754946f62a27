"""Hook implementations: registration only, the backend module is imported when selected."""

from __future__ import annotations

from gem_core import hookimpl
from gem_core.capabilities import SOFTMAX
from gem_core.registry import ImplementationSpec


def _load_attention():
    from gem_example_plugin.attention import SdpaAttention

    return SdpaAttention()


def _load_command():
    from gem_example_plugin.command import example

    return example


@hookimpl
def gem_register_attention_backends(register) -> None:
    register(ImplementationSpec(
        name="example-sdpa", load=_load_attention, dtypes=("float32", "float64"),
        # What it computes, checked at start-up against the model (softmax, no relative bias).
        capabilities=(SOFTMAX,),
        description="example plugin: per-sample scaled_dot_product_attention, softmax only",
    ))


@hookimpl
def gem_register_cli_commands(register) -> None:
    register(ImplementationSpec(name="example", load=_load_command,
                                description="Show what the example plugin provides."))
