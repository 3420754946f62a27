"""``model.view_action`` given as the action's text (``"pv"``) on a data set imported with
``[import.strings] btag = "vocabulary"``: the data source's ``raw_id`` looks it up in the data
set's vocabulary (first id + index), the trainer puts the id in its place at start-up and the
run records the integer; texts that cannot be looked up are refused naming the feature, table,
file and values. Every command that builds the model from a configuration and a data source
(``gem plan``, the benches, ``gem config show``) looks the text up the same way
(:func:`gem_core.train.applied.config_as_source_applies`)."""

from __future__ import annotations

import json
import logging
import re
import tomllib
from pathlib import Path

import attrs
import numpy as np
import pytest
from click.testing import CliRunner

from gem_core.cli.main import cli
from gem_core.config import DataConfig, load_config
from gem_core.contracts import DataSource
from gem_core.errors import GemConfigError, GemDataError
from gem_core.model.target_match import TargetMatch, check_view_action
from gem_core.plugins import build_plugins
from gem_core.train.applied import config_as_source_applies, resolve_view_action
from gem_data.import_strings import FIRST_ID
from gem_data.importer import import_logs

ACTIONS = ("pv", "cart", "fav", "buy")  # sorted in the vocabulary: buy 2, cart 3, fav 4, pv 5
SCHEMA = ('tasks = ["click"]\nmax_seq_len = 32\n'
          '[[tables]]\nname = "ad"\nnum_embeddings = 50\n'
          '[[tables]]\nname = "btag"\nnum_embeddings = 6\n'
          '[[event_features]]\nname = "ad"\ntable = "ad"\n'
          '[[event_features]]\nname = "btag"\ntable = "btag"\n'
          '[[candidate_features]]\nname = "ad"\ntable = "ad"\n'
          '[import]\neval_fraction = 0.25\n'
          '[import.strings]\nbtag = "vocabulary"\n')


@pytest.fixture(scope="module")
def data_set(tmp_path_factory) -> Path:
    """40 users' clicks and page views, mostly ``pv``, through the real importer."""
    return _imported(tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("data") / "data",
                     SCHEMA)


def _imported(raw: Path, out: Path, schema: str) -> Path:
    """The logs of :func:`data_set` written into ``raw`` and imported into ``out`` with the
    schema file ``schema``."""
    rng = np.random.default_rng(0)
    impressions = ["user_id,request_id,timestamp,ad,click"]
    events = ["user_id,timestamp,ad,btag"]
    for user in range(1, 41):
        for request in range(3):
            time = 1000 + 100 * request
            impressions += [f"{user},u{user}r{request},{time},{ad},{int(rng.random() < 0.3)}"
                            for ad in rng.integers(1, 50, size=2)]
            events += [f"{user},{time - 50 + i},{rng.integers(1, 50)},"
                       f"{rng.choice(ACTIONS, p=[0.7, 0.1, 0.1, 0.1])}" for i in range(8)]
    (raw / "imp.csv").write_text("\n".join(impressions) + "\n")
    (raw / "ev.csv").write_text("\n".join(events) + "\n")
    (raw / "schema.toml").write_text(schema)
    import_logs(raw / "imp.csv", raw / "ev.csv", raw / "schema.toml", out)
    return out


def _source(data_set: Path) -> DataSource:
    return build_plugins().data_source(DataConfig(source="parquet", path=str(data_set)), seed=0)


def test_raw_id_is_the_first_id_plus_the_texts_place_in_the_vocabulary(data_set):
    values = json.loads((data_set / "vocabulary.btag.json").read_text())["values"]
    assert values == sorted(ACTIONS)
    source = _source(data_set)
    assert [source.raw_id("btag", text) for text in values] == [
        FIRST_ID + i for i in range(len(values))]
    assert source.raw_id("btag", "pv") == 5


def test_texts_that_cannot_be_looked_up_are_refused_naming_what_was_asked(data_set):
    source = _source(data_set)
    with pytest.raises(GemConfigError, match=r"'view' is not in the vocabulary of event feature "
                                             r"'btag' \(table 'btag', .*vocabulary\.btag\.json\); "
                                             r"its values: 'buy', 'cart', 'fav', 'pv'"):
        source.raw_id("btag", "view")
    with pytest.raises(GemConfigError, match=r"event feature 'ad' \(table 'ad'\) has no "
                                             r"vocabulary of texts in .*manifest\.json .*"
                                             r'\[import\.strings\] ad = "vocabulary".*raw id'):
        source.raw_id("ad", "pv")
    with pytest.raises(GemConfigError, match=r"'action' is not an event feature of .*; its "
                                             r"event features: ad, btag"):
        source.raw_id("action", "pv")


