"""Serving: ``gem export-model`` programs agree with the trained model, load with torch alone,
``gem score`` reproduces the trainer's evaluation, and ``gem bench serve`` reports its ratio.

One short run per preset (``tiny`` on a Parquet data set, ``tiny-gem`` made multi-stage,
``tiny-moe``), each exported once, shared by every test of the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch

pytest.importorskip("pyarrow")

SMALL = ("train.steps=2", "train.batch_size=32", "train.eval_every=0",
         "train.checkpoint_every=2", "data.eval_rows=64", "data.max_seq_len=32",
         "data.options.num_items=300")
# tiny-gem retrieves older matching events too (a data-dependent search that must export), with
# matches by event and, as the preset has it, target match's latest-match token (views and
# engaged events apart: the synthetic source declares its actions) over the whole history, here
# longer than the sums' window; tiny has target match's sums token alone.
PRESETS = {"tiny": (), "tiny-gem": ("model.downstream_history=events",
                                    "model.attribute_attention_history=8",
                                    "model.attribute_attention_retrieve=4",
                                    "model.attribute_attention_match_by_event=true",
                                    "model.target_match=8"),
           "tiny-moe": ()}


def _sets(pairs):
    return [x for pair in pairs for x in ("--set", pair)]


@pytest.fixture(scope="module")
def parquet_data(tmp_path_factory):
    from gem_data.cli import data_group

    out = tmp_path_factory.mktemp("serving-data") / "data"
    _cli(data_group, "synth", "--rows", "192", "--eval-rows", "96", "--row-group-rows", "64",
         "--out", out, "--set", "num_items=300")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, gem, parquet_data):
    """preset -> (run dir, export dir, manifest); tiny trains on the Parquet data set."""
    from gem_core.serving.export import export_model

    root = tmp_path_factory.mktemp("serving")
    out = {}
    for preset, extra in PRESETS.items():
        run = root / preset
        data = (("data.source=parquet", f"data.path={parquet_data}", "data.options={}",
                 "data.eval_rows=96")
                if preset == "tiny" else ())
        done = gem("train", "--preset", preset, "--out", str(run), "--no-progress",
                   *_sets(SMALL + extra + data))
        assert done.returncode == 0, done.stderr[-3000:]
        manifest = export_model(run, root / f"{preset}-export")
        out[preset] = (run, root / f"{preset}-export", manifest)
    return out


def _eval_batches(run):
    """Held-out batches of other sizes than the export's: 6 requests, then 1 request with 1
    candidate."""
    from gem_core.trained_run import load_run

    loaded = load_run(run)
    batch = next(iter(loaded.source.eval_batches(batch_size=32)))
    single = batch.select(torch.tensor([20]))
    return loaded, [batch.select(torch.arange(10, 16)), single]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_exported_programs_match_the_eager_model(exported, preset):
    from gem_core.serving.inputs import batch_inputs
    from gem_core.serving.loading import load_program

    run, directory, manifest = exported[preset]
    assert manifest["checkpoint_step"] == 2 and manifest["tasks"] == ["click", "conversion"]
    assert manifest["attention"]["exported"] == "padded"
    assert manifest["attention"]["swapped"] == (manifest["attention"]["run"] != "padded")
    expected = {"tiny": {"full"}, "tiny-moe": {"full"},
                "tiny-gem": {"full", "user_tower", "ranker"}}[preset]
    assert set(manifest["programs"]) == expected
    loaded, batches = _eval_batches(run)
    schema = loaded.schema
    for name in expected:
        entry = manifest["programs"][name]
        assert entry["parity_max_abs_diff"] <= 1e-5
        if preset != "tiny-moe":  # (its experts specialise on two or more events: logged)
            assert set(entry["min_sizes"].values()) == {1}, entry["min_sizes"]
        names = [i["name"] for i in entry["inputs"]]
        event, candidate = schema.event_features[0].name, schema.candidate_features[0].name
        assert ("seq_offsets" in names and f"event.{event}" in names) == (name != "ranker"
                                                                        or preset == "tiny-gem")
        by_name = {i["name"]: i for i in entry["inputs"]}
        if name != "user_tower":
            assert by_name[f"candidate.{candidate}"]["shape"] == ["candidates"]
            assert (f"candidate feature {candidate!r}"
                    in by_name[f"candidate.{candidate}"]["source"])
        assert by_name["dense"]["shape"] == ["requests", schema.num_dense]
        program = load_program(directory, manifest, name)  # verified, nothing unpickled
        for batch in batches:
            with torch.no_grad():
                user = loaded.model.user_embedding(batch) if name != "full" else None
                cached = attrs.evolve(batch, user_embedding=user)
                ranker_schema = attrs.evolve(schema, user_embedding_dim=(
                    manifest["user_embedding_dim"]))
                got = program(batch_inputs(cached, ranker_schema if name == "ranker" else schema,
                                           tuple(entry["groups"])))
                if name == "user_tower":
                    assert got["user_embedding"].shape == user.shape
                    torch.testing.assert_close(got["user_embedding"], user, atol=1e-5, rtol=0)
                    continue
                want = loaded.model(batch)
            for task in manifest["tasks"]:
                assert got[task].shape == (batch.num_candidates,)
                assert float(want[task].std()) > 0 or batch.num_candidates == 1
                torch.testing.assert_close(got[f"{task}.logit"], want[task], atol=1e-5, rtol=0)
                torch.testing.assert_close(got[task], torch.sigmoid(want[task]), atol=1e-5,
                                           rtol=0)


_TORCH_ONLY = textwrap.dedent("""
    import sys

    class NoGem:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("gem_"):
                raise ImportError(f"{name} imported in a torch-only process")
            return None

    sys.meta_path.insert(0, NoGem())
    import torch

    directory, saved, aoti = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    cases = torch.load(saved, weights_only=True)
    for name, (inputs, want) in cases.items():
        calls = [torch.export.load(f"{directory}/{name}.pt2").module()]
        if aoti:
            from torch._inductor import aoti_load_package
            calls.append(aoti_load_package(f"{directory}/{name}.aoti.pt2"))
        for call in calls:
            got = call(inputs)
            for key, value in want.items():
                assert (got[key] - value).abs().max() <= 1e-5, (name, key)
    assert not [m for m in sys.modules if m.startswith("gem_")]
    print("ok", sorted(cases))
