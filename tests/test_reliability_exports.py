"""Exports are untrusted input: ``gem score`` and every loader of an export directory refuse, in
one line naming the file, code planted in a ``.pt2`` (pickled payloads, Python in the graph) and
files that are not as ``gem export-model`` wrote them (flipped bits, another model's program,
truncated, missing, a garbage or foreign manifest, paths leaving the directory); ``gem export
verify`` reports the same offline. An export is published whole: a crash or ``kill -9`` during
a re-export leaves the old one intact. Readers of a run build it from the configuration stored
with the checkpoint and refuse a ``config.toml`` edited since. ``gem score`` refuses an empty
eval split.

One short ``tiny`` run on a Parquet data set (checkpoints at steps 2 and 4), exported once;
every test damages a copy."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("pyarrow")

from gem_core.checkpoint.digests import digest_file  # noqa: E402
from gem_core.cli.main import cli  # noqa: E402
from gem_core.errors import GemError  # noqa: E402

TRAIN = ("train.steps=4", "train.batch_size=32", "train.eval_every=0",
         "train.checkpoint_every=2", "data.max_seq_len=32", "data.eval_rows=96",
         "data.source=parquet", "data.options={}")
PROGRAM = "full.pt2"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data set, run directory, export directory of step 4)."""
    from gem_core.config import load_config
    from gem_core.plugins import build_plugins
    from gem_core.serving.export import export_model
    from gem_core.train.trainer import train

    root = tmp_path_factory.mktemp("exports")
    data = root / "data"
    _ok(_gem("data", "synth", "--rows", "192", "--eval-rows", "96", "--row-group-rows", "64",
             "--out", data, "--set", "num_items=300"))
    run = root / "run"
    train(load_config(preset="tiny", overrides=[*TRAIN, f"data.path={data}"]), build_plugins(),
          run, progress=False)
    export_model(run, root / "export")
    return data, run, root / "export"


@pytest.fixture
def export(trained, tmp_path) -> Path:
    """A copy of the export to damage."""
    copy = tmp_path / "export"
    shutil.copytree(trained[2], copy)
    return copy


