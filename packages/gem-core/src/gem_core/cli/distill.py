"""``gem distill``: train a student run from a teacher run (knowledge distillation).

The same command as ``gem train`` (every option of it, the same trainer, checkpoints, resume
and ``--nproc-per-node``) with the ``[distill]`` section switched on: ``--teacher RUN_DIR`` is
``--set distill.teacher=RUN_DIR`` and the other options below are shortcuts for ``distill.*``
keys. The student is any preset (``tiny``, ``dlrm-baseline``, a smaller GEM) on the teacher's
data or on another data set with the same features.
"""

from __future__ import annotations

from pathlib import Path

import click

from gem_core.cli.train import train as train_command

# Command-line options of gem distill and the [distill] keys they set.
DISTILL_SHORTCUTS = {
    "signals": "distill.signals",
    "temperature": "distill.temperature",
    "soft_weight": "distill.soft_weight",
    "hard_weight": "distill.hard_weight",
    "embedding_match_weight": "distill.embedding_match_weight",
    "teacher_step": "distill.teacher_step",
}


def _distill(teacher: Path, teacher_step, signals, temperature, soft_weight, hard_weight,
             embedding_feature, embedding_match_weight, adapter, **train_options) -> None:
    """Train a student from a teacher run: soft labels (and optionally the teacher's user
    embedding) on top of the data's labels. Every `gem train` option applies."""
    values = {"signals": signals, "temperature": temperature, "soft_weight": soft_weight,
              "hard_weight": hard_weight, "embedding_match_weight": embedding_match_weight,
              "teacher_step": teacher_step}
    overrides = [f"distill.teacher={teacher.resolve()}"]
    overrides += [f"{DISTILL_SHORTCUTS[k]}={v}" for k, v in values.items() if v is not None]
    if embedding_feature:
        overrides.append("distill.embedding_feature=true")
    if adapter:
        overrides.append("distill.adapter.enabled=true")
    # User --set values come last, so they win over the shortcuts.
    train_options["overrides"] = tuple(overrides) + tuple(train_options["overrides"])
    click.get_current_context().invoke(train_command, **train_options)


distill = click.Command(
    name="distill",
    callback=_distill,
    help=_distill.__doc__,
    params=[
        click.Option(["--teacher"], required=True,
                     type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="The teacher's run directory (needs a complete checkpoint)."),
        click.Option(["--teacher-step"], type=click.IntRange(min=1), default=None,
                     help="The teacher's checkpoint step (default: its best checkpoint, by "
                          "evaluation NE)."),
        click.Option(["--signals"], type=click.Choice(["online", "precomputed"]), default=None,
                     help="Teacher signals computed in this process (online, default) or read "
                          "from a data set written by gem distill-precompute."),
        click.Option(["--temperature"], type=click.FloatRange(min=0, min_open=True),
                     default=None, help="Soft-label temperature (default 1)."),
        click.Option(["--soft-weight"], type=click.FloatRange(min=0), default=None,
                     help="Weight of the soft-label loss (default 1; per task: --set "
                          "distill.task_soft_weights.TASK=W)."),
        click.Option(["--hard-weight"], type=click.FloatRange(min=0), default=None,
                     help="Weight of the loss on the data's labels (default 1)."),
        click.Option(["--embedding-feature"], is_flag=True,
                     help="Feed the teacher's user embedding to the student as one token."),
        click.Option(["--embedding-match-weight"], type=click.FloatRange(min=0), default=None,
                     help="Weight of the student/teacher user-embedding MSE (student needs "
                          "PMA)."),
        click.Option(["--adapter"], is_flag=True,
                     help="Fit the Student Adapter on recent labelled data and distil from "
                          "the adapted teacher logits ([distill.adapter] settings)."),
        *train_command.params,
    ],
)
