"""The options of the synthetic ads log (:class:`SynthOptions`: ``gem data synth --set``,
``[data.options]`` of the ``synthetic-ads`` source) and the planted label kinds they choose from.

The generator (:mod:`gem_data.generator`) and the planted kinds (:mod:`gem_data.planted`) both
read these options; this module imports neither.
"""

from __future__ import annotations

import attrs

from gem_core.config.validators import at_least, between, choice, greater_than

PLANTED_KINDS = ("ads", "multi_valued", "rare_action", "hierarchy", "order", "cross")

DEFAULT_MEAN_LENGTH = {"rare_action": 300.0}
"""Median history length of a kind when ``mean_length`` is 0 (its default); 60 otherwise."""


@attrs.frozen(kw_only=True)
class SynthOptions:
    """Knobs of the generated world and its requests (``gem data synth --set key=value``,
    ``[data.options]`` of the ``synthetic-ads`` source)."""

    num_items: int = attrs.field(default=50_000, validator=greater_than(10))
    """Distinct ads (history events and candidates). Their raw ids are 64-bit hashes."""

    ad_table_size: int = attrs.field(default=0, validator=at_least(0))
    """Rows of the ``ad`` embedding table (``hash`` id policy: distinct ads may share a row);
    0: twice ``num_items``."""

    ad_id_policy: str = attrs.field(default="hash",
                                    validator=attrs.validators.in_(("hash", "managed")))
    """Id policy of the ``ad`` table: ``hash`` (a fixed hash into its rows) or ``managed``
    (TorchRec's zero-collision remapper; train with
    ``--set backends.embedding=torchrec-managed``)."""

    num_users: int = attrs.field(default=100_000, validator=greater_than(0))
    """Distinct users, each with fixed interests and segments."""

    num_clusters: int = attrs.field(default=50, validator=greater_than(1))
    """Categories (interest clusters): the ``category`` event and candidate feature."""

    num_advertisers: int = attrs.field(default=1000, validator=greater_than(0))
    """Advertisers (each belongs to one category; an ad belongs to one advertiser)."""

    zipf_exponent: float = attrs.field(default=1.1, validator=greater_than(0))
    """Ad popularity is proportional to rank ** -zipf_exponent."""

    length_distribution: str = attrs.field(default="lognormal",
                                           validator=choice("lognormal", "zipf"))
    """History length law: lognormal around ``mean_length``, or Zipf with ``length_exponent``."""

    mean_length: float = attrs.field(default=0.0, validator=at_least(0))
    """Median history length of the lognormal law; 0: the planted kind's default, 60 (300 for
    ``rare_action``). See :attr:`median_length`."""

    length_sigma: float = attrs.field(default=1.2, validator=greater_than(0))
    """Log-space spread of the lognormal law (1.2 gives a heavy tail)."""

    length_exponent: float = attrs.field(default=1.2, validator=greater_than(1))
    """Exponent of the Zipf length law (P(len = k) ~ k ** -exponent)."""

    max_length: int = attrs.field(default=1024, validator=greater_than(0))
    """Longest history written; longer draws keep their most recent events."""

    empty_fraction: float = attrs.field(default=0.05, validator=between(0.0, 1.0))
    """Share of requests whose user has no history at all."""

    session_length: int = attrs.field(default=8, validator=at_least(0))
    """In-interest history events come in sessions of this many events, each from one of the
    user's three interests, so the most recent events show the current intent (which the
    planted label rewards) and differ from the history as a whole. 0: each event picks one of
    the user's interests at random."""

    max_candidates: int = attrs.field(default=32, validator=greater_than(0))
    """Most candidates (impressions) of one request; 1 gives one candidate per request."""

    candidates_exponent: float = attrs.field(default=1.5, validator=greater_than(0))
    """Candidates per request ``K`` follow a Zipf law truncated to ``1..max_candidates``:
    P(K = k) ~ k ** -exponent (1.5 with 32 gives a mean of about 4.4)."""

    recent_window: int = attrs.field(default=5, validator=greater_than(0))
    """How many of the most recent history events the planted label's match terms look at."""

    recent_advertiser_weight: float = attrs.field(default=1.6, validator=at_least(0))
    """Click-logit effect of an engaged (clicked or converted) recent event of the candidate's
    advertiser (``rare_action``: among the last ``long_window`` events)."""

    recent_category_weight: float = attrs.field(default=1.0, validator=at_least(0))
    """Click-logit effect of an engaged recent event of the candidate's category
    (``rare_action``: a converted event among the last ``long_window``)."""

    recent_view_weight: float = attrs.field(default=0.4, validator=at_least(0))
    """Click-logit effect of any recent event (viewed too) of the candidate's category
    (``multi_valued``: sharing one of the candidate's topics)."""

    history_weight: float = attrs.field(default=1.5, validator=at_least(0))
    """Click-logit effect of the whole history's (action- and recency-weighted) share in the
    candidate's category: the weaker, long-history part of the signal."""

    retarget_fraction: float = attrs.field(default=0.25, validator=between(0.0, 1.0))
    """Share of candidates that are an ad of the advertiser of one of the user's last
    ``recent_window`` events (retargeting); the rest split evenly between the user's interests
    and global popularity."""

    num_dense: int = attrs.field(default=4, validator=at_least(2))
    """Dense float features per request (the first two carry label signal; ``cross`` reads
    the sign of the third, so it needs at least 3)."""

    seq_dense_dim: int = attrs.field(default=0, validator=at_least(0))
    """Width of each ad's dense content vector (its category's centroid plus noise), carried by
    every history event and every candidate (``candidate_content``); 0: none."""

    click_bias: float = attrs.field(default=-4.6, validator=between(-20.0, 20.0))
    """Click logit intercept; the default gives a click rate of about 4 %."""

    conversion_bias: float = attrs.field(default=-1.8, validator=between(-20.0, 20.0))
    """Conversion-given-click logit intercept (about a quarter of clicks convert)."""

    drift_weight: float = attrs.field(default=0.0, validator=at_least(0))
    """Time drift of the planted process: category ``c`` adds
    ``drift_weight * (cos(phase) * u[c] + sin(phase) * v[c])`` to the click logit, ``u`` and
    ``v`` fixed standard-normal draws per category and ``phase = 2 pi t / drift_period`` at the
    chunk's time ``t`` (so which categories users favour moves with time). 0: a stationary
    process, the data of earlier versions byte for byte."""

    drift_period: float = attrs.field(default=400.0, validator=greater_than(0))
    """Chunks of time per full turn of the drifting category preferences (windows of time for
    ``gem data synth --windows``, whose time is the window's index)."""

    train_start: int = attrs.field(default=0, validator=at_least(0))
    """Time window of the training split: training chunk ``i`` is chunk ``train_start + i``
    (its requests and its time). A chunk is one training batch of the ``synthetic-ads``
    source (one row group of ``gem data synth``), so one seed gives an older window to one run
    (a teacher) and a more recent one to another (a student)."""

    planted: str = attrs.field(default="ads", validator=choice(*PLANTED_KINDS))
    """The planted label kind: ``ads``, ``multi_valued``, ``rare_action``, ``hierarchy``,
    ``order`` or ``cross`` (the docstring of :mod:`gem_data.generator` has each one's formula)."""

    num_topics: int = attrs.field(default=40, validator=greater_than(0))
    """``multi_valued``: topics (the ``topic`` table); each ad has 1-3, mostly among the few
    topics of its category."""

    topic_weight: float = attrs.field(default=1.2, validator=at_least(0))
    """``multi_valued``: click-logit effect of each topic (up to two) that the candidate shares
    with an engaged recent event."""

    long_window: int = attrs.field(default=256, validator=greater_than(0))
    """``rare_action``: the most recent history events the long-range terms look at."""

    num_parents: int = attrs.field(default=10, validator=greater_than(0))
    """``hierarchy``: parent categories; category ``c``'s parent is fixed by the seed (about
    ``num_clusters / num_parents`` categories per parent)."""

    parent_weight: float = attrs.field(default=1.6, validator=at_least(0))
    """``hierarchy``: click-logit effect of an engaged recent event whose category has the
    candidate's category's parent (the same category included)."""

    order_weight: float = attrs.field(default=1.5, validator=at_least(0))
    """``order``: click-logit effect (+, or - when the other way round) of the user's most
    recent engaged event of the candidate's category coming after the most recent view of the
    candidate's advertiser."""

    cross_weight: float = attrs.field(default=1.5, validator=at_least(0))
    """``cross``: click-logit effect of the three-way parity of the request's context, the
    candidate's category and the sign of ``dense[2]`` (each context and category has a hidden
    bit fixed by the seed): no single feature or pair of them says anything about it."""

    data_seed: int = attrs.field(default=-1, validator=at_least(-1))
    """Seed of the world and its requests for the ``synthetic-ads`` source; -1: the run's
    ``train.seed``. Fix it to give runs of other seeds (a teacher and its students) the same
    world. (``gem data synth`` takes ``--seed``.)"""

    eval_time: int = attrs.field(default=0, validator=at_least(0))
    """Time (in training chunks) at which the eval split's labels are drawn: the present that
    runs are evaluated on. Only matters with ``drift_weight > 0``."""

    def __attrs_post_init__(self) -> None:
        if self.planted == "cross" and self.num_dense < 3:
            raise ValueError(f"planted = 'cross' reads the sign of dense[2]; num_dense = "
                             f"{self.num_dense} gives no such feature (set it to 3 or more)")

    @property
    def median_length(self) -> float:
        """The lognormal law's median: ``mean_length``, or the planted kind's default where it
        is 0 (300 for ``rare_action``, 60 for the others)."""
        return self.mean_length or DEFAULT_MEAN_LENGTH.get(self.planted, 60.0)
