"""The FP8 recipes' ``[precision.options]``: declared on their specs, structured by gem-core and
explained by ``gem config explain`` like every plugin's options."""

import pytest
from click.testing import CliRunner

from gem_core.cli.main import cli
from gem_precision.options import Fp8AutoOptions, Fp8Options, Fp8RowwiseOptions


def _explain(*args: str):
    return CliRunner().invoke(cli, ["--log-level", "WARNING", "config", "explain", *args])


@pytest.mark.parametrize("recipe, cls", [("fp8-tensorwise", Fp8Options),
                                         ("fp8-rowwise", Fp8RowwiseOptions),
                                         ("fp8-auto", Fp8AutoOptions)])
def test_each_fp8_recipe_declares_its_options_class(recipe, cls, recipe_options):
    from gem_core.plugins import build_plugins

    assert build_plugins().registry("precision").get(recipe).options_class() is cls
    assert recipe_options(recipe, min_dim=16) == cls(min_dim=16)


def test_explain_describes_the_configured_recipes_options():
    fp8 = ["--set", "backends.precision=fp8-auto"]
    one = _explain(*fp8, "precision.options.max_output_error")
    assert one.exit_code == 0, one.output
    assert "precision.options.max_output_error = 0.08" in one.output
    assert "Largest relative error of a layer's FP8 output" in one.output
    table = _explain("--set", "backends.precision=fp8-rowwise", "precision.options").output
    assert "The options of precision 'fp8-rowwise' (this configuration's), below." in table
    assert "precision.options.min_dim = 32" in table and "max_output_error" not in table
    unknown = _explain(*fp8, "precision.options.min_dimm")
    assert unknown.exit_code != 0
    assert "unknown configuration key 'precision.options.min_dimm'; the keys of " \
           "precision.options: precision.options.exclude, " in unknown.output
