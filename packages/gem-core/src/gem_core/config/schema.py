"""The run configuration: frozen, keyword-only attrs classes, one per TOML section (the
model's, ``[model]`` and its sections, in :mod:`gem_core.config.model_schema`).

Presets (``gem_core/presets/*.toml``) and ``--set dotted.key=value`` overrides are turned into
these by :func:`gem_core.config.loading.structure`, which names the key of any bad value.
"""

from __future__ import annotations

from typing import Any

import attrs

# Importers of this module (gem_core.embedding, ...) find the model's sections here too.
from gem_core.config.model_schema import ModelConfig
from gem_core.config.validators import at_least, between, choice, each, greater_than, optional

GENERATED_EVAL_ROWS = 8192
"""Requests generated data evaluates when ``data.eval_rows`` is unset."""


@attrs.frozen(kw_only=True)
class DataConfig:
    """Where batches come from."""

    source: str = "synthetic"
    """Registered data source name (``gem plugins`` lists them)."""

    path: str = ""
    """Data set location for file-backed sources; unused by generated data."""

    max_seq_len: int = attrs.field(default=256, validator=greater_than(0))
    """Histories are truncated to their most recent ``max_seq_len`` events. A file-backed data
    set's own cap (its manifest's ``max_seq_len``) replaces this value where ``data_set_wins``
    names it (a preset's value or the default: one the user did not choose); a value the user
    chose applies, cut to the data set's cap when longer. The start-up log says which applied,
    and the run's ``config.toml`` records the value used."""

    eval_rows: int | None = attrs.field(default=None, validator=optional(greater_than(0)))
    """Requests each evaluation scores: the first ``eval_rows`` of the eval split in file order
    (with ``order = "time"``: of each window's progressive evaluation). Unset: the whole eval
    split (or window) of a file-backed data set; generated data, which has no end, generates
    ``GENERATED_EVAL_ROWS`` (8192). A data set without an eval split holds out trailing row
    groups of at least ``eval_rows`` (unset: 8192) requests. The log says how many were
    scored."""

    data_set_wins: tuple[str, ...] = attrs.field(
        default=(), converter=tuple, validator=each(choice("max_seq_len", "eval_rows")))
    """Keys of this section whose values give way to a file-backed data set's own: its
    manifest's ``max_seq_len``, its whole eval split for ``eval_rows``. The loader lists those
    that neither ``--set`` nor the user's config file names (a preset's values describe its
    generated data, which uses them as they are); a run's ``config.toml`` records the values
    the run used, with this list empty."""

    order: str = attrs.field(default="shuffled", validator=choice("shuffled", "time"))
    """``shuffled``: epochs over the training split in a seeded random order, evaluated on the
    eval split. ``time``: one pass over a data set's time windows, oldest first (shuffled only
    inside a window, per ``[data.options]``), evaluating the model on each window before it
    trains on it (progressive evaluation); the run ends when the windows do, and continues
    from its last checkpoint when the data set gains windows. Needs a source with time windows
    (``parquet`` on a data set written with ``gem data import --window`` / ``--append`` or
    ``gem data synth --windows``). See docs/streaming.md."""

    options: dict[str, Any] = attrs.field(factory=dict)
    """Source-specific options, structured into the source's options class (``gem config
    explain data.options`` lists those of the configured source)."""

    @property
    def generated_eval_rows(self) -> int:
        """Requests generated data evaluates (and the least a data set without an eval split
        holds out): ``eval_rows``, or ``GENERATED_EVAL_ROWS`` when unset."""
        return GENERATED_EVAL_ROWS if self.eval_rows is None else self.eval_rows


