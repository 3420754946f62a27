"""``gem config explain`` and ``gem config presets``: every key documented from the attrs
classes, with the rule its validator enforces (issue #21, item 2)."""

from __future__ import annotations

import json

import attrs
import pytest
from click.testing import CliRunner

from gem_core.cli.main import cli
from gem_core.config import MoeConfig, TrainConfig, load_config, preset_names
from gem_core.config.docs import KeyDoc, SectionDoc, explain, field_docstrings
from gem_core.config.validators import at_least, choice
from gem_core.errors import GemConfigError


def _gem(*args: str):
    result = CliRunner().invoke(cli, ["--log-level", "WARNING", *args])
    return result


@attrs.frozen(kw_only=True)
class _Base:
    size: int = attrs.field(default=3, validator=at_least(1))
    """How big.

    Second paragraph."""

    undocumented: bool = False


@attrs.frozen(kw_only=True)
class _Child(_Base):
    mode: str = attrs.field(default="a", validator=choice("a", "b"))
    """Which mode."""


def test_field_docstrings_come_from_the_source_of_the_class_and_its_bases():
    docs = field_docstrings(_Child)
    assert docs == {"size": "How big.\n\nSecond paragraph.", "mode": "Which mode."}


def test_every_key_of_the_schema_has_a_docstring_a_type_and_a_default():
    keys = [entry for entry in explain() if isinstance(entry, KeyDoc)]
    assert len(keys) > 60
    assert [k.key for k in keys if not k.doc] == []
    assert [k.key for k in keys if not k.type] == []
    sections = {entry.key for entry in explain() if isinstance(entry, SectionDoc)}
    assert {"model", "model.moe", "train", "distill.adapter"} <= sections


def test_the_explained_choices_are_the_ones_the_loader_accepts():
    """The rule printed is the validator's own: each allowed value loads, another does not."""
    choice_keys = [k for k in explain() if isinstance(k, KeyDoc) and k.allowed
                   and k.type == "string"]
    assert {"model.normalization", "train.device", "model.moe.impl"} <= {k.key
                                                                        for k in choice_keys}
    for key in choice_keys:
        for value in key.allowed:
            try:
                load_config(overrides=[f"{key.key}={value}"])
            except GemConfigError as error:  # a cross-key rule (cached needs events) is not it
                assert "must be one of" not in str(error), (key.key, value, error)
        with pytest.raises(GemConfigError, match=key.key):
            load_config(overrides=[f"{key.key}=not-a-choice"])


def test_explain_a_section_prints_its_keys_with_type_default_rule_and_description():
    result = _gem("config", "explain", "model.moe")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "[model.moe]" in text
    for field in attrs.fields(MoeConfig):
        assert f"model.moe.{field.name} = " in text
    assert "model.moe.top_k = 2    (integer; > 0)" in text
    assert "(string; one of reference, grouped)" in text
    assert field_docstrings(MoeConfig)["capacity_factor"].splitlines()[0] in text
    assert "train.steps" not in text and "model.embedding_dim" not in text


def test_explain_a_key_as_json():
    result = _gem("config", "explain", "--json", "train.steps", "model.moe.where")
    assert result.exit_code == 0, result.output
    rows = {row["key"]: row for row in json.loads(result.output)}
    assert set(rows) == {"train.steps", "model.moe.where"}
    steps = rows["train.steps"]
    assert steps["default"] == TrainConfig().steps
    assert (steps["type"], steps["rule"]) == ("integer", "> 0")
    assert steps["doc"] == field_docstrings(TrainConfig)["steps"]
    assert rows["model.moe.where"]["allowed"] == ["sequence", "wukong"]
    assert rows["model.moe.where"]["default"] == ["sequence"]


