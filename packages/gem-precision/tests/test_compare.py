import json

from click.testing import CliRunner

from gem_precision.compare import DEFAULT_RECIPES, compare, drift_table, run_overrides

SHORT = ["train.steps=2", "train.batch_size=16", "train.warmup_steps=1", "data.max_seq_len=16",
         "data.options.num_items=200", "data.eval_rows=64", "train.eval_batch_size=64",
         "train.eval_every=2", "train.checkpoint_every=2"]


def test_precision_options_go_to_fp8_auto_only(tmp_path):
    overrides = ["train.steps=2", "precision.options.max_output_error=0.05"]
    assert run_overrides("bf16", overrides, tmp_path) == ["train.steps=2",
                                                           "backends.precision=bf16"]
    auto = run_overrides("fp8-auto", overrides, tmp_path)
    assert "precision.options.max_output_error=0.05" in auto
    assert any(o.startswith("precision.options.report_path=") for o in auto)
    assert run_overrides("fp8-rowwise+stash", overrides, tmp_path) == [
        "train.steps=2", "backends.precision=fp8-rowwise", "precision.options.activation_fp8=true"]


def test_drift_is_relative_to_fp32():
    rows = drift_table({"fp32": {"click": 0.8}, "bf16": {"click": 0.804}}, "fp32")
    assert rows[0]["drift_from_fp32"] == 0.0
    assert abs(rows[1]["drift_from_fp32"] - 0.005) < 1e-12


def test_compare_trains_every_recipe_and_saves_the_report(tmp_path):
    # The reference and fp8-auto (the one with a per-layer table); bf16 and fp8-rowwise train
    # through the same loop (their numerics are tested in their own modules).
    assert DEFAULT_RECIPES == ("fp32", "bf16", "fp8-rowwise", "fp8-auto")
    args = ["--preset", "tiny", "--out", str(tmp_path), "--recipes", "fp32,fp8-auto"]
    for override in SHORT:
        args += ["--set", override]
    result = CliRunner().invoke(compare, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "compare.json").read_text())
    recipes = {row["recipe"] for row in report["ne"]}
    assert recipes == {"fp32", "fp8-auto"} and report["recipes"] == ["fp32", "fp8-auto"]
    assert {row["task"] for row in report["ne"]} == {"click", "conversion"}
    assert all(row["ne"] > 0 for row in report["ne"])
    assert report["fp8_auto_layers"]["rows"]
    assert "drift vs fp32" in result.output and "rank" in result.output
    assert (tmp_path / "compare.txt").exists()