def test_a_source_without_vocabularies_refuses_texts_and_the_trainer_names_the_key():
    config = load_config(preset="tiny", overrides=["model.action_feature=action",
                                                   "model.view_action=pv"])
    source = build_plugins().data_source(config.data, seed=0)  # generated data
    with pytest.raises(GemConfigError, match=r"event feature 'action': 'pv' is text, and data "
                                             r"source SyntheticSource has no string "
                                             r"vocabularies .*give the raw id"):
        DataSource.raw_id(source, "action", "pv")
    with pytest.raises(GemConfigError, match=r"^model\.view_action = 'pv': event feature "
                                             r"'action'"):
        resolve_view_action(config, source)
    # An id stays as it is, without asking the source.
    given = load_config(preset="tiny", overrides=["model.view_action=3"])
    assert resolve_view_action(given, source) is given


def test_a_text_needs_action_feature():
    with pytest.raises(GemConfigError, match=r"model\.view_action = 'pv' is an action's text, "
                                             r".*needs model\.action_feature"):
        load_config(preset="tiny", overrides=["model.view_action=pv"])
    assert load_config(preset="tiny", overrides=["model.view_action=5"]).model.view_action == 5


def test_the_model_refuses_a_text_it_would_compare_with_ids():
    with pytest.raises(GemConfigError, match=r"model\.view_action = 'pv' reached the model "
                                             r"unresolved"):
        check_view_action("pv")
    with pytest.raises(GemConfigError, match="unresolved"):
        TargetMatch(4, [("ad", "ad")], 3, action_feature="btag", action_window=5,
                    view_action="pv")