@attrs.frozen(kw_only=True)
class TrainConfig:
    """The optimisation loop."""

    steps: int = attrs.field(default=300, validator=greater_than(0))
    """Optimizer steps of the run."""

    seed: int = attrs.field(default=0, validator=between(0, 2**32 - 1))
    """Seed of model initialisation and data order (numpy's range: 0 to 2**32 - 1)."""

    batch_size: int = attrs.field(default=256, validator=greater_than(0))
    """Global batch size (samples per optimizer step, summed over ranks)."""

    lr: float = attrs.field(default=3e-3, validator=greater_than(0))
    """Peak learning rate of AdamW (dense) and of the embedding tables."""

    embedding_lr_scale: float = attrs.field(default=1.0, validator=greater_than(0))
    """Multiplier of ``lr`` (and of its schedule) for the embedding tables the dense optimizer
    trains (``nn.Embedding``/``nn.EmbeddingBag`` weights under AdamW). A row appears in few
    batches, so pooled rows learn slowly at a rate the attention layers tolerate (on
    MovieLens-100k ``dlrm-baseline`` learns best at 0.01, ``tiny``'s layers at 0.002;
    docs/results.md). Tables with an optimizer of their own do not take it: the
    ``fbgemm-tbe`` backend's follow ``[model.embedding_optimizer]``, TorchRec's sharded tables
    ``[parallel.embedding]`` ``optimizer`` and ``lr`` (the start-up log says so)."""

    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    """AdamW weight decay on dense matrices (not on embeddings, norms or biases)."""

    warmup_steps: int = attrs.field(default=20, validator=at_least(0))
    """Linear warm-up steps before the schedule (``lr_schedule``) takes over."""

    lr_schedule: str = attrs.field(default="auto", validator=choice("auto", "cosine",
                                                                    "constant"))
    """After warm-up: ``cosine`` decays to 10 % of ``lr`` at ``steps``; ``constant`` keeps
    ``lr``, as a stream that gains windows needs (it has no last step to decay towards).
    ``auto``: ``constant`` with ``data.order = "time"``, else ``cosine``."""

    grad_clip: float = attrs.field(default=1.0, validator=at_least(0))
    """Global gradient-norm clip; 0 disables clipping. It covers every parameter the dense step
    steps but ``model.id_bias``'s offsets, whose step is set per impression."""

    eval_every: int = attrs.field(default=100, validator=at_least(0))
    """Evaluate every N steps (and always at the end); 0: only at the end."""

    checkpoint_every: int = attrs.field(default=100, validator=at_least(0))
    """Checkpoint every N steps (and at the end); 0: only at the end."""

    keep_checkpoints: int = attrs.field(default=2, validator=greater_than(0))
    """Number of most recent checkpoints kept."""

    keep_best: bool = True
    """Also keep the checkpoint with the best evaluation NE (the mean over tasks, at a step that
    both evaluated and checkpointed); the keep-last rotation never deletes it."""

    validation_share: float = attrs.field(default=0.0, validator=between(0.0, 0.9))
    """Share of the eval split held out as a validation part, by a hash of each impression's
    user (of its request where the data names no users): checkpoints are ranked by the
    validation part's NE (the best checkpoint that readers load, ``keep_best``, early stopping,
    the overfitting warning) and every evaluation reports the rest. 0 (the default): no
    validation part; checkpoints are ranked by the NE of the evaluation they report, which
    flatters the headline figure of a run that picks among many checkpoints (epochs). The
    reported part then holds ``1 - share`` of the users, so its figures are not those of the
    whole split. Not with ``data.order = "time"`` (no checkpoint is ranked there)."""

    epochs: int = attrs.field(default=1, validator=at_least(0))
    """Passes over a file-backed data set's train split: the run stops at the end of that many
    (or at ``steps``, whichever comes first). The default is one pass, as production CTR
    training runs (a second pass over the same impressions tends to overfit); 0: ``steps``
    alone decides. Generated data (no passes) ignores it; ``data.order = "time"`` is one pass
    by construction and refuses more than 1."""

    tables_each_pass: str = attrs.field(default="keep", validator=choice("keep", "reinitialize"))
    """What the feature tables (the embeddings of ``[[tables]]``) start each pass after the first
    with: ``keep``, what the last pass left; ``reinitialize``, fresh initial values and no
    optimizer state, while the dense layers carry on (MEDA, Fan et al. 2024: the one-epoch
    overfitting of CTR models lives in the id embeddings, which memorise the impressions they
    saw, while the layers above learn relations between embeddings that a new draw keeps).
    Needs data with passes (a file-backed source, ``train.epochs`` > 1 or 0) and tables that
    are parameters of the model under the trainer's optimizer: one process, ``ddp``, or the
    row shards of ``fsdp2`` and ``hsdp`` (a row draws the same values on any layout and world
    size); not an embedding backend with its fused optimizer, TorchRec's sharded tables or
    DeepSpeed, which are refused at start-up."""

    early_stopping_patience: int = attrs.field(default=0, validator=at_least(0))
    """Stop (checkpointed, exit 0) once the evaluation NE (as for ``keep_best``) has not improved
    for this many evaluations; 0: off."""

    overfit_warn_evals: int = attrs.field(default=2, validator=at_least(0))
    """Warn when the evaluation NE has risen for this many evaluations in a row; 0: never."""

    async_checkpoint: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``):
    training blocks only while tensors are copied to CPU memory; the checkpoint is published
    once every rank's write has finished. Engines with a full-state format (DeepSpeed) always
    save synchronously."""

    stop_grace_s: float = attrs.field(default=25.0, validator=at_least(0))
    """Seconds a run stopped by SIGTERM or SIGINT has to save the step it stops at, then it ends
    without; 0: end at once."""

    log_every: int = attrs.field(default=1, validator=greater_than(0))
    """Write a ``metrics.jsonl`` line every N steps."""

    log_every_s: float = attrs.field(default=10.0, validator=at_least(0))
    """When stderr is not a terminal (a file, a pipe, a scheduler), or with ``--no-progress``:
    log a line with step, loss, samples/s, MFU and ETA every this many seconds of wall time,
    in place of the progress bar; 0: no such lines."""

    tensorboard: str = attrs.field(default="auto", validator=choice("auto", "on", "off"))
    """TensorBoard event files in ``<run dir>/tensorboard/`` (the scalars of metrics.jsonl and
    eval.jsonl). ``auto``: written when ``torch.utils.tensorboard`` imports (the ``tensorboard``
    package: ``pip install 'gem-core[tensorboard]'``), otherwise one log line at start-up says
    they are not and why; ``on``: the run stops at start-up if it cannot import; ``off``: none
    are written."""

    eval_batch_size: int = attrs.field(default=1024, validator=greater_than(0))
    """Batch size of evaluation passes."""

    device: str = attrs.field(default="auto", validator=choice("auto", "cpu", "cuda"))
    """Device type; ``auto`` picks cuda when available."""

    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower; exact resume tests need it)."""

    skip_nonfinite: bool = True
    """Skip the optimizer step (on every rank) when the loss or gradient norm is NaN or Inf."""

    spike_factor: float = attrs.field(default=0.0, validator=at_least(0))
    """Skip a step whose loss exceeds this multiple of the recent mean loss; 0 disables."""

    spike_window: int = attrs.field(default=50, validator=greater_than(0))
    """Good steps whose mean loss a spike is judged against."""

    max_bad_steps: int = attrs.field(default=3, validator=at_least(0))
    """After this many consecutive skipped steps, roll back to the latest checkpoint and go on
    with the next batches (the ones that caused it are not seen again); 0 never rolls back."""

    max_rollbacks: int = attrs.field(default=3, validator=at_least(0))
    """Rollbacks allowed in a row without progress (the run getting past the steps where the
    previous rollback's bad steps ended); the next one stops the run with the steps and causes
    of each. A persistent fault (a learning rate that always diverges, data that is NaN from
    some step on) would otherwise roll back forever. 0: stop instead of rolling back."""

    compile: bool = False
    """Compile the model with ``torch.compile`` (inductor; C++ on CPU, Triton on CUDA): each
    parallel unit (the sequence-tower blocks) whole, with no graph break, forward and backward
    (AOTAutograd), token and batch dimensions dynamic so jagged batches do not recompile. Needs
    an attention backend that declares ``torch_compile`` (``gem plugins`` shows which do;
    ``auto`` picks one). The first step pays the compilation (``compile_s`` in metrics.jsonl,
    ``compile`` in summary.json); inductor's cache (``compile_cache``) makes later runs'
    compiles faster."""

    compile_mode: str = attrs.field(default="default",
                                    validator=choice("default", "reduce-overhead",
                                                     "max-autotune"))
    """``torch.compile`` mode with ``compile``: ``default``; ``reduce-overhead`` (CUDA graphs
    over the compiled units: CUDA only, refused on CPU); ``max-autotune`` (inductor benchmarks
    GEMM and kernel choices while compiling: a much slower first step)."""

    compile_cache: str = ""
    """Directory of inductor's persistent cache (``TORCHINDUCTOR_CACHE_DIR``) with ``compile``;
    empty: ``$TORCHINDUCTOR_CACHE_DIR`` when set (a cache shared by runs), else
    ``<run dir>/inductor-cache``."""


