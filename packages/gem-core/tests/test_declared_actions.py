"""Actions the data declares (``FeatureSchema.action_feature``, ``view_action``) and the model
options that read them (``model.action_feature = "schema"``, ``model.target_match_latest =
"with_actions"``, ``model.target_match_latest_window``)."""

from __future__ import annotations

import attrs
import pytest

from gem_core.config import ModelConfig
from gem_core.model.actions import declared_actions, latest_by_action
from gem_core.schema import (
    ContextFeature,
    EmbeddingTable,
    FeatureSchema,
    SequenceFeature,
    schema_from_dict,
    schema_to_dict,
)
from gem_core.testing.models import small_model, synthetic_batch


def schema(**declared) -> FeatureSchema:
    return FeatureSchema(
        tables=[EmbeddingTable(name="ad", num_embeddings=10),
                EmbeddingTable(name="btag", num_embeddings=4),
                EmbeddingTable(name="topic", num_embeddings=8),
                EmbeddingTable(name="segment", num_embeddings=4)],
        event_features=[SequenceFeature(name="ad", table="ad"),
                        SequenceFeature(name="btag", table="btag"),
                        SequenceFeature(name="topics", table="topic", multi_valued=True)],
        candidate_features=[SequenceFeature(name="ad", table="ad")],
        sparse_features=[ContextFeature(name="segment", table="segment")],
        tasks=("click",), **declared)


def test_the_schema_declares_a_single_valued_event_feature_or_is_refused():
    assert schema(action_feature="btag", view_action=3).view_action == 3
    assert schema(action_feature="btag", view_action="pv").view_action == "pv"
    with pytest.raises(ValueError, match="action_feature = 'segment' is not an event feature; "
                                         "event features: ad, btag, topics"):
        schema(action_feature="segment")
    with pytest.raises(ValueError, match="action_feature = 'topics' is multi-valued"):
        schema(action_feature="topics")
    with pytest.raises(ValueError, match="view_action = 'pv' needs action_feature"):
        schema(view_action="pv")
    with pytest.raises(ValueError, match="view_action must be a raw id"):
        schema(action_feature="btag", view_action=1.5)


def test_the_declaration_is_written_only_where_there_is_one_and_reads_back():
    # A schema without actions reads as it did before the fields existed (same digest).
    assert "action_feature" not in schema_to_dict(schema())
    assert "view_action" not in schema_to_dict(schema())
    declared = schema(action_feature="btag", view_action="pv")
    data = schema_to_dict(declared)
    assert data["action_feature"] == "btag" and data["view_action"] == "pv"
    assert schema_from_dict(data) == declared
    with pytest.raises(ValueError, match="schema.toml: .*action_feature = 'nope' is not an"):
        schema_from_dict({**data, "action_feature": "nope"}, where="schema.toml")


def test_schema_resolves_to_the_declared_feature_and_view():
    config = ModelConfig(action_feature="schema", view_action=7)
    resolved = declared_actions(config, schema(action_feature="btag", view_action=2))
    assert (resolved.action_feature, resolved.view_action) == ("btag", 2)
    # none declared: no action feature, and the view id back to its default
    bare = declared_actions(config, schema())
    assert (bare.action_feature, bare.view_action) == ("", 0)
    # any other value is the model's own
    own = ModelConfig(action_feature="btag", view_action=1)
    assert declared_actions(own, schema(action_feature="btag", view_action=2)) is own
    with pytest.raises(ValueError, match="'schema' reads the data's declared action feature, "
                                         "and this data declares none: .*retrieve_engaged"):
        declared_actions(ModelConfig(action_feature="schema", attribute_attention=True,
                                     attribute_attention_retrieve=4,
                                     attribute_attention_retrieve_engaged=True), schema())