""")


def _torch_only(directory: Path, cases: dict, tmp_path: Path, aoti: bool) -> None:
    saved = tmp_path / "cases.pt"
    torch.save(cases, saved)
    script = tmp_path / "torch_only.py"
    script.write_text(_TORCH_ONLY)
    done = subprocess.run([sys.executable, "-I", str(script), str(directory), str(saved),
                           "1" if aoti else "0"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[0] == "ok"


def test_tiny_gem_reads_the_actions_the_data_declares(exported):
    """The preset's ``model.action_feature = "schema"`` is resolved when the run starts and
    recorded as the feature it read; its latest-match token is in the exported model."""
    import tomllib

    from gem_core.trained_run import load_run

    run = exported["tiny-gem"][0]
    recorded = tomllib.loads((run / "config.toml").read_text())["model"]
    assert (recorded["action_feature"], recorded["view_action"]) == ("action", 0)
    match = load_run(run).model.target_match
    assert match.action_feature == "action" and match.latest is not None


def test_exported_files_run_in_a_torch_only_process(exported, tmp_path):
    from gem_core.serving.inputs import batch_inputs

    run, directory, manifest = exported["tiny-gem"]
    loaded, (batch, _) = _eval_batches(run)
    cases = {}
    with torch.no_grad():
        user = loaded.model.user_embedding(batch)
        logits = loaded.model(batch)
    probs = {t: torch.sigmoid(v) for t, v in logits.items()}
    schema = attrs.evolve(loaded.schema, user_embedding_dim=user.shape[1])
    for name, want in (("full", probs), ("ranker", probs),
                       ("user_tower", {"user_embedding": user})):
        groups = tuple(manifest["programs"][name]["groups"])
        inputs = batch_inputs(attrs.evolve(batch, user_embedding=user), schema, groups)
        cases[name] = (inputs, want)
    _torch_only(directory, cases, tmp_path, aoti=False)


@pytest.mark.skipif(os.environ.get("GEM_TEST_AOTI") != "1",
                    reason="AOTInductor compiles C++ for about a minute: set GEM_TEST_AOTI=1")
def test_aoti_package_runs_in_a_torch_only_process(exported, tmp_path):
    from gem_core.serving.export import export_model
    from gem_core.serving.inputs import batch_inputs

    run = exported["tiny"][0]
    manifest = export_model(run, tmp_path / "aoti", aoti=True)
    assert manifest["programs"]["full"]["aoti_file"] == "full.aoti.pt2"
    loaded, (batch, _) = _eval_batches(run)
    with torch.no_grad():
        want = {t: torch.sigmoid(v) for t, v in loaded.model(batch).items()}
    inputs = batch_inputs(batch, loaded.schema, tuple(manifest["programs"]["full"]["groups"]))
    _torch_only(tmp_path / "aoti", {"full": (inputs, want)}, tmp_path, aoti=True)


def test_export_model_refuses_what_it_cannot_export(exported, tmp_path):
    from gem_core.errors import GemError
    from gem_core.serving.export import export_model

    run = exported["tiny"][0]
    with pytest.raises(GemError, match=r"'bucketed' does not support torch_export \(needed by "
                                       r"gem export-model\); backends that do: .*padded"):
        export_model(run, tmp_path / "x", attention="bucketed")
    empty = tmp_path / "run"
    (empty / "checkpoints" / "step-00000004").mkdir(parents=True)
    (empty / "config.toml").write_text((run / "config.toml").read_text())
    with pytest.raises(GemError, match="no complete checkpoint"):
        export_model(empty, tmp_path / "y")
    assert not (tmp_path / "y" / "manifest.json").exists()


def _cli(command, *args) -> str:
    """A CLI command in this process (no interpreter start-up); its stdout."""
    from click.testing import CliRunner

    done = CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)
    assert done.exit_code == 0, done.output[-3000:]
    return done.stdout


def test_score_reproduces_the_trainers_evaluation(exported, tmp_path, parquet_data):
    import pyarrow.parquet as pq

    from gem_data.score import score_command

    run, directory, manifest = exported["tiny"]
    _cli(score_command, directory, "--data", parquet_data, "--out", tmp_path / "scored",
         "--batch-size", "40")
    summary = json.loads((tmp_path / "scored" / "score.json").read_text())
    trainer = json.loads((run / "summary.json").read_text())["eval"]
    part = summary["splits"]["eval"]
    assert summary["program"] == "full" and part["rows"] == 96
    for task in ("click", "conversion"):
        assert part["metrics"][task]["samples"] == trainer[task]["samples"]
        assert part["metrics"][task]["ne"] == pytest.approx(trainer[task]["ne"], abs=1e-6)
        assert part["metrics"][task]["auc"] == pytest.approx(trainer[task]["auc"], abs=1e-9)
    table = pq.read_table(tmp_path / "scored" / "predictions-eval.parquet")
    assert table.column("row").to_pylist() == list(range(96))
    probs = table.column("click").to_pylist()
    assert sum(len(p) for p in probs) == part["metrics"]["click"]["samples"]
    assert all(0 < x < 1 for p in probs for x in p) and len({x for p in probs for x in p}) > 1


def test_score_with_the_ranker_on_cached_user_embeddings(exported, tmp_path, parquet_data):
    from gem_data.export_user_embeddings import export
    from gem_data.score import score_command

    run, directory, manifest = exported["tiny-gem"]
    cached = tmp_path / "cached"
    live = export(run, cached, train_rows=32, staleness_s=0, batch_size=64)
    _cli(score_command, directory, "--data", cached, "--out", tmp_path / "scored")
    summary = json.loads((tmp_path / "scored" / "score.json").read_text())
    assert summary["program"] == "ranker"
    for task, ne in live["eval_ne"]["live_upstream"].items():
        assert summary["splits"]["eval"]["metrics"][task]["ne"] == pytest.approx(ne, abs=1e-6)
    # A data set of another schema; the ranker on data without the cached embedding.
    from gem_core.errors import GemDataError
    from gem_data.score import check_schema, load_exported, score

    with pytest.raises(GemDataError, match="does not have the feature schema the exported "
                                           "model was trained on: .*tables: the model has"):
        score(directory, parquet_data, tmp_path / "b")
    with pytest.raises(GemDataError, match="has no scoring program 'ranker'"):
        score(exported["tiny"][1], parquet_data, tmp_path / "c", program="ranker")

    ranker = load_exported(directory, "ranker")
    with pytest.raises(GemDataError, match="user embeddings of 0 floats; the ranker reads 128"):
        check_schema(ranker, attrs.evolve(ranker.schema, user_embedding_dim=0), cached)


def test_bench_serve_reports_the_ratio_per_k():
    from gem_core.cli.bench_serve import bench_serve

    report = json.loads(_cli(bench_serve, "--json", "--candidates", "1", "--candidates", "8",
                             "--requests", "3"))
    assert set(report["k"]) == {"1", "8"}
    for entry in report["k"].values():
        for name in ("ranker", "full"):
            assert entry[name]["latency_ms_p99"] >= entry[name]["latency_ms_p50"] > 0
        assert entry["candidates_per_s_ratio"] == pytest.approx(
            entry["ranker"]["candidates_per_s"] / entry["full"]["candidates_per_s"])
