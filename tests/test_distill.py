"""``gem distill``: a student trained from a teacher run, with the teacher's signals computed
online or precomputed into the data set (``gem distill-precompute``), and the Student Adapter.

One small Parquet data set and one teacher (2 steps) serve every test."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from gem_core.config import DataConfig, load_config
from gem_core.distill.distiller import _bernoulli_kl_sum
from gem_core.distill.setup import resolve_distillation
from gem_core.errors import GemConfigError
from gem_core.plugins import build_plugins
from gem_core.train.trainer import train
from gem_core.trained_run import load_run
from gem_data.distill_precompute import precompute
from gem_data.synth import synthesize
from gem_data.synth_options import SynthOptions

SMALL = ["data.source=parquet", "data.max_seq_len=24", "train.batch_size=32",
         "train.warmup_steps=1", "train.eval_every=0", "train.checkpoint_every=0",
         "model.embedding_dim=16", "model.num_layers=1", "model.interaction_dims=[32]",
         "model.multitask=independent", "model.pma_queries=2", "train.eval_batch_size=64",
         "train.deterministic=true"]


@pytest.fixture(scope="module")
def plugins():
    return build_plugins()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "data"
    synthesize(out, rows=192, seed=0, eval_rows=64, row_group_rows=64,
               options=SynthOptions(num_items=300, num_users=300, max_candidates=4,
                                    max_length=24))
    return out


def _config(dataset, *extra):
    return load_config(preset="tiny-gem", overrides=[*SMALL, f"data.path={dataset}", *extra])


@pytest.fixture(scope="module")
def teacher(dataset, plugins, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "teacher"
    train(_config(dataset, "train.steps=2"), plugins, out, progress=False)
    return out


@pytest.fixture(scope="module")
def precomputed(teacher, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "with-teacher"
    first = precompute(teacher, dataset, out, shard=0, num_shards=2, batch_size=16)
    assert first["written"] == 2 and not first["complete"]  # 4 row groups, every other one
    assert not (out / "manifest.json").exists()
    second = precompute(teacher, dataset, out, shard=1, num_shards=2, batch_size=16)
    assert second["written"] == 2 and second["complete"]
    again = precompute(teacher, dataset, out, batch_size=16)  # resumable: nothing to redo
    assert again == {"written": 0, "skipped": 4, "other_shards": 0, "complete": True}
    return out


def test_precomputed_columns_are_the_teachers_outputs(teacher, precomputed):
    run = load_run(teacher, data=DataConfig(source="parquet", path=str(precomputed),
                                            max_seq_len=24))
    data = DataConfig(source="parquet", path=str(precomputed), max_seq_len=24)
    source = build_plugins().data_source(data, seed=0)
    assert source.schema.teacher_tasks == ("click", "conversion")
    assert source.schema.teacher_embedding_dim == 2 * 16
    checked = 0
    with torch.no_grad():
        for batch in source.eval_batches(batch_size=64):
            logits, embedding = run.model(batch), run.model.user_embedding(batch)
            for task in run.schema.tasks:
                assert logits[task].abs().min() > 0  # a real model, not zeros
                torch.testing.assert_close(batch.teacher_logits[task], logits[task],
                                           rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batch.teacher_embedding, embedding, rtol=1e-5, atol=1e-5)
            checked += batch.batch_size
    assert checked == 64


DISTILL = ["train.steps=3", "distill.temperature=2.0", "distill.embedding_feature=true",
           "distill.embedding_match_weight=0.5", "distill.task_soft_weights.conversion=0.5",
           "distill.adapter.enabled=true", "distill.adapter.fit_batches=2",
           "distill.adapter.use_embedding=true"]


def test_online_and_precomputed_signals_train_the_same_student(teacher, dataset, precomputed,
                                                               plugins, tmp_path):
    runs = {}
    for signals, data in (("online", dataset), ("precomputed", precomputed)):
        config = _config(data, *DISTILL, f"distill.teacher={teacher}",
                         f"distill.signals={signals}")
        runs[signals] = train(config, plugins, tmp_path / signals, progress=False)
    records = {k: [json.loads(line) for line in (v.run_dir / "metrics.jsonl").open()]
               for k, v in runs.items()}
    assert len(records["online"]) == 3
    for online, pre in zip(records["online"], records["precomputed"]):
        for key in ("loss", "distill_loss", "distill_soft_kl_click", "distill_soft_kl_conversion",
                    "distill_embedding_mse"):
            assert online[key] > 0 and math.isfinite(online[key])
            assert pre[key] == pytest.approx(online[key], rel=1e-5), key
    summary = runs["online"].summary
    assert summary["config"]["model"]["teacher_embedding_dim"] == 32  # set from the teacher
    distill = summary["distill"]
    assert distill["weights"] == {"hard": 1.0, "soft": {"click": 1.0, "conversion": 0.5},
                                  "embedding_match": 0.5, "temperature": 2.0}
    fit = distill["adapter"]["fit"]
    assert fit["rows"] == 64 and set(fit["ne_after"]) == {"click", "conversion"}
    assert set(distill["teacher_eval_ne"]) == {"raw", "adapted"}
    for task in ("click", "conversion"):
        assert runs["precomputed"].summary["eval"][task]["ne"] == pytest.approx(
            summary["eval"][task]["ne"], rel=1e-5)


def test_bernoulli_kl_against_float64():
    generator = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 50, generator=generator) * 3
    p, q = torch.sigmoid(teacher.double()), torch.sigmoid(student.double())
    expected = (p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))).sum()
    assert float(expected) > 1.0
    assert float(_bernoulli_kl_sum(teacher, student)) == pytest.approx(float(expected), rel=1e-5)


def test_bad_teachers_and_data_are_named(teacher, dataset, plugins, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(teacher / "config.toml", bare / "config.toml")
    with pytest.raises(GemConfigError, match="has no complete checkpoint"):
        train(_config(dataset, "train.steps=1", f"distill.teacher={bare}"), plugins,
              tmp_path / "s1", progress=False)
    with pytest.raises(GemConfigError, match="not a run directory"):
        resolve_distillation(_config(dataset, f"distill.teacher={tmp_path / 'nowhere'}"))
    # Features the teacher was not trained on: the generated source with three dense floats.
    other = ["data.source=synthetic-ads", "data.options.num_items=300",
             "data.options.num_users=300", "data.options.max_candidates=4",
             "data.options.num_dense=3", "data.eval_rows=64"]
    with pytest.raises(GemConfigError, match="another feature schema.*num_dense: trained on 4, "
                                             "data has 3"):
        train(_config(dataset, "train.steps=1", f"distill.teacher={teacher}", *other), plugins,
              tmp_path / "s2", progress=False)
    with pytest.raises(GemConfigError, match="precomputed' but the data set .* has no teacher "
                                             "logits"):
        train(_config(dataset, "train.steps=1", f"distill.teacher={teacher}",
                      "distill.signals=precomputed"), plugins, tmp_path / "s3", progress=False)
    with pytest.raises(GemConfigError, match="student has model.pma_queries = 0"):
        resolve_distillation(_config(dataset, "model.pma_queries=0", f"distill.teacher={teacher}",
                                     "distill.embedding_match_weight=1.0"))
    with pytest.raises(GemConfigError, match="task_soft_weights names tasks \\['clik'\\]"):
        train(_config(dataset, "train.steps=1", f"distill.teacher={teacher}",
                      "distill.task_soft_weights.clik=2.0"), plugins, tmp_path / "s4",
              progress=False)


@pytest.mark.distributed
def test_two_ranks_each_run_the_teacher_on_their_share(teacher, dataset, gem, tmp_path):
    args = ["distill", "--teacher", str(teacher), "--preset", "tiny-gem", "--no-progress",
            "--embedding-feature", "--adapter", "--temperature", "2"]
    for pair in [*SMALL, f"data.path={dataset}", "train.steps=2",
                 "distill.adapter.fit_batches=2"]:
        args += ["--set", pair]
    records = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks-{ranks}"
        done = gem(*args, "--nproc-per-node", str(ranks), "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        records[ranks] = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(records[2]) == 2
    for one, two in zip(records[1], records[2]):
        for key in ("loss", "distill_loss", "distill_soft_kl_click", "distill_soft_kl_conversion"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), key


def test_bad_teacher_columns_are_named(precomputed):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gem_core.errors import GemDataError
    from gem_data.manifest import read_manifest
    from gem_data.validation import Location, ValidationPolicy, validate_table

    schema = read_manifest(precomputed).schema
    table = pq.read_table(precomputed / "eval-00000.parquet")
    where = Location(file="eval-00000.parquet", row_group=0, first_row=0)
    column = table.column("teacher_logit.click").combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False).copy()
    values[5] = np.nan
    offsets = column.offsets
    broken = table.set_column(table.schema.get_field_index("teacher_logit.click"),
                              "teacher_logit.click", pa.ListArray.from_arrays(offsets, values))
    row = int(np.searchsorted(offsets.to_numpy(), 5, side="right")) - 1  # owner of value 5
    with pytest.raises(GemDataError, match=f"row {row} .*'teacher_logit.click' value nan is not "
                                           "finite"):
        validate_table(broken.cast(table.schema), schema, ValidationPolicy(), where)
    short = pa.ListArray.from_arrays(pa.array([0] * (len(offsets) - 1) + [0], pa.int32()),
                                     pa.array([], pa.float32()))
    cut = table.set_column(table.schema.get_field_index("teacher_logit.conversion"),
                           "teacher_logit.conversion", short)
    with pytest.raises(GemDataError, match="'teacher_logit.conversion' has 0 values where"):
        validate_table(cut.cast(table.schema), schema, ValidationPolicy(), where)
