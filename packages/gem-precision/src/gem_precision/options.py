"""The ``[precision.options]`` of the FP8 recipes: the options classes their specs declare
(``ImplementationSpec.options``); gem-core structures and validates the table into them."""

from __future__ import annotations

import attrs

from gem_core.config.validators import at_least, choice, each
from gem_core.contracts import STASH_KINDS  # the kinds a model's stash_points() answers

FLOAT8_RECIPES = ("tensorwise", "rowwise")
STASH_GRANULARITIES = ("tensor", "row")
FLOAT8_MATMULS = ("auto", "scaled_mm", "emulated")


@attrs.frozen(kw_only=True)
class Fp8Options:
    """Options of ``fp8-tensorwise`` (and, through its subclasses, of ``fp8-rowwise`` and
    ``fp8-auto``)."""

    exclude: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Module names (or fnmatch patterns, or prefixes such as ``tower.blocks.0``) kept in high
    precision. Task heads (``heads.*``), embeddings and norms are never converted anyway."""

    min_dim: int = attrs.field(default=32, validator=at_least(0))
    """Smallest in/out size worth converting: below it the casts cost more than FP8 saves."""

    float8_matmul: str = attrs.field(default="auto", validator=choice(*FLOAT8_MATMULS))
    """``scaled_mm`` (real FP8 matmuls), ``emulated`` (the same FP8 casts, matmul in float32) or
    ``auto``: emulated on CPU, where torch._scaled_mm is a slow reference kernel (about 100x
    float32 at tiny's shapes), scaled_mm elsewhere. The choice is logged."""

    fsdp_float8_all_gather: bool = False
    """Under FSDP2, all-gather converted weights in FP8 (tensorwise scaling only)."""

    activation_fp8: bool = False
    """Store activations saved for backward in float8 e4m3 with a scale (the FP8 stash)."""

    activation_scaling: str = attrs.field(default="row", validator=choice(*STASH_GRANULARITIES))
    """Scale of the stash: one per tensor, or one per row (last dimension)."""

    activation_modules: tuple[str, ...] = attrs.field(
        default=("sequence_block", "target_attention", "pma", "cross_attention", "interaction"),
        converter=tuple,
        validator=each(choice(*STASH_KINDS)))
    """Module kinds whose saved activations the stash quantizes."""

    activation_min_numel: int = attrs.field(default=1024, validator=at_least(0))
    """Saved tensors smaller than this stay as they are (scales would cost more than they save)."""

    @property
    def scaling(self) -> str:
        """The torchao float8 scaling of the recipe these options are for."""
        return "tensorwise"

    def __attrs_post_init__(self) -> None:
        if self.fsdp_float8_all_gather and self.scaling != "tensorwise":
            raise ValueError(f"fsdp_float8_all_gather needs tensorwise scaling; these options' "
                             f"recipe uses {self.scaling}")


@attrs.frozen(kw_only=True)
class Fp8RowwiseOptions(Fp8Options):
    """Options of ``fp8-rowwise``: those of ``fp8-tensorwise``; ``fsdp_float8_all_gather``
    needs tensorwise scaling."""

    @property
    def scaling(self) -> str:
        return "rowwise"


@attrs.frozen(kw_only=True)
class Fp8AutoOptions(Fp8Options):
    """Options of ``fp8-auto``: those of the fixed FP8 recipes plus the selection rule."""

    recipe: str = attrs.field(default="rowwise", validator=choice(*FLOAT8_RECIPES))
    """torchao float8 scaling measured and used for the chosen layers."""

    max_output_error: float = attrs.field(default=0.08, validator=at_least(0))
    """Largest relative error of a layer's FP8 output (vs float32) that still converts it."""

    max_grad_error: float = attrs.field(default=0.15, validator=at_least(0))
    """Largest relative error of its input or weight gradient that still converts it."""

    max_loss_change: float = attrs.field(default=0.002, validator=at_least(0))
    """Largest relative change of the calibration loss when only that layer is FP8."""

    report_path: str = ""
    """Where to write the per-layer table as JSON (a ``.txt`` table goes next to it); "": none."""

    @property
    def scaling(self) -> str:
        return self.recipe
