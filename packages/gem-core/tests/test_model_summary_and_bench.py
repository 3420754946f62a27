"""``gem bench flops`` (called directly; the plugin registers it) and the meta-device summary."""

import json

import pytest
from click.testing import CliRunner

from gem_core.cli.bench_flops import bench_flops
from gem_core.config import DataConfig, load_config
from gem_core.model.summary import model_summary
from gem_core.plugins import build_plugins


def test_bench_flops_json_puts_analytic_and_counted_side_by_side():
    result = CliRunner().invoke(bench_flops, [
        "--json", "--batch-size", "6", "--set", "data.max_seq_len=24",
        "--set", "model.pma_queries=2", "--set", "model.interaction=wukong",
        "--set", "model.attribute_attention_loss=0.5"])  # its head runs in the counted forward
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["forward"]["analytic_over_counted"] == pytest.approx(1.0, abs=0.01)
    assert report["forward_backward"]["analytic_over_counted"] == pytest.approx(1.0, abs=0.01)
    by_module = report["forward_by_module"]
    assert set(by_module["analytic"]) == set(by_module["counted"]) >= {"tower", "pma", "heads",
                                                                       "path_loss"}
    for name, value in by_module["analytic"].items():
        assert value == pytest.approx(by_module["counted"][name], rel=0.01), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-gem", "dlrm-baseline", "small", "large"])
def test_every_preset_is_described_without_allocating(preset):
    config = load_config(preset=preset)
    # The synthetic schema needs only the id spaces; keep the generator's arrays small.
    options = {k: v for k, v in config.data.options.items() if k != "num_users"}
    options["num_items"] = min(options.get("num_items", 2000), 1000)
    data = DataConfig(max_seq_len=config.data.max_seq_len, options=options)
    schema = build_plugins().data_source(data, seed=0).schema
    summary = model_summary(config.model, schema)
    params = summary["parameters"]
    assert params["total"] == params["embedding"] + params["dense"] > 0
    per_length = summary["train_flops_per_sample_by_history_length"]
    values = [per_length[k] for k in sorted(per_length, key=int)]
    assert values == sorted(values) and values[-1] > 0


def test_bench_step_times_subject_and_peer_side_by_side():
    from gem_core.cli.bench_step import bench_step

    shape = ["--set", "data.max_seq_len=24", "--batch-size", "6"]
    result = CliRunner().invoke(bench_step, [
        "--json", *shape, "--repeats", "2", "--rounds", "2",
        "--against", "model.attribute_attention=false",
        "--against", "model.attribute_attention_loss=0"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    rounds = report["rounds_detail"]
    assert len(rounds) == 2
    for r in rounds:
        assert r["ratio"] == pytest.approx(r["subject_step_s"] / r["peer_step_s"])
    assert report["time_ratio_median"] == pytest.approx(
        sorted(r["ratio"] for r in rounds)[0] / 2 + sorted(r["ratio"] for r in rounds)[1] / 2)
    # tiny's attribute attention costs FLOPs: the subject counts more than its peer without it
    assert report["subject_train_flops"] > report["peer_train_flops"] > 0
    assert report["flop_ratio"] == pytest.approx(
        report["subject_train_flops"] / report["peer_train_flops"])
    assert report["against"] == ["model.attribute_attention=false",
                                 "model.attribute_attention_loss=0"]


@pytest.mark.parametrize("against", ["data.max_seq_len=12", "train.batch_size=3", "nokey"])
def test_bench_step_refuses_a_peer_on_other_data(against):
    from gem_core.cli.bench_step import bench_step

    result = CliRunner().invoke(bench_step, ["--against", against])
    assert result.exit_code != 0
    assert "--against" in result.output
