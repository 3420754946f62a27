import json

import pytest

from gem_core.errors import GemConfigError
from gem_precision.auto import Float8AutoRecipe, build_table
from gem_precision.float8 import float8_linear_class
from gem_precision.options import Fp8AutoOptions


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, source, batches, loss_fn, recipe_options):
    import torch

    from gem_core.attention.bucketed import BucketedAttention
    from gem_core.config import load_config
    from gem_core.embedding import ReferenceEmbeddingBackend
    from gem_core.model import build_model

    torch.manual_seed(0)
    model = build_model(load_config(overrides=["data.max_seq_len=32",
                                               "data.options.num_items=200"]).model,
                        source.schema, attention=BucketedAttention(),
                        embedding_backend=ReferenceEmbeddingBackend())
    path = tmp_path_factory.mktemp("auto") / "layers.json"
    recipe = Float8AutoRecipe()
    options = recipe_options("fp8-auto", report_path=str(path))
    table = recipe.calibrate(model, batches[:1], loss_fn, options)  # one batch: 2 CPU cores
    return recipe, model, table, path, options


def test_table_measures_every_candidate_and_ranks_by_flops(calibrated):
    recipe, model, table, path, options = calibrated
    measured = [r for r in table.rows if r.benefit_rank]
    assert len(measured) == 16
    flops = [r.train_flops for r in measured]
    assert flops == sorted(flops, reverse=True) and [r.benefit_rank for r in measured] == list(
        range(1, 17))
    for r in measured:
        assert 0 < r.output_error < 0.2 and 0 < r.grad_input_error < 0.3
    heads = [r for r in table.rows if r.name.startswith("heads.")]
    assert heads and all(not r.fp8 and r.reason == "task head" for r in heads)
    saved = json.loads(path.read_text())
    assert saved["chosen"] == table.chosen
    assert "rank" in path.with_suffix(".txt").read_text()


def test_convert_swaps_exactly_the_chosen_layers(calibrated):
    recipe, model, table, path, options = calibrated
    assert recipe.calibration_batches >= 1
    converted = recipe.convert(model, None, options)
    float8_linear = float8_linear_class()
    swapped = {n for n, m in converted.named_modules() if type(m) is float8_linear}
    assert swapped == set(table.chosen) == set(recipe.converted)


def test_choice_changes_with_the_threshold(calibrated, batches, loss_fn, recipe_options):
    recipe, model, table, path, options = calibrated

    def chosen(**thresholds):
        opts = Fp8AutoOptions(**thresholds)
        return build_table(model, opts, recipe.measures, recipe.skipped).chosen

    errors = sorted(r.output_error for r in table.rows if r.output_error is not None)
    middle = (errors[len(errors) // 2 - 1] + errors[len(errors) // 2]) / 2
    loose = chosen(max_output_error=1.0, max_grad_error=1.0, max_loss_change=1.0)
    medium = chosen(max_output_error=middle, max_grad_error=1.0, max_loss_change=1.0)
    assert len(loose) == len(errors)
    assert 0 < len(medium) < len(loose)
    assert chosen(max_output_error=0.0) == []
    assert chosen(max_loss_change=0.0, max_output_error=1.0, max_grad_error=1.0) == [
        r.name for r in table.rows if r.loss_change == 0.0]
    # the same through the options a user passes, end to end
    strict = Float8AutoRecipe().calibrate(model, batches[:1], loss_fn,
                                          recipe_options("fp8-auto", max_output_error=0.0))
    assert strict.chosen == []
    assert all("output error" in r.reason for r in strict.rows if r.benefit_rank)


def test_convert_without_calibration_is_an_error(make_model):
    with pytest.raises(GemConfigError, match="calibrat"):
        Float8AutoRecipe().convert(make_model(), None, Fp8AutoOptions())
