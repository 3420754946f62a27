"""A schema file with an ``[import]`` table (docs/byod.md) is accepted by every command that takes
a schema file: ``gem data import --schema``, ``gem data schema check`` (which checks the table with
the importer's own parser and prints it back) and ``gem data validate --schema`` (which compares
the feature schema only). An error in the table is the importer's, word for word, everywhere."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from gem_core.errors import GemDataError
from gem_data.check import read_schema_and_import
from gem_data.cli import data_group
from gem_data.import_options import read_schema_file

DOC = Path(__file__).resolve().parents[3] / "docs" / "byod.md"


def blocks(prefix: str) -> dict[str, str]:
    """The first fenced block after each ``<!-- PREFIX:NAME -->`` marker of docs/byod.md."""
    found: dict[str, str] = {}
    for name, body in re.findall(rf"<!-- {prefix}:(\S+) -->\n```\w*\n(.*?)```", DOC.read_text(),
                                 flags=re.S):
        found.setdefault(name, body)
    return found


@pytest.fixture()
def byod(tmp_path) -> Path:
    """docs/byod.md's walk-through files (schema.toml has ``[import] eval_fraction``)."""
    for name, body in blocks("byod").items():
        if "." in name:
            (tmp_path / name).write_text(body)
    return tmp_path


@pytest.fixture()
def taobao(tmp_path) -> Path:
    """docs/byod.md's multi-table example: ``[import.strings]``, ``[import.features]`` and two
    ``[[import.join]]`` side tables."""
    for name, body in blocks("byod-taobao").items():
        if "." in name:
            (tmp_path / name).write_text(body)
    return tmp_path / "taobao.toml"


def gem_data(*args: str):
    result = CliRunner().invoke(data_group, list(args), catch_exceptions=False)
    return result


def test_the_walkthrough_schema_has_an_import_table(byod):
    assert "[import]" in (byod / "schema.toml").read_text()


def test_schema_check_accepts_import_and_prints_it_back(byod):
    done = gem_data("schema", "check", str(byod / "schema.toml"))
    assert done.exit_code == 0, done.output
    assert "unknown" not in done.output
    assert "[import]" in done.output and "eval_fraction = 0.25" in done.output
    assert 'user_column = "user_id"' in done.output  # every key with the value that applies
    # What it prints is a schema file that reads back the same, [import] included.
    printed = byod / "printed.toml"
    printed.write_text(done.output)
    assert read_schema_file(printed) == read_schema_file(byod / "schema.toml")
    again = gem_data("schema", "check", str(printed))
    assert again.exit_code == 0 and again.output == done.output


def test_schema_check_prints_strings_features_and_joins_back(taobao):
    done = gem_data("schema", "check", str(taobao))
    assert done.exit_code == 0, done.output
    for expected in ("[import.strings]", 'btag = "vocabulary"', "[import.features]",
                     '"event.brand" = {missing = "default", default = 0}', "[[import.join]]",
                     'file = "ad_feature.csv"', 'log_key = "user"'):
        assert expected in done.output
    printed = taobao.with_name("printed.toml")  # beside it: the side tables resolve the same
    printed.write_text(done.output)
    assert read_schema_file(printed) == read_schema_file(taobao)


def test_schema_check_json_has_the_import_table(byod):
    done = gem_data("schema", "check", "--json", str(byod / "schema.toml"))
    assert done.exit_code == 0, done.output
    data = json.loads(done.output)
    assert data["import"]["eval_fraction"] == 0.25 and data["tasks"] == ["click", "conversion"]


def test_schema_check_without_import_is_unchanged(byod):
    text = (byod / "schema.toml").read_text()
    plain = byod / "plain.toml"
    plain.write_text(text[:text.index("[import]")])
    done = gem_data("schema", "check", str(plain))
    assert done.exit_code == 0, done.output
    assert "[import]" not in done.output
    assert json.loads(gem_data("schema", "check", "--json", str(plain)).output).get(
        "import") is None
    schema, options = read_schema_and_import(plain)
    assert options is None and schema == read_schema_file(byod / "schema.toml")[0]


@pytest.mark.parametrize("edit, message", [
    (("eval_fraction = 0.25", "eval_fracton = 0.25"), "unknown key 'import.eval_fracton'"),
    (("eval_fraction = 0.25", 'eval_fraction = 0.25\n[import.columns]\n"lable.click" = "c"'),
     "did you mean 'label.click'"),
    (("eval_fraction = 0.25", "eval_fraction = 2.0"), "eval_fraction"),
])
def test_an_import_error_is_the_importers_in_every_command(byod, edit, message):
    bad = byod / "bad.toml"
    bad.write_text((byod / "schema.toml").read_text().replace(*edit))
    with pytest.raises(GemDataError) as raised:
        read_schema_file(bad)
    assert message in str(raised.value)
    data_set = byod / "data"
    imported = gem_data("import", "--impressions", str(byod / "impressions.csv"), "--events",
                        str(byod / "events.csv"), "--schema", str(byod / "schema.toml"),
                        "--out", str(data_set))
    assert imported.exit_code == 0, imported.output
    for args in (("schema", "check", str(bad)),
                 ("validate", str(data_set), "--schema", str(bad)),
                 ("import", "--impressions", str(byod / "impressions.csv"), "--events",
                  str(byod / "events.csv"), "--schema", str(bad), "--out",
                  str(byod / "other"))):
        done = gem_data(*args)
        assert done.exit_code != 0, args
        assert str(raised.value) in done.output, (args, done.output)


def test_validate_with_the_import_schema_compares_the_feature_schema_only(byod):
    data_set = byod / "data"
    imported = gem_data("import", "--impressions", str(byod / "impressions.csv"), "--events",
                        str(byod / "events.csv"), "--schema", str(byod / "schema.toml"),
                        "--out", str(data_set))
    assert imported.exit_code == 0, imported.output
    done = gem_data("validate", str(data_set), "--schema", str(byod / "schema.toml"), "--json")
    assert done.exit_code == 0, done.output
    result = json.loads(done.output)
    assert result["errors"] == [] and result["schema_differences"] == []
    # Another eval_fraction is an import option, not a difference of the data.
    other = byod / "other.toml"
    other.write_text((byod / "schema.toml").read_text().replace("eval_fraction = 0.25",
                                                                "eval_fraction = 0.5"))
    done = gem_data("validate", str(data_set), "--schema", str(other), "--json")
    assert done.exit_code == 0 and json.loads(done.output)["schema_differences"] == []
    # A feature schema that differs is noted, as without [import].
    longer = byod / "longer.toml"
    longer.write_text((byod / "schema.toml").read_text().replace("max_seq_len = 256",
                                                                 "max_seq_len = 512"))
    done = gem_data("validate", str(data_set), "--schema", str(longer))
    assert done.exit_code == 0, done.output
    assert "differs from the manifest's schema in max_seq_len" in done.output


def test_validate_a_directory_of_files_with_the_import_schema(byod):
    """A directory of Parquet files without a manifest, checked against the import schema."""
    data_set = byod / "data"
    gem_data("import", "--impressions", str(byod / "impressions.csv"), "--events",
             str(byod / "events.csv"), "--schema", str(byod / "schema.toml"), "--out",
             str(data_set))
    files = byod / "files"
    files.mkdir()
    for path in sorted(data_set.glob("*.parquet")):
        (files / path.name).write_bytes(path.read_bytes())
    done = gem_data("validate", str(files), "--schema", str(byod / "schema.toml"))
    assert done.exit_code == 0, done.output
    assert "0 errors" in done.output
