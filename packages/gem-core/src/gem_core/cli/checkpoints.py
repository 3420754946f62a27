"""``gem checkpoints verify``: check a run's checkpoints offline, as a resume would."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click


def inspect_checkpoints(run_dir: Path) -> dict[str, Any]:
    """Every checkpoint directory of ``run_dir`` with its status: ``ok`` (every file matches
    its digest), ``damaged`` (with the problems), ``older format`` (a pickled ``trainer.pt``,
    which this version refuses), and the staging directories an interrupted save left
    (``finished, not published`` or ``torn``), which the next run publishes or removes."""
    from gem_core.checkpoint.digests import unrecorded_files, verify_files
    from gem_core.checkpoint.layout import (
        COMPLETE,
        LEGACY_TRAINER_FILE,
        TEMPORARY_PREFIX,
        TRAINER_FILE,
        checkpoint_dir,
        complete_checkpoints,
    )

    entries = []
    for step, path in complete_checkpoints(run_dir):
        started = time.perf_counter()
        size, unrecorded = 0, []
        try:
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            if (path / LEGACY_TRAINER_FILE).exists() and not (path / TRAINER_FILE).exists():
                status = "older format"
                problems = [f"{LEGACY_TRAINER_FILE}: a pickle, not loaded"]
            else:
                problems = verify_files(path)
                status = "damaged" if problems else "ok"
            unrecorded = unrecorded_files(path)
        except OSError as error:  # a file that cannot be read (I/O error, permissions)
            where = Path(error.filename).relative_to(path) if error.filename and Path(
                error.filename).is_relative_to(path) else path
            status, problems = "damaged", [f"{where}: unreadable ({error.strerror or error})"]
        entries.append({"step": step, "path": str(path), "status": status,
                        "problems": problems, "unrecorded_files": unrecorded,
                        "bytes": size, "seconds": time.perf_counter() - started})
    root = checkpoint_dir(run_dir)
    staging = [{"path": str(p), "status": ("finished, not published" if (p / COMPLETE).is_file()
                                           else "torn")}
               for p in sorted(root.iterdir()) if p.name.startswith(TEMPORARY_PREFIX)
               ] if root.is_dir() else []
    usable = [e["step"] for e in entries if e["status"] == "ok"]
    return {"run_dir": str(run_dir), "checkpoints": entries, "staging": staging,
            "newest_verified": usable[-1] if usable else None,
            "ok": bool(entries) and len(usable) == len(entries)}


@click.group("checkpoints")
def checkpoints() -> None:
    """Work with a run's checkpoints."""


@checkpoints.command("verify")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def verify(run_dir: str, as_json: bool) -> None:
    """Check every checkpoint of RUN_DIR against the digests written with it, as a resume
    does. Exit code 0 when every complete checkpoint verifies, 1 when one is damaged or of the
    older format, or when there is none."""
    report = inspect_checkpoints(Path(run_dir))
    if as_json:
        click.echo(json.dumps(report))
    else:
        for entry in report["checkpoints"]:
            mb_per_s = entry["bytes"] / 1e6 / max(entry["seconds"], 1e-9)
            click.echo(f"{Path(entry['path']).name}  {entry['status']}  "
                       f"({entry['bytes'] / 1e6:.1f} MB, {entry['seconds']:.2f} s, "
                       f"{mb_per_s:.0f} MB/s)")
            for problem in entry["problems"]:
                click.echo(f"    {problem}")
            for name in entry["unrecorded_files"]:
                click.echo(f"    {name}: not part of the checkpoint as written (never read)")
        for entry in report["staging"]:
            click.echo(f"{Path(entry['path']).name}  {entry['status']} (the next run "
                       f"{'publishes' if entry['status'] != 'torn' else 'removes'} it)")
        if not report["checkpoints"]:
            click.echo(f"{run_dir} has no complete checkpoint")
        elif report["newest_verified"] is None:
            click.echo("no checkpoint verifies: a resume would stop (start over with --fresh "
                       "or another --out)")
        else:
            click.echo(f"a resume would load step {report['newest_verified']}")
    if not report["ok"]:
        raise SystemExit(1)
