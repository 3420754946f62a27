"""Per-candidate numeric features (issue #28, item 2): an ad's price or bid in the impression log
(or in a side table) becomes a float per candidate, with its own width in the schema
(``candidate_numeric_dim``, independent of the history's ``seq_dense_dim``), checked at import
(a NaN or infinite value names file, row and column unless the column's missing policy allows
it), written to Parquet (``candidate_numeric``), read back exactly by the loader, written the
same by both engines, and trained on by the model (a Linear into the candidate's token)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_core.config import DataConfig
from gem_core.errors import GemDataError
from gem_core.plugins import build_plugins
from gem_data.importer import build_requests, import_logs, read_schema_file

SCHEMA = ('tasks = ["click"]\nmax_seq_len = 8\ncandidate_numeric_dim = 2\n'
          '[[tables]]\nname = "ad"\nnum_embeddings = 100\n'
          '[[event_features]]\nname = "ad"\ntable = "ad"\n'
          '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
          '[import]\neval_fraction = 0.25\ncandidate_dense_columns = ["price", "bid"]\n')

#: Prices that float32 rounds (0.1, 1/3), large and tiny ones, a negative one, an integer.
PRICES = [0.1, 12.5, 1 / 3, 3.0e30, -2.25, 7, 1e-20, 0.3, 5.5, 1234.5678]
BIDS = [1.0, 2.0, 0.5, 0.25, 9.0, 4.0, 8.0, 16.0, 32.0, 64.0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def logs(tmp_path: Path, prices=PRICES, kind: str = "csv") -> tuple[Path, Path]:
    """Ten impressions of five requests (users 1-3, times 100-500), one price and bid each; a
    context segment and a dense ``ctr`` per request."""
    rows = [(1 + (i // 2) % 3, f"r{i // 2}", 100 * (1 + i // 2), 10 + i, prices[i], BIDS[i], i % 2,
             i // 4, 0.5 + i // 2) for i in range(10)]
    names = ["user_id", "request_id", "timestamp", "ad", "price", "bid", "click", "seg", "ctr"]
    if kind == "parquet":
        pq.write_table(pa.table({n: [r[j] for r in rows] for j, n in enumerate(names)}),
                       tmp_path / "imp.parquet")
        imp = tmp_path / "imp.parquet"
    else:
        imp = write(tmp_path / "imp.csv", ",".join(names) + "\n" +
                    "".join(",".join(map(str, r)) + "\n" for r in rows))
    ev = write(tmp_path / "ev.csv", "user_id,timestamp,ad\n1,50,3\n2,60,4\n1,150,5\n3,90,6\n")
    return imp, ev


def written(directory: Path, manifest) -> dict[str, list[list[float]]]:
    """Per split, the ``candidate_numeric`` lists of the Parquet files, as float64."""
    return {split: [list(np.asarray(row, dtype=np.float32).astype(np.float64))
                    for row in pq.read_table(directory / entry.path)
                    .column("candidate_numeric").to_pylist()]
            for split, (entry,) in manifest.splits.items()}


def test_a_price_column_becomes_a_float_per_candidate_read_back_exactly(tmp_path):
    imp, ev = logs(tmp_path)
    schema_file = write(tmp_path / "s.toml", SCHEMA)
    manifest = import_logs(imp, ev, schema_file, tmp_path / "data")
    assert manifest.schema.candidate_numeric_dim == 2
    files = written(tmp_path / "data", manifest)
    # Requests in time order, candidates in log order; each candidate's price then its bid,
    # the log's value rounded to float32 and nothing else.
    expected = [[float(np.float32(v)) for i in (2 * r, 2 * r + 1) for v in (PRICES[i], BIDS[i])]
                for r in range(5)]
    assert files["train"] + files["eval"] == expected
    # The loader hands the batch exactly what was written.
    source = build_plugins().data_source(
        DataConfig(source="parquet", path=str(tmp_path / "data"), options={"prefetch": 0}),
        seed=0)
    (batch,) = list(source.eval_batches(batch_size=64))
    batch.validate(source.schema)
    assert batch.candidate_numeric.dtype == torch.float32
    assert batch.candidate_numeric.double().reshape(-1).tolist() == \
        [v for row in files["eval"] for v in row]


def test_a_side_table_gives_the_price_and_its_missing_keys_follow_the_policy(tmp_path):
    imp, ev = logs(tmp_path)
    # The ad attribute table (Ali-CCP's ad_feature): no row for ads 18 and 19.
    write(tmp_path / "ads.csv", "adgroup_id,price\n" +
          "".join(f"{10 + i},{PRICES[i]}\n" for i in range(8)))
    joined = SCHEMA.replace('["price", "bid"]', '["ad_price", "bid"]') + (
        '[[import.join]]\nfile = "ads.csv"\nkey = "adgroup_id"\nlog = "impressions"\n'
        'log_key = "ad"\nfeatures = { "candidate_dense.ad_price" = "price" }\n')
    schema_file = write(tmp_path / "s.toml", joined)
    with pytest.raises(GemDataError, match=r"imp\.csv, line 10, column 'ad': key 18 is not in "
                                           r"side table .*ads\.csv \(column 'adgroup_id'\), "
                                           r"which gives feature candidate_dense\.ad_price "
                                           r"\(2 such rows\)"):
        import_logs(imp, ev, schema_file, tmp_path / "data")
    write(tmp_path / "s.toml", joined + '[import.features]\n'
          '"candidate_dense.ad_price" = { missing = "default", default = -1.5 }\n')
    manifest = import_logs(imp, ev, schema_file, tmp_path / "data")
    files = written(tmp_path / "data", manifest)
    prices = [row[j] for row in files["train"] + files["eval"] for j in (0, 2)]
    assert prices == [float(np.float32(p)) for p in PRICES[:8]] + [-1.5, -1.5]
    assert manifest.info["features"]["candidate_dense.ad_price"] == {
        "policy": "default", "missing": 2, "not_in_side_table": 2, "default": -1.5}


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_bad_values_are_refused_naming_file_row_and_column(tmp_path, kind):
    schema_file = write(tmp_path / "s.toml", SCHEMA)
    schema, options = read_schema_file(schema_file)
    where = r"imp\.csv, line 5" if kind == "csv" else r"imp\.parquet, row 3"
    # A CSV reader takes "nan" for an empty cell: a missing value, named as one.
    nan = (r"missing value \(candidate dense feature; 1 missing in the column\); to allow it "
           r"set \[import\.features\.\"candidate_dense\.price\"\] missing" if kind == "csv"
           else r"candidate dense feature = nan is not finite")
    for value, rule in ((float("nan"), nan),
                        (float("inf"), "candidate dense feature = inf is not finite"),
                        (float("-inf"), "candidate dense feature = -inf is not finite")):
        imp, ev = logs(tmp_path, PRICES[:3] + [value] + PRICES[4:], kind)
        with pytest.raises(GemDataError, match=rf"{where}, column 'price': {rule}"):
            build_requests(imp, ev, schema, options)
    # A NaN is a missing value, which the column's policy may allow; an infinity never is.
    allowed = SCHEMA + '[import.features]\n"candidate_dense.price" = { missing = "drop" }\n'
    schema, options = read_schema_file(write(tmp_path / "s.toml", allowed))
    imp, ev = logs(tmp_path, PRICES[:3] + [float("nan")] + PRICES[4:], kind)
    batches = build_requests(imp, ev, schema, options)
    assert sum(b.num_candidates for b in batches.values()) == 9  # its impression dropped
    imp, ev = logs(tmp_path, PRICES[:3] + [float("inf")] + PRICES[4:], kind)
    with pytest.raises(GemDataError, match="inf is not finite"):
        build_requests(imp, ev, schema, options)
    # The width is the schema's, and the columns must say as much.
    with pytest.raises(GemDataError, match=r"candidate_numeric_dim = 2 but "
                                           r"import\.candidate_dense_columns names 1 columns"):
        read_schema_file(write(tmp_path / "bad.toml",
                               SCHEMA.replace('["price", "bid"]', '["price"]')))


def test_both_engines_write_identical_files(tmp_path):
    pytest.importorskip("duckdb")
    imp, ev = logs(tmp_path)
    # With a context and a dense feature, whose columns come after the candidates'.
    schema_file = write(tmp_path / "s.toml", SCHEMA.replace(
        "candidate_numeric_dim = 2\n", "candidate_numeric_dim = 2\nnum_dense = 1\n").replace(
        "[import]\n", '[[tables]]\nname = "seg"\nnum_embeddings = 4\n'
        '[[sparse_features]]\nname = "seg"\ntable = "seg"\n[import]\ndense_columns = ["ctr"]\n'))
    manifests = {engine: import_logs(imp, ev, schema_file, tmp_path / engine, engine=engine,
                                     **({"block_rows": 3, "block_bytes": 64}
                                        if engine == "duckdb" else {}))
                 for engine in ("numpy", "duckdb")}
    for split in ("train", "eval"):
        (a,), (b,) = manifests["numpy"].splits[split], manifests["duckdb"].splits[split]
        assert pq.read_table(tmp_path / "numpy" / a.path).equals(
            pq.read_table(tmp_path / "duckdb" / b.path))
        assert a.sha256 == b.sha256


def test_a_model_trains_on_the_price_and_counts_its_flops(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    from gem_core.testing.models import small_model
    from gem_core.train.loss import task_loss_sums

    imp, ev = logs(tmp_path)
    import_logs(imp, ev, write(tmp_path / "s.toml", SCHEMA), tmp_path / "data")
    source = build_plugins().data_source(
        DataConfig(source="parquet", path=str(tmp_path / "data"), options={"prefetch": 0}),
        seed=0)
    model = small_model(source.schema, pma_queries=1)
    assert model.candidate_numeric.in_features == 2
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    stream = iter(source.train_stream(batch_size=2, rank=0, world_size=1,
                                      balancer=lambda costs, ranks: [list(range(len(costs)))],
                                      cost_fn=lambda b: [1.0] * b.batch_size))
    before = model.candidate_numeric.weight.detach().clone()
    for _ in range(3):
        batch = next(stream)
        loss = task_loss_sums(model(batch), batch, ("click",)).sum() / batch.num_candidates
        optimizer.zero_grad()
        loss.backward()
        assert model.candidate_numeric.weight.grad.abs().sum() > 0
        optimizer.step()
        assert torch.isfinite(loss)
    assert not torch.equal(before, model.candidate_numeric.weight)
    # The price moves the prediction, and its projection's FLOPs are counted.
    batch = next(iter(source.eval_batches(batch_size=8)))
    with torch.no_grad():
        base = model(batch)["click"]
        pricier = model(_with(batch, batch.candidate_numeric * 3))["click"]
    assert not torch.allclose(base, pricier)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    counts = model.flops_by_module(batch.seq_lengths(), batch.candidate_counts(), dense=True)
    measured = counter.get_flop_counts()["GEMModel.candidate_numeric"]
    assert counts["candidate_numeric"] == sum(measured.values()) == \
        2 * batch.num_candidates * 2 * model.config.embedding_dim


def _with(batch, numeric):
    import attrs

    return attrs.evolve(batch, candidate_numeric=numeric)


def test_the_taobao_walkthrough_imports_the_ads_price_from_its_side_table(tmp_path):
    """docs/byod.md's four tables: ``price`` of ad_feature reaches each candidate (before,
    the page said the price could not be imported)."""
    import re

    doc = (Path(__file__).resolve().parents[3] / "docs" / "byod.md").read_text()
    blocks = dict(re.findall(r"<!-- byod-taobao:(\S+) -->\n```\w*\n(.*?)```", doc, flags=re.S))
    for name in ("raw_sample.csv", "ad_feature.csv", "user_profile.csv", "behavior_log.csv",
                 "taobao.toml"):
        write(tmp_path / name, blocks[name])
    schema, options = read_schema_file(tmp_path / "taobao.toml")
    splits = build_requests(tmp_path / "raw_sample.csv", tmp_path / "behavior_log.csv", schema,
                            options)
    # 581738 at 1494137644 was shown ads 1 and 2 (170.0, 199.0); the eval split's ads 6 (not
    # in ad_feature: the default 0.0) and 1.
    assert splits["train"].candidate_numeric[:2].reshape(-1).tolist() == [170.0, 199.0]
    assert splits["eval"].candidate_numeric.reshape(-1).tolist() == [0.0, 170.0]
