"""``tools/taobao_shaped.py``: a small Taobao-shaped world goes through the real ``gem data
import``, and ``measure`` joins every eval impression to its known click probability (and
stops, naming the impression, when truth.csv lacks its row or holds it twice)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_data.importer import import_command
from gem_data.manifest import read_manifest


@pytest.fixture(scope="module")
def tool(tools):
    return tools("taobao_shaped")


@pytest.fixture(scope="module")
def world(tool, tmp_path_factory) -> tuple[Path, Path]:
    """A small world and its import (the command ``gem data import`` runs)."""
    raw, data = tmp_path_factory.mktemp("taobao") / "raw", tmp_path_factory.mktemp("d") / "data"
    tool.main(["generate", "--out", str(raw), "--users", "100", "--days", "2", "--seed", "3"])
    result = CliRunner().invoke(import_command, [
        "--impressions", str(raw / "raw_sample.csv"), "--events", str(raw / "behavior_log.csv"),
        "--schema", str(raw / "taobao.toml"), "--out", str(data)])
    assert result.exit_code == 0, result.output
    return raw, data


def test_every_eval_impression_joins_and_the_figures_read_right(tool, world, tmp_path, capsys):
    raw, data = world
    figures = tmp_path / "figures.json"
    tool.main(["measure", "--raw", str(raw), "--data", str(data), "--json", str(figures)])
    printed = capsys.readouterr().out
    result = json.loads(figures.read_text())
    imported = sum(entry.candidates for entry in read_manifest(data).splits["eval"])
    assert result["eval_impressions"] == imported > 0
    assert f"eval_impressions: {imported}" in printed
    assert all(math.isfinite(value) for value in result.values())
    assert result["achievable_ne"] < result["base_rate_ne"]
    assert 0 < result["eval_engaged"] <= result["eval_impressions"]
    assert 0 <= result["eval_engaged_beyond_256"] <= result["eval_engaged"]


@pytest.mark.parametrize("change, what", [("remove", "no row"), ("repeat", "more than one row")])
def test_measure_stops_naming_an_impression_without_exactly_one_truth_row(
        tool, world, tmp_path, change, what):
    raw, data = world
    first = tool.imported_impressions(data, "eval").slice(0, 1).to_pylist()[0]
    key = ",".join(str(first[name]) for name in tool.KEY) + ","
    lines = (raw / "truth.csv").read_text().splitlines(keepends=True)
    (row,) = [line for line in lines if line.startswith(key)]
    changed = tmp_path / "raw"
    shutil.copytree(raw, changed)
    (changed / "truth.csv").write_text("".join(
        lines + [row] if change == "repeat" else [line for line in lines if line != row]))
    with pytest.raises(tool.TruthJoinError, match=rf"eval split\): 1 of \d+ impressions have "
                                                  rf"{what} in truth.csv, e.g. .*"
                                                  rf"'adgroup_id': {first['adgroup_id']}"):
        tool.measure(changed, data)


def test_ad_described_says_which_ads_the_imported_tables_give_a_category(tool, world):
    """truth.csv's ``ad_described`` is 0 exactly where the imported candidate has no category
    (the ad has no row in ad_feature.csv: the importer's default, 0), so the ``*_described``
    regressions see what a model sees."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    from gem_data.dataset import DatasetReader, split_units

    raw, data = world
    reader = DatasetReader(data)
    cates = np.concatenate([pc.list_flatten(reader.read(unit).column("candidate.cate"))
                            .to_numpy() for unit in split_units(reader.manifest, "eval")])
    truth = pacsv.read_csv(raw / "truth.csv", convert_options=pacsv.ConvertOptions(
        column_types={"user": pa.int64(), "time_stamp": pa.int64(),
                      "adgroup_id": pa.int64(), "pid": pa.string()}))
    joined = tool.join_truth(tool.imported_impressions(data, "eval"), truth, "eval")
    described = joined.column("ad_described").to_numpy()
    assert 0 < described.sum() < described.size  # both kinds occur in this small world
    assert np.array_equal(described == 0, cates == 0)


def test_measure_refuses_a_truth_file_of_an_older_version(tool, world, tmp_path):
    raw, data = world
    old = tmp_path / "raw"
    shutil.copytree(raw, old)
    table = (old / "truth.csv").read_text().splitlines()
    columns = table[0].split(",")
    drop = columns.index("ad_described")
    (old / "truth.csv").write_text("\n".join(
        ",".join(v for i, v in enumerate(line.split(",")) if i != drop) for line in table) + "\n")
    with pytest.raises(tool.TruthJoinError, match="no ad_described column.*generate again"):
        tool.measure(old, data)


def test_one_pass_offsets_move_by_the_prior_variance_times_each_impressions_residual(tool):
    """``one_pass_offsets``: each training row once, in order, every id column's offset moves
    by ``EFFECT_SD^2 (y - p)`` with ``p`` from the offsets as they stand; an id never seen keeps
    0. Checked by hand on an intercept-only design (its regression weight is the log-odds of the
    click rate) with an ad and a user column."""
    import numpy as np

    x = np.ones((4, 1))
    ads, y = np.array([7.0, 7.0, 9.0, 7.0]), np.array([1.0, 0.0, 0.0, 1.0])
    users = np.array([1.0, 2.0, 2.0, 1.0])
    got = tool.one_pass_offsets(x, [ads, users], y, np.ones((2, 1)),
                                [np.array([7.0, 5.0]), np.array([1.0, 3.0])])
    rate = tool.EFFECT_SD ** 2  # the intercept is 0: half the rows are clicks
    ad, user = {}, {}
    for a, u, label in zip(ads, users, y):
        p = 1 / (1 + math.exp(-(ad.get(a, 0.0) + user.get(u, 0.0))))
        ad[a] = ad.get(a, 0.0) + rate * (label - p)
        user[u] = user.get(u, 0.0) + rate * (label - p)
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    np.testing.assert_allclose(got, [sigmoid(ad[7.0] + user[1.0]), sigmoid(0.0)], rtol=1e-6)
    assert abs(ad[7.0] + user[1.0]) > 0.05 and ad[7.0] != user[1.0]
    # fisher: each id's step is its residual over (1 / EFFECT_SD^2 + its summed squares so far)
    got = tool.one_pass_offsets(x, [ads, users], y, np.ones((1, 1)),
                                [np.array([7.0]), np.array([1.0])], fisher=True)
    ad, user, seen = {}, {}, {}
    for a, u, label in zip(ads, users, y):
        residual = label - 1 / (1 + math.exp(-(ad.get(a, 0.0) + user.get(u, 0.0))))
        for table, key in ((ad, ("ad", a)), (user, ("user", u))):
            seen[key] = seen.get(key, 0.0) + residual ** 2
            table[key[1]] = table.get(key[1], 0.0) + residual / (1 / rate + seen[key])
    np.testing.assert_allclose(got, [sigmoid(ad[7.0] + user[1.0])], rtol=1e-6)


def test_the_user_id_schema_imports_each_requests_user_as_a_sparse_feature(tool, tmp_path):
    """``generate --user-id``: the same tables, and a schema whose ``sparse.user_id`` holds each
    request's user (the column the importer groups requests by)."""
    import pyarrow.parquet as pq

    raw, data = tmp_path / "raw", tmp_path / "data"
    tool.main(["generate", "--out", str(raw), "--users", "60", "--days", "2", "--seed", "4",
               "--user-id"])
    result = CliRunner().invoke(import_command, [
        "--impressions", str(raw / "raw_sample.csv"), "--events", str(raw / "behavior_log.csv"),
        "--schema", str(raw / "taobao.toml"), "--out", str(data)])
    assert result.exit_code == 0, result.output
    schema = read_manifest(data).schema
    assert [f.name for f in schema.sparse_features] == ["user_id", "gender", "age", "pvalue"]
    assert schema.table("user").id_policy == "hash"
    table = pq.read_table(next(data.glob("train-*.parquet")), columns=["user_id",
                                                                        "sparse.user_id"])
    rows = table.to_pylist()
    assert rows and all(row["sparse.user_id"] == [row["user_id"]] for row in rows)
    assert len({row["user_id"] for row in rows}) > 1


def _predictions(path: Path, probabilities) -> Path:
    """``probabilities`` as ``gem score`` writes predictions (one row per request, a list per
    task; here one impression per row, which ``explain`` reads the same way)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"row": pa.array(range(len(probabilities)), pa.int64()),
                             "clk": [[float(p)] for p in probabilities]}), path)
    return path


def test_explain_reads_the_truth_as_carrying_every_part_whole(tools, tool, world, tmp_path):
    """``tools/taobao_explain.py``: the true probabilities, scored as a model's, carry the
    user's and the ad's effects with slope 1 (the parts the log adds to every impression's
    logit); a model that has only the intercept carries none; the one-pass reference row comes
    first and the truth's NE last."""
    import numpy as np

    explainer = tools("taobao_explain")
    raw, data = world
    joined = tool.join_truth(tool.imported_impressions(data, "eval"), tool.read_truth(raw),
                             "eval")
    truth = joined.column("p_click").to_numpy()
    flat = np.full(truth.size, joined.column("clk").to_numpy().mean())
    exact, constant = (_predictions(tmp_path / f"{name}.parquet", p)
                       for name, p in (("exact", truth), ("flat", flat + 1e-9 * truth)))
    result = explainer.explain(raw, data, [exact, constant])
    assert list(result) == [explainer.REFERENCE, str(exact), str(constant), "truth"]
    assert result[str(exact)]["ne"] == pytest.approx(result["truth"]["ne"], abs=1e-6)
    for part in ("user_effect", "ad_effect"):
        assert result[str(exact)][f"slope_{part}"] == pytest.approx(1.0, abs=0.05)
        assert abs(result[str(constant)][f"slope_{part}"]) < 1e-6
    assert 0 < result[explainer.REFERENCE]["slope_user_effect"] < 1


def test_explain_stops_on_predictions_of_another_data_set_and_an_older_truth(
        tools, world, tmp_path):
    explainer = tools("taobao_explain")
    raw, data = world
    short = _predictions(tmp_path / "short.parquet", [0.05, 0.06, 0.07])
    with pytest.raises(explainer.TruthJoinError, match=r"short.parquet: 3 scored impressions "
                                                       r"where the eval split .* has \d+"):
        explainer.explain(raw, data, [short])
    old = tmp_path / "raw"
    shutil.copytree(raw, old)
    lines = (old / "truth.csv").read_text().splitlines()
    keep = len(lines[0].split(",")) - 2  # user_effect and ad_effect are the last two columns
    (old / "truth.csv").write_text("\n".join(",".join(line.split(",")[:keep])
                                             for line in lines) + "\n")
    with pytest.raises(explainer.TruthJoinError, match="no user_effect column.*generate again"):
        explainer.explain(old, data, [])