def test_backend_keys_list_the_registered_implementations():
    result = _gem("config", "explain", "--json", "backends.attention", "data.source")
    rows = {row["key"]: row for row in json.loads(result.output)}
    attention, source = rows["backends.attention"]["choices"], rows["data.source"]["choices"]
    assert attention[0] == "auto" and "reference" in attention
    assert "synthetic" in source and "auto" not in source  # a data source is always named
    text = _gem("config", "explain", "backends.attention").output
    assert f"one of {', '.join(attention)} (installed plugins)" in text


def test_an_unknown_key_is_an_error_naming_the_close_matches():
    result = _gem("config", "explain", "train.step")
    assert result.exit_code != 0
    assert "unknown configuration key 'train.step'; did you mean train.steps" in result.output
    bare = _gem("config", "explain", "warmup_steps")
    assert "did you mean train.warmup_steps" in bare.output
    nothing = _gem("config", "explain", "zzz")
    assert "sections: model, data, train" in nothing.output


def test_presets_are_listed_with_their_description():
    result = _gem("config", "presets")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    tiny = next(line for line in lines if line.startswith("tiny "))
    assert "The default preset" in tiny
    listed = json.loads(_gem("config", "presets", "--json").output)
    assert all(row["description"].endswith(".") for row in listed), listed


def test_explain_describes_the_options_of_the_configured_plugins():
    one = _gem("config", "explain", "data.options.num_items")
    assert one.exit_code == 0, one.output
    assert "data.options.num_items = 2000    (integer; > 10)" in one.output
    assert "Item id space" in one.output
    table = _gem("config", "explain", "data.options").output
    assert "The options of data 'synthetic' (this configuration's), below." in table
    assert "data.options.content_dim = 8" in table
    # --preset/--config/--set choose the implementation whose options are explained.
    none = _gem("config", "explain", "--set", "backends.dense_sharding=none", "parallel.dense")
    assert "dense_sharding 'none' (this configuration's) takes no options." in none.output
    unknown = _gem("config", "explain", "data.options.num_itemz")
    assert unknown.exit_code != 0
    assert ("unknown configuration key 'data.options.num_itemz'; the keys of data.options: "
            "data.options.num_items, data.options.num_users") in unknown.output
    # The precision recipe's [precision.options] too: fp32 declares none, so it has no keys.
    fp32 = ["--set", "backends.precision=fp32"]
    none = _gem("config", "explain", *fp32, "precision.options")
    assert "precision 'fp32' (this configuration's) takes no options." in none.output
    unknown = _gem("config", "explain", *fp32, "precision.options.min_dim")
    assert unknown.exit_code != 0
    assert ("unknown configuration key 'precision.options.min_dim'; the keys of "
            "precision.options: (none)") in unknown.output


def test_every_installed_plugin_option_is_explained_with_a_docstring():
    """What done looks like for plugin options: every options class of every installed
    implementation is described by gem config explain, each key with its docstring."""
    from gem_core.config.docs import describe_class
    from gem_core.kinds import KIND_TABLE
    from gem_core.plugins import build_plugins

    plugins = build_plugins()
    described = 0
    kinds = set()
    for kind in KIND_TABLE:
        for spec in plugins.registry(kind.name).specs():
            options = spec.options_class() if not spec.missing_requirements() else None
            if options is None:
                continue
            keys = [e for e in describe_class(options, kind.options_key) if isinstance(e, KeyDoc)]
            assert keys and [k.key for k in keys if not k.doc] == [], (kind.name, spec.name)
            described += 1
            kinds.add(kind.name)
    assert described >= 1  # at least gem-core's synthetic source
    # Every kind whose installed implementations declare options is among them: the
    # strategies' and data sources', and the precision recipes' (gem-precision's FP8 ones).
    declaring = {kind.name for kind in KIND_TABLE for spec in plugins.registry(kind.name).specs()
                 if spec.options is not None and not spec.missing_requirements()}
    assert kinds == declaring and "data" in kinds
    assert {k.name for k in KIND_TABLE if k.options_key} >= {"precision", "dense_sharding",
                                                            "embedding_sharding", "data"}