def test_gem_train_resolves_the_text_and_records_the_id(data_set, tmp_path, gem):
    run = tmp_path / "run"
    result = gem("train", "--preset", "tiny", "--out", str(run), "--no-progress",
                 *[arg for setting in [
                     "data.source=parquet", f"data.path={data_set}", "data.options={}",
                     "train.steps=2", "train.batch_size=16", "train.eval_every=0",
                     "train.checkpoint_every=0", "train.warmup_steps=1",
                     "train.eval_batch_size=64", "model.action_feature=btag",
                     "model.view_action=pv", "model.target_match_action_window=8"]
                   for arg in ("--set", setting)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("model.view_action 'pv' is id 5 of event feature btag (the vocabulary of data "
            "source 'parquet')") in result.stderr
    recorded = tomllib.loads((run / "config.toml").read_text())["model"]
    assert recorded["view_action"] == 5 and recorded["action_feature"] == "btag"


def test_the_resolution_is_logged(data_set, caplog):
    config = load_config(preset="tiny", overrides=[
        "data.source=parquet", f"data.path={data_set}", "data.options={}",
        "model.action_feature=btag", "model.view_action=fav"])
    with caplog.at_level(logging.INFO):
        resolved = resolve_view_action(config, _source(data_set))
    assert resolved.model.view_action == 4
    assert "model.view_action 'fav' is id 4 of event feature btag" in caplog.text


def _on_data_set(data_set: Path, view_action: str) -> list[str]:
    """``--set`` arguments of tiny on ``data_set`` with the view action given as text."""
    return [arg for setting in [
        "data.source=parquet", f"data.path={data_set}", "data.options={}",
        "model.action_feature=btag", f"model.view_action={view_action}",
        "model.target_match_action_window=8"] for arg in ("--set", setting)]


def test_the_config_as_the_source_applies_it_has_its_data_and_the_id_together(data_set):
    config = load_config(preset="tiny", overrides=[
        "data.source=parquet", f"data.path={data_set}", "data.options={}",
        "model.action_feature=btag", "model.view_action=pv"])
    assert config.data.max_seq_len == 128 and "max_seq_len" in config.data.data_set_wins
    source = _source(data_set)
    applied = config_as_source_applies(config, source)
    # The data set's own max_seq_len (32) and whole eval split, and 'pv' as its id: nothing else
    # changes.
    assert applied.data.max_seq_len == 32 and applied.data.eval_rows is None
    assert applied.data.data_set_wins == ()
    assert applied.model.view_action == 5
    assert applied == attrs.evolve(config, data=source.applied_config(config.data),
                                   model=attrs.evolve(config.model, view_action=5))


@pytest.mark.parametrize("command", [
    ["plan", "--gpus", "1", "--gpu-memory", "80", "--json"],
    ["bench", "flops", "--batch-size", "4", "--json"],
    # the peer's view action is text too, looked up in the subject's data set
    ["bench", "step", "--against", "model.view_action=buy", "--batch-size", "4", "--repeats",
     "1", "--rounds", "1", "--json"],
], ids=["plan", "bench-flops", "bench-step"])
def test_commands_that_build_the_model_look_the_text_up(data_set, command):
    """Each builds the model from the config and the data source: the text reaches the model as
    its id (the model refuses a text, see above)."""
    result = CliRunner().invoke(cli, [*command, "--preset", "tiny",
                                      *_on_data_set(data_set, "pv")])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["parameters"] if command[0] == "plan" else report["benchmark"]


def test_gem_config_show_sizes_the_model_with_the_text(data_set):
    result = CliRunner().invoke(cli, ["config", "show", "--preset", "tiny",
                                      *_on_data_set(data_set, "pv")])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "# parameters: " in result.stdout
    assert 'view_action = "pv"' in result.stdout  # the configuration shown is the one given
    # as the run records it: the text looked up in the data set's vocabulary
    applied = CliRunner().invoke(cli, ["config", "show", "--applied", "--no-sizes", "--preset",
                                       "tiny", *_on_data_set(data_set, "pv")])
    assert applied.exit_code == 0, (applied.output, applied.exception)
    assert 'view_action = "pv"' not in applied.stdout
    assert re.search(r"^view_action = \d+$", applied.stdout, re.M), applied.stdout


def test_gem_plan_refuses_a_text_not_in_the_vocabulary_naming_the_key(data_set):
    result = CliRunner().invoke(cli, ["plan", "--gpus", "1", "--gpu-memory", "80", "--preset",
                                      "tiny", *_on_data_set(data_set, "view")])
    assert result.exit_code == 1
    assert ("model.view_action = 'view': 'view' is not in the vocabulary of event feature "
            "'btag'") in result.output


def test_gem_plan_measures_activations_at_its_own_lengths_on_a_data_set(data_set):
    """The plan's activation fit cuts histories at lengths of its own; a data set's own
    max_seq_len (which wins over a preset's) must not make both measurements alike."""
    from gem_core.plugins import build_plugins
    from gem_parallel.plan import measure_activations

    config = load_config(preset="tiny", overrides=[
        "data.source=parquet", f"data.path={data_set}", "data.options={}"])
    assert "max_seq_len" in config.data.data_set_wins  # the data set's 32 would replace both
    fit = measure_activations(config, build_plugins(), "none", lengths=(4, 16))
    short, long = fit["tokens"]
    assert short < long and fit["per_sample"] > 0


def test_actions_declared_in_the_schema_reach_the_model_as_ids(tmp_path):
    (tmp_path / "logs").mkdir()
    out = _imported(tmp_path / "logs", tmp_path / "data",
                    'action_feature = "btag"\nview_action = "pv"\n' + SCHEMA)
    source = _source(out)
    assert (source.schema.action_feature, source.schema.view_action) == ("btag", "pv")
    config = load_config(preset="tiny", overrides=[
        "data.source=parquet", f"data.path={out}", "data.options={}",
        "model.action_feature=schema", "model.target_match_latest=with_actions"])
    applied = config_as_source_applies(config, source)
    # the declared feature and the view's id (the vocabulary's pv), as the run records them
    assert (applied.model.action_feature, applied.model.view_action) == ("btag", 5)


def test_a_declared_view_given_as_text_needs_a_vocabulary(tmp_path):
    (tmp_path / "schema.toml").write_text(
        'action_feature = "btag"\nview_action = "pv"\n'
        + SCHEMA.replace('[import.strings]\nbtag = "vocabulary"\n', ""))
    (tmp_path / "imp.csv").write_text("user_id,request_id,timestamp,ad,click\n1,r,10,3,1\n")
    (tmp_path / "ev.csv").write_text("user_id,timestamp,ad,btag\n1,5,3,7\n")
    with pytest.raises(GemDataError, match="view_action = 'pv' is an action's text, looked up "
                                           "in the vocabulary of table 'btag'.*needs "
                                           'import.strings.btag = "vocabulary"'):
        import_logs(tmp_path / "imp.csv", tmp_path / "ev.csv", tmp_path / "schema.toml",
                    tmp_path / "out")