@attrs.frozen(kw_only=True)
class BackendsConfig:
    """Implementation chosen for each pluggable part, by registered name or ``auto``: one field
    per kind of :data:`gem_core.kinds.KIND_TABLE` whose config key is ``backends.<field>`` (a test
    checks both agree)."""

    model: str = "gem"
    """The model (``--model``): a registered name (gem-core's is ``gem``); no ``auto``."""

    attention: str = "auto"
    """Jagged attention backend (``--attention``)."""

    embedding: str = "auto"
    """Embedding lookup backend (``--embedding``)."""

    norm: str = "auto"
    """Gated-norm backend of the attention gate (``--norm``; used when
    ``model.attention_gate``)."""

    dense_sharding: str = "auto"
    """Dense-parameter parallelism (``--sharding``)."""

    embedding_sharding: str = "auto"
    """Embedding-table sharding (``--embedding-sharding``)."""

    precision: str = "auto"
    """Precision recipe (``--precision``)."""

    activation_checkpointing: str = "auto"
    """Activation-checkpointing policy (``--activation-checkpointing``)."""

    balancer: str = "auto"
    """Batch balancer across data-parallel ranks."""


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """Options of the chosen parallelism implementations, each table structured into the
    options class its implementation declares (``gem config explain parallel.dense`` lists
    those of the configured one)."""

    dense: dict[str, Any] = attrs.field(factory=dict)
    """Options of the dense sharding strategy (e.g. HSDP mesh sizes)."""

    embedding: dict[str, Any] = attrs.field(factory=dict)
    """Options of the embedding sharding strategy (e.g. a forced plan per table)."""

    activation_checkpointing: dict[str, Any] = attrs.field(factory=dict)
    """Options of the activation-checkpointing policy (e.g. which module kinds)."""


