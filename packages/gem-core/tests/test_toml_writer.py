"""The one TOML writer (``gem_core.config.loading``): what it writes reads back the same."""

import tomllib

import pytest

from gem_core.config import to_toml
from gem_core.config.loading import toml_key, toml_literal, toml_string
from gem_core.errors import GemConfigError

AWKWARD = [
    "",
    'say "hi"',
    "C:\\path\\to\\file",
    'a \\" b',  # a backslash before a quote
    "line one\nline two\r\n",
    "tab\there, bell\a, nul\x00, escape\x1b, delete\x7f, \b\f",
    "café, naïve, 日本語",
    "emoji 😀 beyond U+FFFF",
    "\u2028 line separator",
    "'single' and '''triple''' quotes",
    '"""',
]


@pytest.mark.parametrize("text", AWKWARD)
def test_a_string_round_trips_through_tomllib(text):
    written = toml_string(text)
    assert written.isascii() and "\n" not in written  # one line, whatever the locale
    assert tomllib.loads(f"v = {written}")["v"] == text
    assert tomllib.loads(f"v = {toml_literal(text)}")["v"] == text


@pytest.mark.parametrize("key", ["plain_key-1", "dotted.key", "with space", 'q"uote', "é", ""])
def test_a_key_round_trips_and_is_bare_only_where_toml_allows(key):
    assert tomllib.loads(f"{toml_key(key)} = 1") == {key: 1}
    assert (toml_key(key) == key) == (key == "plain_key-1")


def test_nested_data_round_trips_through_to_toml():
    data = {"name": 'a "quoted"\\name\n', "n": 3, "x": 0.5, "flag": False,
            "items": AWKWARD, "inline": [{"k": "v\t", "odd key": [1, 2]}],
            "section": {"text": "😀", "sub.table": {"a b": "c"}}}
    assert tomllib.loads(to_toml(data)) == data


def test_what_toml_cannot_hold_is_refused():
    with pytest.raises(GemConfigError, match="no null"):
        toml_literal(None)
    with pytest.raises(GemConfigError, match="surrogate"):
        toml_string("bad \udcff byte")
    with pytest.raises(GemConfigError, match="cannot write"):
        toml_literal(object())
