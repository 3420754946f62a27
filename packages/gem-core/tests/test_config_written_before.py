"""A stored configuration (a checkpoint's, a run directory's ``config.toml``) without a key
added since means what the version that wrote it did, where that is not the key's default
today (``gem_core.config.written_before``)."""

from __future__ import annotations

import copy

import pytest

from gem_core.checkpoint.resume import with_defaults
from gem_core.config import load_config, to_toml, unstructure
from gem_core.config.written_before import BEHAVIOUR_BEFORE_THE_KEY, as_written


def _written_before_the_keys() -> dict:
    """``tiny``'s configuration as a version without the keys of BEHAVIOUR_BEFORE_THE_KEY
    stored it."""
    stored = unstructure(load_config(preset="tiny"))
    for section, key in BEHAVIOUR_BEFORE_THE_KEY:
        del stored[section][key]
    return stored


def test_the_missing_keys_take_the_behaviour_before_them_and_present_ones_stay():
    stored = _written_before_the_keys()
    kept = copy.deepcopy(stored)
    filled = as_written(stored)
    assert stored == kept  # not changed in place
    assert filled["model"]["numeric_scale"] == "none"
    assert filled["model"]["cross_branch_opening"] == "gate"
    assert filled["model"]["id_bias_step"] == "constant"
    # Where a default changed, today's default differs from what the old version did.
    today = unstructure(load_config(preset="tiny"))
    for (section, key), before in BEHAVIOUR_BEFORE_THE_KEY.items():
        assert today[section][key] != before
    # A configuration written with the keys keeps its values.
    assert as_written(today) == today


def test_a_resumed_checkpoint_compares_as_it_was_trained():
    saved = with_defaults(_written_before_the_keys())
    assert saved["model"]["numeric_scale"] == "none"
    assert saved["model"]["cross_branch_opening"] == "gate"
    # Keys added with the old behaviour as their default are filled with it as before.
    assert saved["model"]["dense_tokens"] == "one"


@pytest.mark.parametrize("stored, expected", [(True, "none"), (False, "log")])
def test_a_run_directory_config_reads_as_written_a_user_file_as_today(tmp_path, stored,
                                                                       expected):
    path = tmp_path / "config.toml"
    path.write_text(to_toml(_written_before_the_keys()))
    assert load_config(path=path, stored=stored).model.numeric_scale == expected


def test_a_removed_option_at_its_neutral_value_is_dropped_and_any_other_value_is_named(
        tmp_path):
    """A run written before an option was removed loads where the option left the model as
    today's (its neutral value); at another value the error names it rather than reading
    another model."""
    from gem_core.config.written_before import REMOVED_KEYS
    from gem_core.errors import GemConfigError

    today = unstructure(load_config(preset="tiny"))
    stored = copy.deepcopy(today)
    for (section, key), neutral in REMOVED_KEYS.items():
        stored[section][key] = neutral
    assert as_written(stored) == today
    assert ("model", "target_match_skip") in REMOVED_KEYS
    path = tmp_path / "config.toml"
    path.write_text(to_toml(stored))
    assert unstructure(load_config(path=path, stored=True)) == {**today, "name": "tiny"}
    with pytest.raises(GemConfigError, match="unknown key 'model.target_match_"):
        load_config(path=path)  # a user's file: the option does not exist
    stored["model"]["target_match_skip"] = ["category"]
    with pytest.raises(GemConfigError, match=r"model.target_match_skip = \['category'\]: the run "
                                             "was trained with an option"):
        as_written(stored)