@attrs.frozen(kw_only=True)
class PrecisionConfig:
    """Options of the chosen precision recipe (``backends.precision``)."""

    options: dict[str, Any] = attrs.field(factory=dict)
    """Recipe options (e.g. FP8 exclude list, selection threshold), structured by gem-core into
    the options class the recipe declares; a recipe that declares none refuses any (``gem config
    explain precision.options`` lists the configured recipe's)."""


@attrs.frozen(kw_only=True)
class AdapterConfig:
    """The Student Adapter of ``[distill]``: a small learned correction of the teacher's logits
    (from its logits and, optionally, its user embedding), fitted on recent labelled data before
    the student trains, so the soft labels track the present rather than the teacher's older
    training window."""

    enabled: bool = False
    """Distil from the adapted teacher logits instead of the raw ones."""

    fit_batches: int = attrs.field(default=20, validator=greater_than(0))
    """Training batches the adapter is fitted on: the first of the student's own (recent,
    labelled) training stream, read whole on every rank so every rank fits the same adapter."""

    epochs: int = attrs.field(default=5, validator=greater_than(0))
    """Passes over those batches (one Adam step per batch)."""

    lr: float = attrs.field(default=0.02, validator=greater_than(0))
    """Adam learning rate of the fit."""

    use_embedding: bool = False
    """Also feed the teacher's user embedding to the adapter (a linear term per task); needs a
    teacher with a user embedding (PMA)."""

    refit: str = attrs.field(default="once", validator=choice("once", "each_window"))
    """``once``: fitted before the student trains (with ``data.order = "time"``: on its first
    window's first ``fit_batches`` batches), then kept. ``each_window`` (needs ``data.order =
    "time"``): before the student trains on window T >= 1 the adapter is fitted anew, from the
    identity, on window T - 1, the most recent labelled data the student has seen: its first
    ``fit_batches`` batches of ``train.batch_size`` requests in file order (at most
    ``data.eval_rows`` requests, the ones progressive evaluation scored). Checkpoints keep the
    adapter, so a resumed run continues with the same one."""