def _gem(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _ok(result) -> str:
    assert result.exit_code == 0, result.output[-3000:]
    return result.output


def _one_line_error(result, *named: str) -> str:
    """The ``Error:`` line of a command that failed the way a user should see it: exit code
    1, no traceback, one line naming ``named``."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (
        result.exception, result.output[-3000:])
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output[-3000:]
    for name in named:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def _score(export: Path, data: Path, out: Path, *extra: str):
    return _gem("score", export, "--data", data, "--out", out, *extra)


def _rewrite_manifest(export: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((export / "manifest.json").read_text())
    change(manifest)
    (export / "manifest.json").write_text(json.dumps(manifest))


def _record_digest(export: Path) -> None:
    """What an attacker who rewrites the program also does: record its new size and digest."""
    def change(manifest):
        manifest.setdefault("files", {})[PROGRAM] = {"bytes": (export / PROGRAM).stat().st_size,
                                      "sha256": digest_file(export / PROGRAM)}
    _rewrite_manifest(export, change)


def _rewrite_archive(path: Path, change: Callable[[dict[str, bytes]], None]) -> None:
    """``path`` with its records (by name under the archive root) as ``change`` leaves them."""
    with zipfile.ZipFile(path) as source:
        infos = source.infolist()
        records = {i.filename.split("/", 1)[1]: source.read(i) for i in infos}
    change(records)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in infos:
            out.writestr(info, records[info.filename.split("/", 1)[1]])


class _Payload:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickled_entry(config_record: str, marker: Path) -> Callable[[dict[str, bytes]], None]:
    """Mark the first entry of ``config_record`` ``use_pickle`` (and those sharing its file)
    and make its file the payload."""
    def change(records: dict[str, bytes]) -> None:
        config = json.loads(records[config_record])
        file = next(iter(config["config"].values()))["path_name"]
        for entry in config["config"].values():
            entry["use_pickle"] = entry["use_pickle"] or entry["path_name"] == file
        records[config_record] = json.dumps(config).encode()
        records[config_record.rsplit("/", 1)[0] + "/" + file] = pickle.dumps(_Payload(marker))
    return change


def _plant(kind: str, path: Path, marker: Path) -> str:
    """Plant ``kind`` of payload in program ``path``; what the refusal must name."""
    if kind == "pickled weight":
        _rewrite_archive(path, _pickled_entry("data/weights/model_weights_config.json", marker))
        return "data/weights/model_weights_config.json"
    if kind == "pickled constant":
        _rewrite_archive(path, _pickled_entry("data/constants/model_constants_config.json",
                                              marker))
        return "data/constants/model_constants_config.json"
    if kind == "pickled sample inputs":
        _rewrite_archive(path, lambda records: records.update(
            {"data/sample_inputs/model.pt": pickle.dumps(_Payload(marker))}))
        return "data/sample_inputs/model.pt"

    def program(change: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
        def rewrite(records: dict[str, bytes]) -> None:
            model = json.loads(records["models/model.json"])
            change(model)
            records["models/model.json"] = json.dumps(model).encode()
        return rewrite

    if kind == "python guard":
        _rewrite_archive(path, program(lambda model: model["guards_code"].append(
            f"__import__('os').system('touch {marker}') == 0")))
        return "guard"
    if kind == "sympy expression":
        def expression(model):
            text = json.dumps(model).replace(
                '"expr_str": "Max(', f'"expr_str": "Max(Integer(__import__(\'os\').system('
                f'\'touch {marker}\') or None), ', 1)
            model.clear()
            model.update(json.loads(text))
        _rewrite_archive(path, program(expression))
        return "expression"
    assert kind == "graph node"

    def node(model):
        model["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.os.system"
    _rewrite_archive(path, program(node))
    return "'torch.serialization.os.system'"


def _run_with_torch(path: Path, kind: str) -> None:
    """What torch does with ``path``: ``torch.export.load`` (which unpickles and sympifies; the
    planted payloads fail it soon after they ran), or for a guard torch's guard compiler and
    the guard (as the loaded program's first call runs it)."""
    try:
        if kind == "python guard":
            from torch.export._unlift import _convert_guards_code_to_fn

            with zipfile.ZipFile(path) as archive:
                model = json.loads(archive.read("full/models/model.json"))
            _convert_guards_code_to_fn(model["guards_code"][-1:], [])()
        else:
            torch.export.load(path)
    except Exception:  # noqa: BLE001 - what torch makes of the rest does not matter
        pass


PAYLOADS = ("pickled weight", "pickled constant", "pickled sample inputs", "python guard",
            "sympy expression", "graph node")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_code_planted_in_a_program_never_runs(trained, export, tmp_path, kind):
    data = trained[0]
    marker = tmp_path / "MARKER"
    named = _plant(kind, export / PROGRAM, marker)
    _record_digest(export)  # the digests agree: only the archive check stands in the way
    if kind != "graph node":
        _run_with_torch(export / PROGRAM, kind)
        assert marker.exists(), kind  # the payload is real: torch's own loader runs it
        marker.unlink()
    line = _one_line_error(_score(export, data, tmp_path / "scored"), PROGRAM, named,
                           "refusing to load it")
    assert not marker.exists(), line
    assert not (tmp_path / "scored" / "score.json").exists()
    verified = _gem("export", "verify", export)
    assert verified.exit_code == 1 and named in verified.output and "damaged" in verified.output
    assert not marker.exists()
    # The loader every reader goes through refuses it as well.
    from gem_core.serving.integrity import open_export
    from gem_core.serving.loading import load_program

    with pytest.raises(GemError, match="refusing to load it"):
        load_program(export, open_export(export), "full")
    assert not marker.exists()


def _weight_offset(path: Path, record: str) -> int:
    """Where the bytes of ``record`` (under the archive root) start in the file."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/" + record))
    with open(path, "rb") as stream:
        stream.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", stream.read(4))
    return info.header_offset + 30 + name_length + extra_length


def test_a_flipped_bit_in_a_weight_is_refused_by_score_and_verify(trained, export, tmp_path):
    data = trained[0]
    intact = _ok(_gem("export", "verify", export))
    assert f"{PROGRAM}  ok" in intact and "OK (1 file, checkpoint step 4)" in intact
    at = _weight_offset(export / PROGRAM, "data/weights/weight_0") + 100
    content = bytearray((export / PROGRAM).read_bytes())
    content[at] ^= 0x01
    (export / PROGRAM).write_bytes(bytes(content))
    _one_line_error(_score(export, data, tmp_path / "scored"), PROGRAM,
                    "content differs from its sha256 digest")
    report = _gem("export", "verify", export)
    assert report.exit_code == 1
    assert f"{PROGRAM}  damaged" in report.output and "damaged (full.pt2)" in report.output
    as_json = json.loads(_gem("export", "verify", export, "--json").output)
    assert not as_json["ok"] and as_json["files"][0]["status"] == "damaged"


def test_another_models_program_swapped_in_is_refused(trained, export, tmp_path):
    """Another model of the same schema in place of ``full.pt2`` (the same program with other
    weights, as another run of the same preset gives): today it scores with exit 0."""
    generator = torch.Generator().manual_seed(1)

    def other_weights(records):
        for name in [n for n in records if n.startswith("data/weights/weight_")]:
            other = torch.randn(len(records[name]) // 4, generator=generator)
            records[name] = other.numpy().tobytes()[:len(records[name])].ljust(
                len(records[name]), b"\0")
    _rewrite_archive(export / PROGRAM, other_weights)
    line = _one_line_error(_score(export, trained[0], tmp_path / "scored"), PROGRAM)
    assert "differs from its sha256 digest" in line or "written as" in line


def test_a_crash_during_a_re_export_leaves_the_old_export(trained, tmp_path, monkeypatch):
    from gem_core.serving.export import export_model

    run, target = trained[1], tmp_path / "export"
    shutil.copytree(trained[2], target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    save = torch.export.save

    def crash_mid_write(program, path, **kwargs):
        save(program, path, **kwargs)
        with open(path, "r+b") as stream:
            stream.truncate(os.path.getsize(path) // 2)
        raise KeyboardInterrupt  # the process stops with half a program written

    monkeypatch.setattr(torch.export, "save", crash_mid_write)
    with pytest.raises(KeyboardInterrupt):
        export_model(run, target, step=2)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # staging removed
    from gem_core.serving.integrity import open_export
    from gem_core.serving.loading import load_program

    manifest = open_export(target)
    assert manifest["checkpoint_step"] == 4
    load_program(target, manifest, "full")
    _ok(_gem("export", "verify", target))
    # A directory that holds something else is not replaced (refused before any work).
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    _one_line_error(_gem("export-model", run, "--out", other), str(other), "holds no export")
    assert (other / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("fault", ["does not load", "scores otherwise"])
def test_a_program_that_runs_in_memory_but_not_from_its_file_is_not_written(
        trained, tmp_path, monkeypatch, fault):
    """The saved file is what serves: an export loads it back and checks it (a torch export of
    an unbind with no outputs ran in memory and failed to load from its file)."""
    import gem_core.serving.export as export
    from gem_core.errors import GemConfigError, GemDataError

    load = export.program_from_bytes

    def faulty(data, path):
        if fault == "does not load":
            raise GemDataError(f"{path}: torch could not load the program (IndexError: list "
                               "index out of range)")
        program = load(data, path)
        return lambda inputs: {k: v + 0.5 for k, v in program(inputs).items()}

    monkeypatch.setattr(export, "program_from_bytes", faulty)
    target = tmp_path / "export"
    expected = ("would be refused by gem score .*could not load the program"
                if fault == "does not load"
                else "'full \\(loaded from its file\\)' disagrees with the run's model")
    with pytest.raises(GemConfigError, match=expected):
        export.export_model(trained[1], target)
    assert not target.exists() and list(tmp_path.iterdir()) == []  # nothing published


def test_a_program_that_refuses_one_candidate_is_not_written(trained, tmp_path, monkeypatch):
    """Outside mixture-of-experts, a capture that specialises a dim to 2 or more (a server's
    single-candidate request would fail its guard) is a bug to fix, not a minimum to ship."""
    import gem_core.serving.export as export
    from gem_core.errors import GemConfigError

    capture = export.capture

    def specialising(program, inputs, specs, minimum=None):
        if minimum and minimum.get("candidates") == 1:  # as torch.export words it
            raise torch._dynamo.exc.UserError(
                torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION,
                "Constraints violated (candidates)! Not all values of candidates = "
                "L['inputs']['candidate.item'].size()[0] in the specified range are valid")
        return capture(program, inputs, specs, minimum)

    monkeypatch.setattr(export, "capture", specialising)
    target = tmp_path / "export"
    with pytest.raises(GemConfigError, match="program 'full' specialises on candidates > 1.*"
                                             "only a mixture-of-experts model"):
        export.export_model(trained[1], target)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename aside"])
def test_an_export_is_published_whole(tmp_path, monkeypatch, exchange):
    """What ``kill -9`` can leave at each moment of a re-export, and what the next export
    makes of it: a killed export's staging directory is removed, an old export a kill left
    set aside (between the two renames where ``renameat2`` is missing) is put back."""
    from gem_core.serving import publish

    if not exchange:
        monkeypatch.setattr(publish, "_exchange", lambda a, b: False)
    target = tmp_path / "export"
    with publish.staged(target) as staging:
        (staging / "manifest.json").write_text("old")
        (staging / PROGRAM).write_text("old program")
    dead = _dead_pid()
    (tmp_path / f".export.staging-{dead}").mkdir()  # a killed export's
    (tmp_path / f".export.staging-{dead}" / PROGRAM).write_text("torn")
    with publish.staged(target) as staging:
        assert not (tmp_path / f".export.staging-{dead}").exists()
        (staging / "manifest.json").write_text("new")
        assert (target / "manifest.json").read_text() == "old"  # until the new one is whole
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json"]
    assert (target / "manifest.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    target.rename(tmp_path / f".export.replaced-{dead}")  # killed between the two renames
    publish.prepare_staging(target)
    assert (target / "manifest.json").read_text() == "new"


def test_a_config_edited_after_training_is_refused(trained, tmp_path):
    from gem_core.trained_run import load_run

    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    config = (run / "config.toml").read_text()
    assert "\nwindow = 64\n" in config
    (run / "config.toml").write_text(config.replace("\nwindow = 64\n", "\nwindow = 4\n"))
    _one_line_error(_gem("export-model", run, "--out", tmp_path / "export"),
                    "config.toml", "model.window", "config.toml has 4, the checkpoint 64")
    assert not (tmp_path / "export").exists()
    # Every reader of a run (export-user-embeddings, distill's teacher) opens it this way.
    with pytest.raises(GemError, match="model.window"):
        load_run(run)
    (run / "config.toml").write_text(config)
    assert load_run(run).config.model.window == 64


def _truncate(export: Path) -> None:
    (export / PROGRAM).write_bytes((export / PROGRAM).read_bytes()[:1000])


DAMAGE = {
    "truncated program": (_truncate, [PROGRAM, "1000 bytes, written as"]),
    "truncated program, manifest rewritten to match": (
        lambda e: (_truncate(e), _record_digest(e)), [PROGRAM, "not a readable .pt2 archive"]),
    "missing program": (lambda e: (e / PROGRAM).unlink(), [PROGRAM, "missing"]),
    "garbage manifest": (lambda e: (e / "manifest.json").write_bytes(b"\x00\xffnot json{"),
                         ["manifest.json", "not valid JSON"]),
    "manifest without programs": (
        lambda e: _rewrite_manifest(e, lambda m: m.update(programs={})),
        ["manifest.json", "lists no programs"]),
    "program file leaving the export": (
        lambda e: _rewrite_manifest(e, lambda m: m["programs"]["full"].update(
            file="../model/full.pt2")),
        ["manifest.json", "'../model/full.pt2' leaves the export directory"]),
    "manifest of an older format": (
        lambda e: _rewrite_manifest(e, lambda m: (m.update(format=1), m.pop("files", None))),
        ["manifest.json", "format 1", "export the run again"]),
    "model of a foreign schema": (
        lambda e: _rewrite_manifest(e, lambda m: m["schema"].update(item_tables=["x"])),
        ["manifest.json", "unknown field(s) item_tables"]),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_or_foreign_exports_are_one_line_errors(trained, export, tmp_path, case):
    damage, named = DAMAGE[case]
    damage(export)
    _one_line_error(_score(export, trained[0], tmp_path / "scored"), *named)
    verified = _gem("export", "verify", export)
    assert verified.exit_code == 1 and "Traceback" not in verified.output


def test_score_refuses_an_empty_eval_split(trained, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(trained[0], data)
    manifest = json.loads((data / "manifest.json").read_text())
    for entry in manifest["splits"].pop("eval")["files"]:
        (data / entry["path"]).unlink()
    (data / "manifest.json").write_text(json.dumps(manifest))
    _one_line_error(_score(trained[2], data, tmp_path / "scored"), str(data), "no eval rows")
    assert not (tmp_path / "scored" / "score.json").exists()
