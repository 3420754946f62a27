"""``gem export-model``: a trained run as ``torch.export`` programs for serving."""

from __future__ import annotations

from pathlib import Path

import click

from gem_core.capabilities import TORCH_EXPORT


@click.command("export-model")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write the programs and manifest.json to (an export already "
                   "there is replaced once the new one is complete).")
@click.option("--step", default=None, type=click.IntRange(min=0),
              help="Checkpoint step to export (default: the best complete checkpoint, by "
                   "evaluation NE; the newest when none has one).")
@click.option("--attention", default=None,
              help=f"Attention backend to export with; it must declare the {TORCH_EXPORT} "
                   "capability (default: the run's, or one that does when the run's cannot "
                   "export).")
@click.option("--aoti", is_flag=True,
              help="Also compile each program with AOTInductor (needs a C++ compiler).")
def export_model(run_dir: Path, out: Path, step: int | None, attention: str | None,
                 aoti: bool) -> None:
    """Export a trained run: the full model (and for multi-stage runs the user tower and the
    ranker on the cached user embedding) as .pt2 programs plus manifest.json, which records the
    size and SHA-256 of every file (check them with gem export verify). The model is built from
    the configuration stored with the checkpoint."""
    from gem_core.serving.export import export_model as export
    from gem_core.trained_run import choose_checkpoint

    choice = choose_checkpoint(run_dir, step)
    click.echo(f"checkpoint step {choice.step}: {choice.reason}")
    manifest = export(run_dir, out, attention=attention, step=choice.step, aoti=aoti)
    chosen = manifest["attention"]
    if chosen["swapped"]:
        click.echo(f"attention: the run used {chosen['run']!r}; exported with "
                   f"{chosen['exported']!r} ({chosen.get('why', 'chosen with --attention')})")
    for name, program in manifest["programs"].items():
        files = program["file"] + (f", {program['aoti_file']}" if "aoti_file" in program else "")
        click.echo(f"{name}: {files} ({len(program['inputs'])} inputs; max |exported - eager| "
                   f"{program['parity_max_abs_diff']:.2g} on a held-out batch)")
    click.echo(f"wrote {out / 'manifest.json'} (checkpoint step {manifest['checkpoint_step']})")