@attrs.frozen(kw_only=True)
class DistillConfig:
    """Knowledge distillation from a trained teacher run (``gem distill``); off while
    ``teacher`` is empty. Every weight below is logged per step and kept in ``summary.json``."""

    teacher: str = ""
    """The teacher's run directory (a complete checkpoint is required); empty: no
    distillation."""

    teacher_step: int = attrs.field(default=0, validator=at_least(0))
    """The teacher's checkpoint step; 0: its best checkpoint (by evaluation NE)."""

    signals: str = attrs.field(default="online", validator=choice("online", "precomputed"))
    """``online``: every rank runs the teacher on its own share of each batch; ``precomputed``:
    the data set carries the teacher's columns (``gem distill-precompute``)."""

    temperature: float = attrs.field(default=1.0, validator=greater_than(0))
    """Soft labels are ``sigmoid(teacher_logit / T)`` and the student's logit is divided by T
    too; the soft loss is multiplied by ``T**2`` so its gradient scale does not depend on T."""

    soft_weight: float = attrs.field(default=1.0, validator=at_least(0))
    """Weight of the soft-label (teacher) loss of every task without its own entry in
    ``task_soft_weights``."""

    task_soft_weights: dict[str, float] = attrs.field(factory=dict)
    """Per task, a soft-label weight overriding ``soft_weight`` (tasks are checked against the
    data's at start-up)."""

    hard_weight: float = attrs.field(default=1.0, validator=at_least(0))
    """Weight of the ordinary loss on the data's labels."""

    embedding_feature: bool = False
    """Give the student the teacher's user embedding as one extra interaction token
    (representation transfer; sets ``model.teacher_embedding_dim``)."""

    embedding_match_weight: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of the MSE between a learned projection of the student's user embedding and the
    teacher's (sets ``model.teacher_match_dim``; needs a student with PMA). 0: off."""

    adapter: AdapterConfig = attrs.field(factory=AdapterConfig)
    """The Student Adapter on the teacher's outputs."""

    def __attrs_post_init__(self) -> None:
        for task, weight in self.task_soft_weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                raise ValueError(f"task_soft_weights.{task} must be a number >= 0, got "
                                 f"{weight!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)


@attrs.frozen(kw_only=True)
class GemConfig:
    """A whole run."""

    name: str = "custom"
    """Preset name, or a label of the user's choosing."""

    model: ModelConfig = attrs.field(factory=ModelConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    backends: BackendsConfig = attrs.field(factory=BackendsConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    precision: PrecisionConfig = attrs.field(factory=PrecisionConfig)
    distill: DistillConfig = attrs.field(factory=DistillConfig)
    """Knowledge distillation from a teacher run (off by default; see ``gem distill``)."""
