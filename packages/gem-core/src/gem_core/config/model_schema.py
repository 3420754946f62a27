"""The model's configuration: ``[model]`` with its sections ``[model.moe]`` and
``[model.embedding_optimizer]``. The rest of a run's configuration is in
:mod:`gem_core.config.schema`; ``gem config explain`` reads the docstring under each field.
"""

from __future__ import annotations

import attrs

from gem_core.config.moe_schema import MoeConfig
from gem_core.config.validators import at_least, between, choice, each, greater_than

TOKEN_NORMS = ("none", "batch", "rms", "sample", "cap")
"""The kinds of ``token_norm`` and ``cross_branch_norm`` (built by
``gem_core.model.token_norm.token_norm``)."""

TOKEN_NORMS_WITH_STATISTICS = ("batch", "rms")
"""The kinds that keep running statistics (one process only)."""

ID_BIAS_STEPS = ("fisher", "constant")
"""How ``model.id_bias``'s offsets are stepped (:mod:`gem_core.train.table_optimizer`)."""

ID_BIAS_PRIORS = ("fixed", "learned")
"""Whether ``model.id_bias``'s prior variance stays ``id_bias_rate`` or is re-estimated as the
offsets learn (:mod:`gem_core.train.table_optimizer`)."""

CROSS_BRANCH_OPENINGS = ("gate", "heads")
"""How ``cross_branch`` starts shut (built by ``gem_core.model.cross_branch.CrossBranch``)."""

ENGAGED_RANKS = ("none", "vector", "gate")
"""How target match's action window reads each engaged event's rank among the engaged events
(``target_match_engaged_rank``; built by ``gem_core.model.target_match.TargetMatch``)."""

NUMERIC_SCALES = ("log", "none")
"""How the model reads numbers as they come in a batch (``numeric_scale``; applied by
``gem_core.model.numeric.scale_numbers``)."""


