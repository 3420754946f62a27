"""``gem export verify``: check an export directory offline, as ``gem score`` does before it
loads a program."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


def inspect_export(directory: Path) -> dict[str, Any]:
    """Every file the export's manifest records with its status (``ok``, or the problem:
    missing, another size, another digest, code in a program), the files it does not record,
    and the manifest's own problem (missing, not JSON, no programs, ...) if it has one."""
    from gem_core.errors import GemDataError
    from gem_core.serving.archive import inspect_program
    from gem_core.serving.integrity import (
        PROGRAM_FILES,
        file_problem,
        read_manifest,
        unrecorded_files,
    )

    report: dict[str, Any] = {"directory": str(directory), "manifest": None, "files": [],
                              "unrecorded_files": [], "checkpoint_step": None, "ok": False}
    try:
        manifest = read_manifest(directory)
    except GemDataError as error:
        report["manifest"] = str(error)
        return report
    native = {entry.get("aoti_file") for entry in manifest["programs"].values()}
    programs = {entry.get(key) for entry in manifest["programs"].values() for key in PROGRAM_FILES}
    for name, record in sorted(manifest["files"].items()):
        problem = file_problem(directory, name, record)
        if problem is None and name in programs:
            try:
                inspect_program((directory / name).read_bytes(), name, native=name in native)
            except GemDataError as error:
                problem = str(error)
        report["files"].append({"name": name, "bytes": record["bytes"],
                                "status": "ok" if problem is None else "damaged",
                                "problem": problem})
    report["unrecorded_files"] = unrecorded_files(directory, manifest)
    report["checkpoint_step"] = manifest["checkpoint_step"]
    report["ok"] = all(f["status"] == "ok" for f in report["files"])
    return report


@click.group("export")
def export() -> None:
    """Work with export directories (written by gem export-model)."""


@export.command("verify")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify(export_dir: Path, as_json: bool) -> None:
    """Check every file of EXPORT_DIR (written by gem export-model) against the size and
    SHA-256 its manifest.json records, and every program for code (pickles, Python in its
    graph), as gem score does before loading. Exit code 0 when the export is intact, 1 when a
    file is missing, damaged or refused, or the manifest is."""
    report = inspect_export(export_dir)
    if as_json:
        click.echo(json.dumps(report))
    elif report["manifest"] is not None:
        click.echo(report["manifest"])
    else:
        for entry in report["files"]:
            click.echo(f"{entry['name']}  {entry['status']}  ({entry['bytes'] / 1e6:.1f} MB)")
            if entry["problem"]:
                click.echo(f"    {entry['problem']}")
        for name in report["unrecorded_files"]:
            click.echo(f"{name}: not part of the export as written (never read)")
        damaged = [f["name"] for f in report["files"] if f["status"] != "ok"]
        click.echo(f"{export_dir}: " + (
            f"OK ({len(report['files'])} file{'s' if len(report['files']) != 1 else ''}, "
            f"checkpoint step {report['checkpoint_step']})"
            if report["ok"] else f"damaged ({', '.join(damaged)}): export the run again"))
    if not report["ok"]:
        raise SystemExit(1)
