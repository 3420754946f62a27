"""The registered data sources and commands, through the same entry points gem-core uses."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gem_core.config import DataConfig
from gem_core.data.api import contiguous_balancer
from gem_core.errors import GemConfigError, GemDataError
from gem_core.plugins import build_plugins
from gem_data import plugin


def registered(hook):
    specs = []
    hook(specs.append)
    return {spec.name: spec for spec in specs}


def cost(batch):
    return (batch.seq_lengths() + 1).tolist()


def reverse_balancer(costs, num_ranks):
    """A balancer that is not contiguous, to show the split comes from it."""
    shares = contiguous_balancer(costs, num_ranks)
    n = len(costs)
    return [[n - 1 - i for i in share] for share in shares]


def test_registration_is_complete():
    import click

    sources = registered(plugin.gem_register_data_sources)
    commands = registered(plugin.gem_register_cli_commands)
    assert set(sources) == {"parquet", "movielens-100k", "synthetic-ads"}
    assert "synthetic" not in sources  # gem-core owns that name
    assert set(commands) == {"data", "bench.loader", "bench.import", "export-user-embeddings",
                             "score", "distill-precompute"}
    for name in ("export-user-embeddings", "score", "distill-precompute", "bench.loader"):
        assert isinstance(commands[name].load(), click.Command)
    assert isinstance(commands["data"].load(), click.Group)
    assert set(commands["data"].load().commands) == {"synth", "fetch", "validate", "inspect",
                                                     "schema", "convert", "import"}
    assert isinstance(commands["bench.loader"].load(), click.Command)
    assert callable(sources["parquet"].load()) and callable(sources["movielens-100k"].load())


def test_registration_imports_nothing_heavy():
    code = ("import sys, gem_data.plugin as p; specs = []; "
            "p.gem_register_data_sources(specs.append); p.gem_register_cli_commands(specs.append); "
            "print(sorted(m for m in ('pyarrow', 'torchrec', 'torch', 'gem_data.sources') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_plugin_manager_registers_gem_data():
    plugins = build_plugins(load_entry_points=False, disabled={"gem_core"},
                            extra_plugins=[("gem_data", plugin)])
    assert {"parquet", "movielens-100k"} <= set(plugins.registries["data"].names())
    assert {"data", "bench.loader"} <= set(plugins.registries["cli"].names())


def make_source(directory, **options):
    config = DataConfig(source="parquet", path=str(directory), max_seq_len=32, eval_rows=300,
                        options=options)
    return build_plugins().data_source(config, seed=5)


def test_parquet_source_contract(small_dataset):
    source = make_source(small_dataset)
    assert source.schema.max_seq_len == 32
    world = 2
    streams = [source.train_stream(batch_size=64, rank=r, world_size=world,
                                   balancer=reverse_balancer, cost_fn=cost) for r in range(world)]
    single = source.train_stream(batch_size=64, rank=0, world_size=1,
                                 balancer=reverse_balancer, cost_fn=cost)
    for _ in range(3):
        whole = next(single)
        parts = [next(s) for s in streams]
        assert sum(p.batch_size for p in parts) == 64
        # The balancer's split: rank 0 got global rows 63..32.
        assert torch.equal(parts[0].request_timestamps,
                           whole.request_timestamps.flip(0)[:32])
        assert torch.equal(parts[0].candidate_ids["item"],
                           whole.select(torch.arange(63, 31, -1)).candidate_ids["item"])
        whole.validate(source.schema)
    state = streams[1].state_dict()
    again = source.train_stream(batch_size=64, rank=1, world_size=world,
                                balancer=reverse_balancer, cost_fn=cost)
    again.load_state_dict(state)
    assert torch.equal(next(again).candidate_ids["item"], next(streams[1]).candidate_ids["item"])
    evals = [list(source.eval_batches(batch_size=128)) for _ in range(2)]
    assert [b.batch_size for b in evals[0]] == [128, 128, 44]
    assert all(torch.equal(a.candidate_ids["item"], b.candidate_ids["item"])
               for a, b in zip(*evals))
    report = source.report()
    assert report["rows_checked"] > 0 and report["total_dropped"] == 0
    json.dumps(report)


def test_row_group_sharding_option(small_dataset):
    source = make_source(small_dataset, sharding="row_groups")
    parts = [next(source.train_stream(batch_size=64, rank=r, world_size=3,
                                      balancer=contiguous_balancer, cost_fn=cost))
             for r in range(3)]
    assert [p.batch_size for p in parts] == [22, 21, 21]


def test_eval_held_out_from_train_when_manifest_has_no_eval(make_dataset):
    import json as _json

    directory = make_dataset(rows=64, row_group_rows=16)
    manifest = _json.loads((directory / "manifest.json").read_text())
    del manifest["splits"]["eval"]
    (directory / "manifest.json").write_text(_json.dumps(manifest))
    source = build_plugins().data_source(DataConfig(source="parquet", path=str(directory),
                                                    eval_rows=20), seed=0)
    assert len(source.train_units) == 2 and len(source.eval_units) == 2


def test_bad_options_and_paths(small_dataset, tmp_path):
    with pytest.raises(GemConfigError, match="unknown key 'data.options.shufle'"):
        make_source(small_dataset, shufle=False)
    with pytest.raises(GemConfigError, match="data.options.validation.ids must be one of"):
        make_source(small_dataset, validation={"ids": "ignore"})
    with pytest.raises(GemDataError, match="needs data.path"):
        build_plugins().data_source(DataConfig(source="parquet"), seed=0)
    with pytest.raises(GemDataError, match="does not exist"):
        make_source(tmp_path / "nope")


def test_cli_synth_validate_inspect(tmp_path):
    group = registered(plugin.gem_register_cli_commands)["data"].load()
    runner = CliRunner()
    out = tmp_path / "ds"
    result = runner.invoke(group, ["synth", "--rows", "500", "--eval-rows", "100", "--seed", "1",
                                   "--out", str(out), "--row-group-rows", "128",
                                   "--set", "num_items=300", "--set", "length_distribution=zipf",
                                   "--set", "max_length=128"])
    assert result.exit_code == 0, result.output
    assert "500 train + 100 eval rows" in result.output
    from gem_data.manifest import read_manifest

    achievable = read_manifest(out).info["achievable_ne"]
    assert set(achievable) == {"click", "conversion"}
    assert all(0.0 < v < 1.0 for v in achievable.values())
    result = runner.invoke(group, ["validate", str(out)])
    assert result.exit_code == 0 and "0 errors" in result.output
    result = runner.invoke(group, ["inspect", str(out), "--json"])
    info = json.loads(result.output)
    assert info["splits"]["train"]["requests"] == 500
    assert info["splits"]["train"]["history_length"]["max"] <= 128
    assert info["schema"]["tables"][0] == {"name": "ad", "num_embeddings": 600,
                                           "id_policy": "hash"}
    bad = runner.invoke(group, ["synth", "--rows", "5", "--out", str(tmp_path / "x"),
                                "--set", "length_distribution=pareto"])
    assert bad.exit_code != 0 and "synth.length_distribution must be one of" in bad.output


def test_cli_validate_reports_each_bad_row_group(make_dataset):
    import attrs

    def mutate(batch):
        ids = batch.candidate_ids["advertiser"].clone()
        first, second = int(batch.candidate_offsets[3]), int(batch.candidate_offsets[40])
        ids[first], ids[second] = -7, 100_000
        return attrs.evolve(batch, candidate_ids={**batch.candidate_ids, "advertiser": ids})

    directory = make_dataset(mutate=mutate)
    group = registered(plugin.gem_register_cli_commands)["data"].load()
    result = CliRunner().invoke(group, ["validate", str(directory), "--json"])
    assert result.exit_code == 1
    errors = json.loads(result.output)["errors"]
    assert len(errors) == 2
    assert "row group 0, row 3 " in errors[0] and "-7" in errors[0]
    assert "row group 1, row 40 " in errors[1] and "100000" in errors[1]



def test_synthetic_ads_source():
    factory = build_plugins().data_source
    config = DataConfig(source="synthetic-ads", max_seq_len=48, eval_rows=700,
                        options={"num_items": 300, "num_users": 50})
    source = factory(config, seed=2)
    assert source.schema.max_seq_len == 48
    assert source.schema.table("ad").num_embeddings == 600
    s = source.train_stream(batch_size=40, rank=1, world_size=2, balancer=contiguous_balancer,
                            cost_fn=cost)
    next(s)
    state = s.state_dict()
    expected = next(s)
    again = factory(config, seed=2).train_stream(batch_size=40, rank=1, world_size=2,
                                                 balancer=contiguous_balancer, cost_fn=cost)
    again.load_state_dict(state)
    assert torch.equal(next(again).event_ids["ad_id"], expected.event_ids["ad_id"])
    a = list(source.eval_batches(batch_size=256))
    b = list(source.eval_batches(batch_size=100))
    assert sum(x.batch_size for x in a) == 700
    assert torch.equal(torch.cat([x.candidate_ids["ad_id"] for x in a]),
                       torch.cat([x.candidate_ids["ad_id"] for x in b]))
    a[0].validate(source.schema)
    # The source's achievable NE is measured on exactly these eval requests.
    from gem_data.generator import normalized_entropy_of_probabilities

    probs = [source.generator.chunk_with_probabilities(size, split="eval", index=i)[1]["click"]
             for i, size in source.generator.eval_chunks(700)]
    labels = torch.cat([x.labels["click"] for x in a]).numpy()
    assert source.achievable_ne()["click"] == pytest.approx(
        normalized_entropy_of_probabilities(np.concatenate(probs), labels))
    with pytest.raises(GemConfigError, match="data.options.length_distribution"):
        factory(DataConfig(source="synthetic-ads", options={"length_distribution": "x"}), seed=0)
