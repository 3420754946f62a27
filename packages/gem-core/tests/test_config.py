import pytest

from gem_core.config import GemConfig, load_config, preset_names, structure, to_toml, unstructure
from gem_core.config.loading import parse_override
from gem_core.errors import GemConfigError


def test_every_preset_loads_and_has_the_contract_keys():
    assert "tiny" in preset_names()
    for name in preset_names():
        config = load_config(preset=name)
        for key in ("steps", "seed", "batch_size", "eval_every", "checkpoint_every"):
            assert hasattr(config.train, key)
        assert config.name == name


def test_default_preset_is_tiny():
    assert load_config().name == "tiny"


def test_overrides_are_typed_and_applied():
    config = load_config(overrides=["train.steps=7", "model.normalization=silu",
                                    "model.interaction_dims=[16, 8]", "train.lr=1e-3",
                                    "data.options.num_items=500"])
    assert config.train.steps == 7
    assert config.model.normalization == "silu"
    assert config.model.interaction_dims == (16, 8)
    assert config.train.lr == pytest.approx(1e-3)
    assert config.data.options["num_items"] == 500


@pytest.mark.parametrize("override, message", [
    ("train.stpes=3", "unknown key 'train.stpes'; allowed keys in train: steps, seed"),
    ("model.normalization=foo", "model.normalization must be one of softmax, silu; got 'foo'"),
    ("train.steps=-1", "train.steps must be > 0; got -1"),
    ("train.steps=abc", "train.steps must be an integer; got 'abc'"),
    ("train.deterministic=1", "train.deterministic must be true or false; got 1"),
    ("model.num_heads=3", "embedding_dim (32) must be divisible by num_heads (3)"),
    ("nosuchsection.x=1", "unknown key 'nosuchsection'"),
    ("train.steps", "expected dotted.key=value"),
    ("train.steps.x=1", "steps is a value, not a section"),
])
def test_bad_overrides_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(GemConfigError) as error:
        load_config(overrides=[override])
    assert message in str(error.value)


def test_unknown_preset_lists_presets():
    with pytest.raises(GemConfigError, match="unknown preset 'nope'; presets: .*tiny"):
        load_config(preset="nope")


def test_toml_round_trip(tmp_path):
    config = load_config(overrides=["train.steps=11"])
    path = tmp_path / "run.toml"
    path.write_text(to_toml(unstructure(config)))
    again = load_config(path=path)
    assert again == config


def test_configs_are_frozen():
    config = GemConfig()
    with pytest.raises(AttributeError):
        config.train = None  # type: ignore[misc]


def test_parse_override_keeps_bare_words_as_strings():
    assert parse_override("backends.attention=triton") == (["backends", "attention"], "triton")
    assert parse_override("train.deterministic=true") == (["train", "deterministic"], True)


def test_structure_rejects_non_table():
    with pytest.raises(GemConfigError, match="model must be a table"):
        structure(GemConfig, {"model": 3})


def test_choosing_another_data_source_drops_the_presets_source_options():
    assert load_config().data.options  # tiny carries options of its synthetic source
    assert load_config(overrides=["data.source=parquet"]).data.options == {}
    kept = load_config(overrides=["data.source=parquet", "data.options.shuffle=false"])
    assert kept.data.options == {"shuffle": False}
    same = load_config(overrides=["data.source=synthetic"])
    assert same.data.options == load_config().data.options
