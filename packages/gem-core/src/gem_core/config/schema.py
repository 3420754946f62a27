"""The run configuration: frozen, keyword-only attrs classes, one per TOML section.

Presets (``gem_core/presets/*.toml``) and ``--set dotted.key=value`` overrides are turned into
these by :func:`gem_core.config.loading.structure`, which names the key of any bad value.
"""

from __future__ import annotations

from typing import Any

import attrs

from gem_core.config.validators import at_least, between, choice, each, greater_than


@attrs.frozen(kw_only=True)
class EmbeddingOptimizerConfig:
    """``[model.embedding_optimizer]``: the optimizer of embedding tables that their backend
    trains itself, inside the backward (backends declaring the ``fused_optimizer`` capability,
    :data:`gem_core.embedding.FUSED_OPTIMIZER`: ``fbgemm-tbe``). Those tables are not parameters
    of the dense AdamW optimizer. With any other embedding backend the tables train with AdamW at
    ``train.lr``, and a run that changes this section is refused at start-up."""

    name: str = attrs.field(default="rowwise_adagrad", validator=choice("rowwise_adagrad", "sgd"))
    """``rowwise_adagrad`` (one sum of squared gradients per row, the usual choice for sparse
    tables) or ``sgd``; FBGEMM's CPU kernels have no Adam."""

    lr: float = attrs.field(default=0.02, validator=greater_than(0))
    """Learning rate (the peak, with ``lr_schedule = "dense"``)."""

    lr_schedule: str = attrs.field(default="constant", validator=choice("constant", "dense"))
    """``constant``: ``lr`` at every step; ``dense``: ``lr`` times the run's warm-up and decay
    factor (the dense learning rate at the step divided by ``train.lr``)."""

    eps: float = attrs.field(default=1e-8, validator=greater_than(0))
    """Row-wise Adagrad's epsilon: ``w -= lr * g / (sqrt(sum of mean squared g) + eps)``."""

    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight decay of the rows a step looks up (row-wise Adagrad only; SGD has none)."""

    weight_decay_mode: str = attrs.field(default="l2", validator=choice("l2", "decoupled"))
    """``l2``: ``weight_decay * w`` is added to the gradient before the Adagrad sums;
    ``decoupled``: ``w -= lr * weight_decay * w`` beside the Adagrad step."""

    def __attrs_post_init__(self) -> None:
        if self.name == "sgd" and self.weight_decay:
            raise ValueError("model.embedding_optimizer: weight_decay needs name = "
                             "'rowwise_adagrad' (FBGEMM's fused SGD has no weight decay)")


@attrs.frozen(kw_only=True)
class MoeConfig:
    """Mixture of experts in place of the dense model's MLPs (``[model.moe]``); off while
    ``num_experts`` is 0."""

    num_experts: int = attrs.field(default=0, validator=at_least(0))
    """Routed experts per MoE layer, each the size of the MLP it replaces; 0: no MoE."""

    top_k: int = attrs.field(default=2, validator=greater_than(0))
    """Experts each token (sequence layers) or sample (Wukong layers) is routed to."""

    capacity_factor: float = attrs.field(default=1.25, validator=at_least(0))
    """An expert takes at most ``ceil(capacity_factor * rows * top_k / num_experts)``
    assignments per forward; the rest are dropped (first choices before second choices, earlier
    rows first) and their rows keep only the residual and the shared expert. 0: no limit."""

    shared_expert: bool = False
    """Add one always-on expert of the same size that every row goes through."""

    aux_loss_weight: float = attrs.field(default=0.01, validator=at_least(0))
    """Weight of the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` per layer,
    added to the training loss."""

    where: tuple[str, ...] = attrs.field(default=("sequence",), converter=tuple,
                                         validator=each(choice("sequence", "wukong")))
    """MLPs that become MoE: ``sequence`` (the SwiGLU of every sequence layer) and/or
    ``wukong`` (the MLP of every Wukong factorization-machine block)."""

    impl: str = attrs.field(default="grouped", validator=choice("reference", "grouped"))
    """``reference``: experts run one after another over their tokens; ``grouped``: tokens
    sorted by expert and all expert matmuls batched (torch._grouped_mm where it runs)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def __attrs_post_init__(self) -> None:
        if self.enabled and self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts "
                             f"({self.num_experts})")
        if self.enabled and not self.where:
            raise ValueError("where must name at least one of sequence, wukong")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Sizes and switches of the GEM model. Nothing in the model is hard-wired to one size."""

    embedding_dim: int = attrs.field(default=32, validator=greater_than(0))
    """Width of every token: embeddings, attention and interaction inputs."""

    num_heads: int = attrs.field(default=2, validator=greater_than(0))
    """Attention heads; ``embedding_dim`` must be divisible by it."""

    num_layers: int = attrs.field(default=2, validator=at_least(0))
    """Jagged self-attention layers of the sequence tower."""

    normalization: str = attrs.field(default="softmax", validator=choice("softmax", "silu"))
    """Attention normalisation of the sequence layers: softmax, or HSTU-style pointwise SiLU."""

    window: int = attrs.field(default=0, validator=at_least(0))
    """Local attention window of the sequence layers (earlier events a token sees); 0: unlimited."""

    mlp_ratio: float = attrs.field(default=2.0, validator=greater_than(0))
    """Hidden width of the sequence layers' SwiGLU MLP, as a multiple of ``embedding_dim``."""

    time_buckets: int = attrs.field(default=24, validator=greater_than(1))
    """Log-spaced buckets of the age of an event relative to the request."""

    position_buckets: int = attrs.field(default=32, validator=at_least(0))
    """Each event token carries an embedding of its position from the end of the history (0 for
    the most recent event), one bucket per position up to ``position_buckets - 1``, later
    positions sharing the last bucket; 0 leaves positions out (age buckets only). Ages alone
    cannot single out "the last few events" when events are bursty."""

    relative_bias: bool = False
    """HSTU-style relative attention bias in every self-attention layer: a learned bias per head
    by relative position and by time-difference bucket, added to the attention scores (the
    attention backend must declare the ``relative_bias`` capability)."""

    interaction_dims: tuple[int, ...] = attrs.field(
        default=(128, 64), converter=tuple, validator=each(greater_than(0))
    )
    """Hidden widths of the feature-interaction MLP above the towers."""

    dropout: float = attrs.field(default=0.0, validator=between(0.0, 0.9))
    """Dropout on the interaction MLP during training."""

    attention_gate: bool = False
    """HSTU-style gating in every self-attention layer: the attention output is normalised
    (LayerNorm) and multiplied by ``silu(u)``, ``u`` a fourth projection of the layer's input,
    before the output projection (the gated norm runs on the ``norm`` backend)."""

    history_mean: bool = True
    """Feed the mean of the tower's history outputs to the interaction as one token."""

    pma_queries: int = attrs.field(default=0, validator=at_least(0))
    """K learned queries of pooled multi-head attention (PMA) over the tower's output: each
    history is compressed into K candidate-independent user tokens (the user embedding), fed to
    the interaction and to target-aware attention as keys. 0: no PMA."""

    cross_attention: bool = False
    """After every sequence layer, history tokens attend to the sample's non-sequence user and
    context tokens (long query, short K/V). Candidate features stay out, so the tower's output
    remains candidate-independent."""

    target_attention: bool = True
    """Target-aware attention: the candidate (see ``target_queries``) queries the user tokens
    and the history. Off: no candidate-to-history path (the model sees only pooled history)."""

    target_queries: str = attrs.field(default="candidate", validator=choice("candidate", "all"))
    """``candidate``: only the candidate token queries; ``all``: the candidate and every
    non-sequence token query, each non-candidate result added to its query token."""

    target_history: int = attrs.field(default=0, validator=at_least(0))
    """Most recent history tokens that target-aware attention sees besides the PMA user tokens;
    0: the whole history."""

    target_normalization: str = attrs.field(default="softmax",
                                            validator=choice("softmax", "silu"))
    """Weights of target-aware attention: ``softmax`` (summing to one per candidate) or
    HSTU-style pointwise ``silu`` (the attention backend must support silu)."""

    attribute_attention: bool = False
    """A learned, unnormalised activation unit (DIN-style) scoring every recent event against
    the candidate attribute by attribute (``gem_core.model.attribute_attention``); the weighted
    sum of the events' tokens is one more interaction token."""

    attribute_attention_history: int = attrs.field(default=64, validator=at_least(0))
    """Most recent history events that attribute attention scores per candidate; 0: the whole
    history (cost grows with candidates x events)."""

    attribute_attention_hidden: int = attrs.field(default=16, validator=greater_than(0))
    """Hidden width of attribute attention's scoring MLP."""

    attribute_attention_order: int = attrs.field(default=0, validator=at_least(0))
    """Order context of attribute attention: this many learned gates per scored event, whose
    sums over the more recent and the older scored events each event's score also reads, so
    the order of two kinds of events can count ("engaged the category after the advertiser's
    last view"); 0: off (a sum of per-event scores, blind to order)."""

    attribute_attention_retrieve: int = attrs.field(default=0, validator=at_least(0))
    """Long histories (SIM-style hard search): besides its recent window, attribute attention
    scores up to this many older events per candidate, the most recent of those that share an
    attribute's raw id with it (any common id for multi-valued attributes), searched in the
    whole history; 0: the recent window only."""

    attribute_attention_retrieve_engaged: bool = False
    """The search of ``attribute_attention_retrieve`` keeps engaged events only (those whose
    ``action_feature`` id is not ``view_action``)."""

    target_match: int = attrs.field(default=0, validator=at_least(0))
    """Each candidate also gets a token from its exact attribute matches among the most recent
    ``target_match`` events of its history (ad id, advertiser, category, genres: every
    candidate and event feature sharing a table, single- or multi-valued): a learned projection
    of the matching events summed (weighted by ``target_match_overlap``), so "clicked this
    advertiser two events ago" is visible without learning to find it. 0: off."""

    target_match_overlap: str = attrs.field(default="count", validator=choice("count", "any"))
    """How much an event matches a candidate on a shared attribute where either side is
    multi-valued (genres, topics): ``count``, the number of distinct candidate ids among the
    event's ids; ``any``, 1 if they share one id at all. Single-valued pairs weigh 0 or 1
    either way."""

    action_feature: str = ""
    """The event feature holding each event's action type (``action``, ``btag``): a
    single-valued event feature of the schema, read by ``target_match_action_window`` and
    ``attribute_attention_retrieve_engaged`` to tell engaged events from views. Empty: none."""

    target_match_action_window: int = attrs.field(default=0, validator=at_least(0))
    """A second, longer target-match window by count (256, ...) in which only engaged events
    are matched: those whose ``action_feature`` id is not
    ``view_action``, so a purchase 200 page views ago is still found. Its matches
    have a value projection of their own and add to the target-match token, so the model tells
    a recent match of any action from an older engaged one. 0: off; needs
    ``action_feature``."""

    view_action: int = 0
    """The action id (raw, of ``action_feature``) of the most common, least engaged action,
    "view": the engaged-only windows and searches skip these events."""

    target_match_max_age_s: float = attrs.field(default=0.0, validator=at_least(0))
    """Target match (both windows) sees only events younger than this many seconds (the
    request's timestamp minus the event's). 0: no age limit."""

    downstream_history: str = attrs.field(default="tower", validator=choice("tower", "events"))
    """What target-aware attention and the history mean read besides the user tokens:
    ``tower``, the sequence tower's outputs (one model, one stage); ``events``, the raw event
    tokens (embeddings of item, action and time), so the upstream tower reaches the ranker only
    through its user embedding (the PMA tokens) and that embedding can be exported and cached
    (multi-stage training, see ``user_embeddings``)."""

    user_embeddings: str = attrs.field(default="live", validator=choice("live", "cached"))
    """``live``: the upstream tower runs inside the model. ``cached``: the model is the
    downstream ranker alone (no tower, no PMA) and reads each sample's user embedding from the
    data (a data set written by ``gem export-user-embeddings``)."""

    interaction: str = attrs.field(default="dot", validator=choice("dot", "wukong"))
    """Feature interaction over the non-sequence tokens: DLRM ``dot`` products + MLP, or a stack
    of ``wukong`` layers (optimised factorization-machine block + linear compress block)."""

    wukong_layers: int = attrs.field(default=2, validator=greater_than(0))
    """Depth of the Wukong stack."""

    wukong_fm_rank: int = attrs.field(default=8, validator=greater_than(0))
    """Rank k of the optimised FM: ``X (X^T Y)`` with a learned ``(n, k)`` Y instead of the full
    ``n x n`` Gram matrix."""

    wukong_fmb_tokens: int = attrs.field(default=8, validator=greater_than(0))
    """Tokens a factorization-machine block emits per layer (n_F)."""

    wukong_lcb_tokens: int = attrs.field(default=8, validator=greater_than(0))
    """Tokens a linear compress block emits per layer (n_L); a layer is n_F + n_L tokens wide."""

    wukong_mlp_dim: int = attrs.field(default=256, validator=greater_than(0))
    """Hidden width of the MLP inside each factorization-machine block."""

    multitask: str = attrs.field(default="independent",
                                 validator=choice("independent", "esmm", "auto"))
    """``independent``: one logit head per task. ``esmm``: entire-space conversion,
    p(conversion) = p(click) * p(conversion | click), for the tasks named by ``esmm_tasks``.
    ``auto``: ``esmm`` when the data has both ``esmm_tasks``, ``independent`` otherwise (a
    single-task log), logged at start-up."""

    esmm_tasks: tuple[str, ...] = attrs.field(default=("click", "conversion"), converter=tuple)
    """With ``multitask = "esmm"``: the data set's task names of the click-like parent and the
    conversion-like child (``["click", "purchase"]``, ...); the child head is read as p(child |
    parent) and the model returns p(parent) * p(child | parent)."""

    moe: MoeConfig = attrs.field(factory=MoeConfig)
    """Mixture of experts in place of the sequence and/or Wukong MLPs (off by default)."""

    embedding_optimizer: EmbeddingOptimizerConfig = attrs.field(
        factory=EmbeddingOptimizerConfig)
    """The fused optimizer of embedding backends that train their tables themselves
    (``fbgemm-tbe``); must stay at its defaults with the others."""

    teacher_embedding_dim: int = attrs.field(default=0, validator=at_least(0))
    """Width of a distillation teacher's user embedding (``JaggedBatch.teacher_embedding``)
    that a learned projection turns into one extra interaction token; the model keeps its own
    upstream, if it has one. 0: off. ``gem distill`` sets it from the teacher when
    ``distill.embedding_feature``."""

    teacher_match_dim: int = attrs.field(default=0, validator=at_least(0))
    """Width of a learned projection of this model's user embedding (its PMA tokens) that an
    embedding-matching loss compares with a teacher's user embedding. 0: off. ``gem distill``
    sets it from the teacher when ``distill.embedding_match_weight > 0``."""

    def __attrs_post_init__(self) -> None:
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"embedding_dim ({self.embedding_dim}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if self.moe.enabled and "wukong" in self.moe.where and self.interaction != "wukong":
            raise ValueError("moe.where includes 'wukong' but model.interaction is "
                             f"{self.interaction!r}; set interaction = 'wukong' or drop it")
        if self.user_embeddings == "cached" and (self.downstream_history != "events"
                                                  or not self.pma_queries):
            raise ValueError("model.user_embeddings = 'cached' needs downstream_history = "
                             "'events' and pma_queries > 0 (the cached embedding is the PMA "
                             "user tokens, and the ranker must not need the tower's outputs)")
        if len(self.esmm_tasks) != 2 or self.esmm_tasks[0] == self.esmm_tasks[1]:
            raise ValueError(f"model.esmm_tasks must name two different tasks (parent, child), "
                             f"got {list(self.esmm_tasks)}")
        if self.attribute_attention_retrieve and not (self.attribute_attention
                                                      and self.attribute_attention_history):
            raise ValueError("model.attribute_attention_retrieve searches the events older than "
                             "attribute attention's recent window: it needs attribute_attention "
                             "= true and attribute_attention_history > 0")
        if self.attribute_attention_order and not self.attribute_attention:
            raise ValueError("model.attribute_attention_order is a part of attribute attention: "
                             "it needs attribute_attention = true")
        if self.attribute_attention_retrieve_engaged and not (
                self.attribute_attention_retrieve and self.action_feature):
            raise ValueError("model.attribute_attention_retrieve_engaged needs "
                             "attribute_attention_retrieve > 0 and model.action_feature (the "
                             "event feature holding the action)")
        if self.moe.enabled and "sequence" in self.moe.where and not self.num_layers:
            raise ValueError("moe.where includes 'sequence' but model.num_layers is 0")
        if self.teacher_match_dim and not (self.pma_queries and self.user_embeddings == "live"):
            raise ValueError("model.teacher_match_dim matches this model's user embedding (its "
                             "PMA tokens) with a teacher's: it needs pma_queries > 0 and "
                             "user_embeddings = 'live'")


@attrs.frozen(kw_only=True)
class DataConfig:
    """Where batches come from."""

    source: str = "synthetic"
    """Registered data source name (``gem plugins`` lists them)."""

    path: str = ""
    """Data set location for file-backed sources; unused by generated data."""

    max_seq_len: int = attrs.field(default=256, validator=greater_than(0))
    """Histories are truncated to their most recent ``max_seq_len`` events."""

    eval_rows: int = attrs.field(default=8192, validator=greater_than(0))
    """Size of the held-out evaluation split (with ``order = "time"``: of each window's
    progressive evaluation)."""

    order: str = attrs.field(default="shuffled", validator=choice("shuffled", "time"))
    """``shuffled``: epochs over the training split in a seeded random order, evaluated on the
    eval split. ``time``: one pass over a data set's time windows, oldest first (shuffled only
    inside a window, per ``[data.options]``), evaluating the model on each window before it
    trains on it (progressive evaluation); the run ends when the windows do, and continues
    from its last checkpoint when the data set gains windows. Needs a source with time windows
    (``parquet`` on a data set written with ``gem data import --window`` / ``--append`` or
    ``gem data synth --windows``). See docs/streaming.md."""

    options: dict[str, Any] = attrs.field(factory=dict)
    """Source-specific options; each source validates its own (see its documentation)."""


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
    """Global gradient-norm clip; 0 disables clipping."""

    eval_every: int = attrs.field(default=100, validator=at_least(0))
    """Evaluate every N steps (and always at the end); 0: only at the end."""

    checkpoint_every: int = attrs.field(default=100, validator=at_least(0))
    """Checkpoint every N steps (and at the end); 0: only at the end."""

    keep_checkpoints: int = attrs.field(default=2, validator=greater_than(0))
    """Number of most recent checkpoints kept."""

    keep_best: bool = True
    """Also keep the checkpoint with the best evaluation NE (the mean over tasks, at a step that
    both evaluated and checkpointed); the keep-last rotation never deletes it."""

    epochs: int = attrs.field(default=1, validator=at_least(0))
    """Passes over a file-backed data set's train split: the run stops at the end of that many
    (or at ``steps``, whichever comes first). The default is one pass, as production CTR
    training runs (a second pass over the same impressions tends to overfit); 0: ``steps``
    alone decides. Generated data (no passes) ignores it; ``data.order = "time"`` is one pass
    by construction and refuses more than 1."""

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
    an attention backend that declares ``torch_compile`` (``padded``, ``triton``; ``auto``
    picks one). The first step pays the compilation (``compile_s`` in metrics.jsonl, ``compile``
    in summary.json); inductor's cache (``compile_cache``) makes later runs' compiles faster."""

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
    """Options of the chosen parallelism implementations; each validates its own."""

    dense: dict[str, Any] = attrs.field(factory=dict)
    """Options of the dense sharding strategy (e.g. HSDP mesh sizes)."""

    embedding: dict[str, Any] = attrs.field(factory=dict)
    """Options of the embedding sharding strategy (e.g. a forced plan per table)."""

    activation_checkpointing: dict[str, Any] = attrs.field(factory=dict)
    """Options of the activation-checkpointing policy (e.g. which module kinds)."""


@attrs.frozen(kw_only=True)
class PrecisionConfig:
    """Options of the chosen precision recipe; the recipe validates them."""

    options: dict[str, Any] = attrs.field(factory=dict)
    """Recipe options (e.g. FP8 exclude list, selection threshold)."""


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