def test_latest_with_actions_is_on_only_where_there_is_an_action_feature():
    assert latest_by_action(ModelConfig(target_match_latest="with_actions", action_feature="a"))
    assert not latest_by_action(ModelConfig(target_match_latest="with_actions"))
    assert latest_by_action(ModelConfig(target_match_latest=True))
    assert not latest_by_action(ModelConfig())
    with pytest.raises(ValueError, match="target_match_latest must be one of"):
        ModelConfig(target_match_latest="sometimes")


def test_the_model_reads_the_declaration_and_its_latest_window():
    s, _ = synthetic_batch(2, max_seq_len=20)  # gem-core's synthetic source declares "action"
    assert (s.action_feature, s.view_action) == ("action", 0)
    options = dict(target_match=4, action_feature="schema", target_match_latest="with_actions",
                   target_match_latest_window=1024)
    model = small_model(s, **options)
    assert model.config.action_feature == "action"
    match = model.target_match
    # views and engaged events apart: 2 classes x 1 shared attribute (item) x flag and
    # position; the window clipped to the longest history the data holds
    assert match.action_feature == "action" and match.latest[0].in_features == 4
    assert match.latest_window == 20 and match.window == 4
    # The same preset options on data that declares no actions: no latest token at all.
    undeclared = attrs.evolve(s, action_feature="", view_action=0)
    plain = small_model(undeclared, **options)
    assert plain.config.action_feature == "" and plain.target_match.latest is None
    assert plain.target_match.tokens == 1
    # "with_actions" does not apply with target match off (the learned path alone of a preset)
    assert small_model(s, **{**options, "target_match": 0}).target_match is None
    with pytest.raises(ValueError, match="target_match_latest_window is the window of the "
                                         "latest-match token, and .* is off"):
        small_model(s, target_match=4, target_match_latest_window=8)


@pytest.mark.parametrize("source", ["synthetic", "synthetic-ads"])
def test_config_show_applied_prints_what_schema_resolves_to(source):
    """As given, `gem config show` prints "schema"; `--applied` prints what a run on the data
    records (both synthetic sources declare their `action`, 0 the view)."""
    from click.testing import CliRunner

    from gem_core.cli.main import cli

    args = ["config", "show", "--no-sizes", "--preset", "tiny-gem",
            "--set", f"data.source={source}", "--set", "data.options={}"]
    given = CliRunner().invoke(cli, args)
    assert given.exit_code == 0, given.output
    assert 'action_feature = "schema"' in given.stdout
    applied = CliRunner().invoke(cli, [*args, "--applied"])
    assert applied.exit_code == 0, (applied.output, applied.exception)
    assert {'action_feature = "action"', "view_action = 0"} <= set(applied.stdout.splitlines())


def test_an_option_the_model_refuses_is_a_clean_error_on_the_command_line(tmp_path):
    """The model's own checks of its options (here a latest window without the latest token)
    reach the user as a one-line error naming the options, not as a traceback: `gem train`
    stops with it, `gem config show` says it where the model's size would be."""
    from click.testing import CliRunner

    from gem_core.cli.main import cli
    from gem_core.errors import GemConfigError

    with pytest.raises(GemConfigError):
        small_model(schema(action_feature="btag"), target_match=4, target_match_latest_window=8)
    refused = ("model.target_match_latest_window is the window of the latest-match token, "
               "and model.target_match_latest is off")
    options = ["--preset", "tiny", "--set", "model.target_match_latest_window=5"]
    train = CliRunner().invoke(cli, ["train", *options, "--set", "train.steps=1",
                                     "--no-progress", "--out", str(tmp_path / "run")])
    assert train.exit_code == 1, (train.output, train.exception)
    assert isinstance(train.exception, SystemExit)  # click's own exit, no escaped exception
    assert f"Error: {refused}" in train.output
    show = CliRunner().invoke(cli, ["config", "show", *options])
    assert show.exit_code == 0, (show.output, show.exception)
    assert f"# Model size not computed: the model refuses these options ({refused})" in show.output