@attrs.frozen(kw_only=True)
class EmbeddingOptimizerConfig:
    """``[model.embedding_optimizer]``: the optimizer of the embedding tables.

    Embedding backends declaring the ``fused_optimizer`` capability
    (:data:`gem_core.capabilities.FUSED_OPTIMIZER`: ``fbgemm-tbe``, and ``reference-fused``, its
    plain-PyTorch reference) apply it themselves, inside the backward, in one process. Tables
    that are parameters of the model (the ``reference`` backend) train with the dense AdamW at
    ``train.lr x train.embedding_lr_scale``, unless ``dense_tables = "same"`` gives them this
    optimizer too, stepped with the dense optimizer after the dense strategy has reduced the
    gradients, so on any number of ranks (:mod:`gem_core.train.table_optimizer`). With
    ``dense_tables = "adamw"`` and such a backend, a run that changes this section is refused at
    start-up: it would change nothing."""

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

    dense_tables: str = attrs.field(default="adamw", validator=choice("adamw", "same", "auto"))
    """Tables that are parameters of the model (embedding backends without the fused
    optimizer): ``adamw``, the dense AdamW at ``train.lr x train.embedding_lr_scale``; ``same``,
    this section's optimizer (``name``, ``lr``, ``lr_schedule``, ``eps``, ``weight_decay``) as
    its own parameter group of the dense optimizer, stepped after DDP or FSDP2 reduced the
    gradients, with its state (one float per row) sharded like the rows. A row is stepped when
    its gradient is not all zeros (the rows the batch looked up), as the fused backends step the
    rows they looked up; unlike them, ``train.grad_clip`` covers the tables too. Needs a dense
    sharding that declares the ``table_optimizer`` capability and the tables left to the dense
    strategy (``--embedding-sharding replicated``); ``auto``: ``same`` where those hold, else
    ``adamw`` (DeepSpeed, TorchRec's sharded tables), logged at start-up."""

    def __attrs_post_init__(self) -> None:
        if self.name == "sgd" and self.weight_decay:
            raise ValueError("model.embedding_optimizer: weight_decay needs name = "
                             "'rowwise_adagrad' (FBGEMM's fused SGD has no weight decay)")


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
    history (cost grows with candidates x events). Every event of the window is summed
    without a softmax, so where most events are views the label does not read, a shorter
    window with ``attribute_attention_retrieve_engaged`` (the older engaged matches by
    retrieval) reads better: 8 against 64 gained 0.0096 NE on 5 of 5 worlds of the
    Taobao-shaped log with target match off (docs/results.md)."""

    attribute_attention_hidden: int = attrs.field(default=16, validator=greater_than(0))
    """Hidden width of attribute attention's scoring MLP."""

    attribute_attention_latest: int = attrs.field(default=0, validator=at_least(0))
    """Latest-match heads of attribute attention (stick-breaking weights, newest event first):
    each returns what its learned gate finds in the most recent event it fires on, so the order
    of matching events reaches the model (which kind of event came last); 0: none."""

    attribute_attention_match_by_event: bool = False
    """Each attribute's match (the cosine of the candidate's and the event's vectors) enters
    attribute attention's hidden units scaled by a learned map of the event's token, so how much
    a match weighs can depend on the event's action, age and position (a purchase of the
    candidate's category against a page view of it) from the first step."""

    attribute_attention_maps: bool = False
    """Each shared attribute's candidate vector and event vector pass through a learned map of
    their own (``d x d``, starting at the identity) before attribute attention compares them,
    so which attributes count as similar (sibling categories, related topics) is learnt in
    dense maps every impression trains, not only in the table's rows (the scorer compares
    the vectors coordinate by coordinate). Costs ``2 (candidates + events) x attributes x
    d^2`` FLOPs."""

    attribute_attention_loss: float = attrs.field(default=0.0, validator=at_least(0))
    """Weight of attribute attention's own loss in training: a logistic read of its token alone
    per task, trained against the labels (``gem_core.model.learned_path_loss``), so that it
    reads the matches target match's exact tokens already explain and from them learns which
    attributes are alike. The model's prediction is unchanged; 0: off."""

    attribute_attention_retrieve: int = attrs.field(default=0, validator=at_least(0))
    """Long histories (SIM-style hard search): besides its recent window, attribute attention
    scores up to this many older events per candidate, the most recent of those that share an
    attribute's raw id with it (any common id for multi-valued attributes), searched in the
    whole history; 0: the recent window only."""

    attribute_attention_retrieve_engaged: bool = False
    """The search of ``attribute_attention_retrieve`` keeps engaged events only (those whose
    ``action_feature`` id is not ``view_action``)."""

    candidate_bias: bool = False
    """A linear read of the candidate's token added to every task's logit, beside the
    interaction: DeepFM's first-order term (what an item is worth whoever the user is), which
    the interaction reaches only through its LayerNorm and MLP. On MovieLens-100k an item's
    training like-rate alone ranks each user's eval items better (GAUC 0.718) than any preset
    did (docs/results.md)."""

    id_bias: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Features each of whose ids gets a learned offset per task, added to the task's logit: a
    logistic regression's per-id terms (Wide & Deep's wide part). Single-valued candidate
    features (an ad's effect: ``["adgroup_id"]``) and the request's sparse features (a user's
    effect, where the data has a ``user_id`` feature: ``["adgroup_id", "user_id"]``; a bag's
    offsets pooled as the feature declares); ``candidate.x`` / ``sparse.x`` where the data
    declares ``x`` as both. Stepped by SGD at ``id_bias_rate`` per impression, not by AdamW: an ad
    seen six times in a pass needs its clicks weighed against its non-clicks, which AdamW's
    normalised steps do not do (:mod:`gem_core.model.id_bias`). Offsets start at 0. Needs a
    dense sharding with the ``table_optimizer`` capability; a name the data does not declare is
    refused at start-up."""

    id_bias_rate: float = attrs.field(default=0.125, validator=greater_than(0))
    """``id_bias``: the prior variance of the ids' logit effects, which is the step of an
    offset per impression at its first impressions: after a step's impressions an offset has
    moved by ``id_bias_rate * sum(click - p)`` over its impressions (``id_bias_step``). The
    variance of the effects weighs an id's few impressions as a posterior would (0.25 for
    effects of standard deviation 0.5, the Taobao-shaped log's: one pass at 0.25 comes within
    0.0005 NE of the offline fit), and a larger rate overshoots. Beside the ids' own embedding
    rows, which learn the same effect again, half of it did better on every seed measured (0.125
    there); with ``id_bias_only`` the prior variance itself (docs/results.md)."""

    id_bias_step: str = attrs.field(default="fisher", validator=choice(*ID_BIAS_STEPS))
    """``id_bias``: how an offset's step shrinks as its id is seen. ``fisher``: an online
    posterior per id, ``b -= sum(p - click) / (1 / id_bias_rate + F)`` with ``F`` the summed
    squares of the id's per-step ``sum(p - click)`` (the empirical Fisher information), so a
    frequent id (a category, a user with many impressions) settles on its effect; ``constant``:
    ``b -= id_bias_rate * sum(p - click)`` at every step, whose offsets jitter about their effect
    with a spread of about ``sqrt(id_bias_rate / 2)`` once an id is frequent (on the
    Taobao-shaped log's one-pass reference with offsets for six ids: NE 0.968 where ``fisher``
    reaches 0.929)."""

    id_bias_prior: str = attrs.field(default="fixed", validator=choice(*ID_BIAS_PRIORS))
    """``id_bias``: ``fixed``: ``id_bias_rate`` is the prior variance of the ids' effects
    throughout. ``learned``: it is where the prior starts; after every step each feature's prior
    variance (one per task) is re-estimated from the ids seen so far by expectation-maximisation,
    the mean over them of ``b^2 + 1 / (1 / prior + F)`` (each offset's squared posterior mean
    plus its posterior variance), which is the variance the ids' effects show so far. How much
    ids differ is a property of the log (a movie's like-rate varies far more than an ad's
    click-rate effect of standard deviation 0.5), which a fixed rate has to be told. Needs
    ``id_bias_step = "fisher"`` (the posterior variance is read from ``F``). Without a model
    (the peers' one-pass reference) it finds, from 0.5, the best fixed rate of both
    MovieLens-100k and the Taobao-shaped log; beside the ids' embedding rows it did not pay
    (from 0.5: 0.002-0.003 NE worse on both, GAUC 0.001-0.002 better; from 0.25: level with
    the fixed 0.125; docs/results.md)."""

    id_bias_only: bool = False
    """``id_bias``: its features reach the model through their offsets alone: their vectors
    leave the candidate's token (and target match, attribute attention), and a table no other
    feature reads is not built. For ids seen a few times each (ads in a log of millions), whose
    embedding rows AdamW moves as far on a non-click as on a click: beside the offsets such a
    row learns the same effect again, noisily (docs/results.md)."""

    token_norm: str = attrs.field(default="none", validator=choice(*TOKEN_NORMS))
    """Scaling of the interaction's tokens, each position on its own: ``none``, as they come;
    ``batch``, a batch norm with one channel per token (mean and scale over the batch and the
    embedding dimension, running statistics at evaluation), so a token summed over many events
    no longer sets the scale for all the others while each sample's size relative to the batch
    is kept; ``rms``, each position divided by its batch RMS with a gain per position and no
    centring, so a token that is zero (no matching event) stays zero; ``sample``, each token of
    each sample divided by its own RMS with a gain per position (no statistics: any number of
    ranks, but a sum token's size is lost); ``cap``, each token of each sample times
    ``1 / sqrt(1 + its mean square)``, so loud tokens come down to an RMS under 1 and quiet ones
    pass nearly unchanged (no statistics, no parameters) (``gem_core.model.token_norm``). With
    ``interaction = "cross"``, each lets the cross network find the ``cross`` kind's three-way
    parity (``tiny-gem``, 2,000 steps: click NE 0.8521 with ``batch``, 0.8512 with ``sample``,
    against 0.9057 without and 0.8439 achievable); on one pass of MovieLens-100k they cost
    0.005-0.019 NE, so no preset uses them (docs/results.md).
    ``batch`` and ``rms`` run in one process only: the running statistics would be each rank's
    own, so ``gem train`` and ``gem plan`` refuse them on more than one rank."""

    dense_tokens: str = attrs.field(default="one", validator=choice("one", "per_feature"))
    """How the request's dense features become tokens of the interaction (and keys of the
    tower's cross-attention): ``one``, a single linear token of all of them (DLRM's);
    ``per_feature``, a token ``x_i w_i + b_i`` of each (AutoInt's, FT-Transformer's), so that
    one feature can be crossed with a sparse one on its own. On ``cross`` (whose label reads the
    sign of ``dense[2]``) it let the probe find the parity 250-500 steps sooner, and did not
    change ``tiny`` (docs/results.md)."""

    numeric_scale: str = attrs.field(default="log", validator=choice(*NUMERIC_SCALES))
    """How the request's dense features and the candidate's numeric features are read before
    their projections: ``log``, each value ``x`` as ``sign(x) * log(1 + |x|)`` (near ``x`` for
    small values, the order of magnitude for large ones, the sign kept); ``none``, as they come.
    Logs carry raw numbers: a price of 1,299 projected as it is made ``tiny``'s gradient norms
    reach 400 and its eval NE 1.25 after 100 steps on a Taobao-shaped log, against 0.95 with
    the price left out (docs/results.md). Figures in docs/results.md before 2026-12-06 were
    taken with ``none``; the bundled sources' features are small already."""

    match_token_scale: str = attrs.field(default="linear", validator=choice("linear", "log"))
    """The size of the target-match and attribute-attention tokens, sums over up to
    ``target_match`` / ``attribute_attention_history`` events: ``linear``, as summed; ``log``,
    each token rescaled to an RMS of ``log(1 + rms)`` (its direction and the order of its size
    kept). On MovieLens-100k their RMS grew to 13 and 26 against 0.07-0.9 for every other token,
    and their products then dominated the interaction's LayerNorm (docs/results.md)."""

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
    single-valued event feature of the schema, read by ``target_match_action_window``,
    ``target_match_latest`` and ``attribute_attention_retrieve_engaged`` to tell engaged events
    from views. ``"schema"``: the one the data declares (its schema's ``action_feature`` and
    ``view_action``, which then replace ``view_action``), or none where it declares none; the
    run records what it resolved to. Empty: none."""

    target_match_action_window: int = attrs.field(default=0, validator=at_least(0))
    """A second, longer target-match window by count (256, ...) in which only engaged events
    are matched: those whose ``action_feature`` id is not
    ``view_action``, so a purchase 200 page views ago is still found. Its matches
    have a value projection of their own and add to the target-match token, so the model tells
    a recent match of any action from an older engaged one. 0: off; needs
    ``action_feature``."""

    target_match_engaged_limit: int = attrs.field(default=0, validator=at_least(0))
    """Only the most recent this many engaged events of ``target_match_action_window`` are
    matched: a window counted in engaged events (a rule like "the ad's category is among the
    user's last 10 cart/fav/buy events") rather than in all events, where a matching purchase
    older than ten others counts as much as the latest. The events before the limit still bound
    the search (``target_match_action_window``). 0: every engaged event of the window; needs
    ``target_match_action_window``."""

    target_match_engaged_rank: str = attrs.field(default="none",
                                                 validator=choice(*ENGAGED_RANKS))
    """How each engaged event of ``target_match_action_window`` carries its rank among the
    engaged events (1 for the latest; ranks 1-16 a bucket each, then one per doubling), so the
    model learns how far back an engaged match counts instead of being told
    (``target_match_engaged_limit``): ``vector``, a learned vector of its bucket added to its
    token; ``gate``, a learned factor of its bucket on its match weight (a soft limit: 0 drops
    the rank; ten times the dense learning rate); ``none``. Both start as without ranks. Needs
    ``target_match_action_window``."""

    view_action: int | str = 0
    """The most common, least engaged action, "view", of ``action_feature``: the engaged-only
    windows and searches skip these events. An integer is its raw id (as the data holds it); a
    string is the action's text (``"pv"``), looked up at start-up in the data set's vocabulary
    of ``action_feature``'s table (``[import.strings] TABLE = "vocabulary"``), and the run
    records the id it resolved to. A string needs ``action_feature``."""

    target_match_max_age_s: float = attrs.field(default=0.0, validator=at_least(0))
    """Target match (both windows) sees only events younger than this many seconds (the
    request's timestamp minus the event's). 0: no age limit."""

    target_match_latest: bool | str = attrs.field(default=False,
                                                  validator=choice(False, True, "with_actions"))
    """Target match also says where the most recent matching event of each shared attribute
    lies (a flag and its log position from the end, through a small MLP, as one more token),
    for views and engaged events apart when ``action_feature`` is set: which kind of match came
    last, which a sum of matches cannot tell ("viewed this advertiser after buying in the
    category"). ``"with_actions"``: on only where there is an action feature (with
    ``action_feature = "schema"``: where the data declares one), since with one kind of event
    it measured level or worse (docs/results.md)."""

    target_match_latest_window: int = attrs.field(default=0, validator=at_least(0))
    """How many of the most recent events ``target_match_latest`` reads: 0, target match's
    windows (the longer of ``target_match`` and ``target_match_action_window``); otherwise
    that many, at most the data's ``max_seq_len`` (a large number: the whole history), whatever
    the windows of the sums."""

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

    interaction: str = attrs.field(default="dot", validator=choice("dot", "wukong", "cross"))
    """Feature interaction over the non-sequence tokens: DLRM ``dot`` products + MLP, a stack
    of ``wukong`` layers (optimised factorization-machine block + linear compress block), or a
    DCN-V2 ``cross`` network (explicit crosses of the flattened tokens, one order more per
    layer, ``cross_layers``) + MLP."""

    cross_layers: int = attrs.field(default=3, validator=greater_than(0))
    """``interaction = "cross"``: cross layers (the highest cross is of order layers + 1; 3 as
    DCN-V2's and RecBole's default)."""

    cross_multiplier: str = attrs.field(default="flat", validator=choice("flat", "token"))
    """``interaction = "cross"``: what multiplies each cross layer (DCN-V2's ``x0``): ``flat``,
    the flattened tokens under one LayerNorm (the layers' input too); ``token``, each token of
    each sample divided by its own RMS (a gain per token), so a loud sum token does not shrink
    the others' products, while the layers' input and the MLP keep the LayerNorm-ed tokens and
    their sizes (``gem_core.model.cross_network``)."""

    cross_branch: bool = False
    """A DCN-V2 cross network beside the interaction (DCN-V2's parallel form): it reads the
    tokens through ``cross_branch_norm`` while the interaction reads them as ``token_norm``
    leaves them, and its output goes through a head of its own whose logit is added to each
    task's; it starts shut (``cross_branch_opening``), so the model starts as the interaction
    alone.
    It is built from a random stream of its own, so every other parameter starts as it would
    without it. Its layers are ``cross_layers`` / ``cross_rank`` / ``cross_multiplier``, its
    MLP ``interaction_dims``. What it is for: scaling every token to one size lets the crosses
    find a product of quiet tokens (``synthetic-ads``' ``cross`` kind), and costs NE where the
    interaction had learnt to lean on the loud ones (MovieLens-100k); beside the interaction
    the model keeps both (docs/results.md)."""

    cross_branch_norm: str = attrs.field(default="sample", validator=choice(*TOKEN_NORMS))
    """``cross_branch``: how its tokens are scaled, each position on its own (the kinds of
    ``token_norm``; ``batch`` and ``rms`` run in one process only)."""

    cross_branch_opening: str = attrs.field(default="heads",
                                            validator=choice(*CROSS_BRANCH_OPENINGS))
    """``cross_branch``: how it starts shut. ``heads``: its heads start at zero and learn from
    the first step; ``gate``: its output times a learned scalar that starts at zero (only the
    scalar learns at first: the rest of the branch waits for it to move). Either way the model
    starts as without the branch (``gem_core.model.cross_branch``). ``heads`` found
    ``synthetic-ads``' ``cross`` kind on every seed measured, ``gate`` on one of two; the
    figures of docs/results.md before 2026-12-05 (night) were taken with ``gate``
    (docs/results.md)."""

    cross_branch_tokens: str = attrs.field(default="all", validator=choice("all", "request"))
    """``cross_branch``: which tokens it crosses. ``all``: every token the interaction reads.
    ``request``: the candidate's and the request's own features (sparse context features and
    dense) only, not the history's summaries (target attention, target match, attribute
    attention, history mean, PMA user tokens), which the interaction still reads: DCN-V2's
    crosses of the request's fields, with fewer inputs that say nothing about a cross to search
    through (docs/results.md)."""

    cross_branch_skip: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """``cross_branch``: the data's sparse (request) features whose tokens it leaves out, by
    name (``["user_id"]``); the interaction still reads them. For an id with a row per user
    or per page: crossed with the candidate it is a table of (user, item) pairs, which repeated
    passes over the same users learn by heart (docs/results.md). A name the data does not
    declare is refused at start-up."""

    cross_branch_max_rows: int = attrs.field(default=0, validator=at_least(0))
    """``cross_branch``: it also leaves out the sparse (request) features whose table has more
    rows than this (0: none): ``cross_branch_skip`` for a preset, which cannot name the data's
    features. Buckets, categories, devices and surfaces have a few to a few hundred values; an
    id per user or per page has as many as there are users or pages. Logged at start-up."""

    cross_rank: int = attrs.field(default=0, validator=at_least(0))
    """``interaction = "cross"``: rank of each cross layer's matrix (``U V``, DCN-V2's low-rank
    cross); 0: full (tokens x embedding_dim square)."""

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
    """The optimizer of the embedding tables where it is not the dense AdamW: the fused one of
    backends that train their tables themselves (``fbgemm-tbe``, ``reference-fused``), or, with
    ``dense_tables = "same"``, a parameter group of the dense optimizer."""

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
        if (self.attribute_attention_latest or self.attribute_attention_match_by_event
                or self.attribute_attention_maps or self.attribute_attention_loss) and (
                    not self.attribute_attention):
            raise ValueError("model.attribute_attention_latest, "
                             "attribute_attention_match_by_event, attribute_attention_maps and "
                             "attribute_attention_loss are options of attribute attention: "
                             "they need attribute_attention = true")
        if self.attribute_attention_retrieve_engaged and not (
                self.attribute_attention_retrieve and self.action_feature):
            raise ValueError("model.attribute_attention_retrieve_engaged needs "
                             "attribute_attention_retrieve > 0 and model.action_feature (the "
                             "event feature holding the action)")
        if isinstance(self.view_action, str) and not self.action_feature:
            raise ValueError(f"model.view_action = {self.view_action!r} is an action's text, "
                             "looked up in the vocabulary of model.action_feature's table: it "
                             "needs model.action_feature (the event feature holding the "
                             "action), or give the raw id (an integer)")
        if self.moe.enabled and "sequence" in self.moe.where and not self.num_layers:
            raise ValueError("moe.where includes 'sequence' but model.num_layers is 0")
        if self.teacher_match_dim and not (self.pma_queries and self.user_embeddings == "live"):
            raise ValueError("model.teacher_match_dim matches this model's user embedding (its "
                             "PMA tokens) with a teacher's: it needs pma_queries > 0 and "
                             "user_embeddings = 'live'")
