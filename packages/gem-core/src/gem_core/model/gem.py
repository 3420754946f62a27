"""The GEM model, assembled from injected backends. It never imports parallelism or kernels."""

from __future__ import annotations

import logging
from typing import Any, Mapping, NamedTuple

import attrs
import torch
from torch import Tensor, nn

from gem_core.attention import AttentionParams
from gem_core.batch import JaggedBatch
from gem_core.config import ModelConfig
from gem_core.contracts import (
    AttentionBackend,
    RankingModel,
    StrategyModel,
    check_checkpoint_kind,
    modules_of,
)
from gem_core.embedding import EmbeddingTableConfig
from gem_core.errors import GemConfigError
from gem_core.flops import TRAIN_FACTOR
from gem_core.jagged import max_length
from gem_core.model.actions import declared_actions
from gem_core.model.attribute_attention import AttributeAttention
from gem_core.model.cross_attention import CrossFeatureAttention
from gem_core.model.cross_branch import CrossBranch, cross_branch_skipped
from gem_core.model.cross_network import CrossNetworkInteraction
from gem_core.model.dense_tokens import PerFeatureDenseTokens
from gem_core.model.features import FeatureLookup
from gem_core.model.features import embedding_tables as feature_tables
from gem_core.model.heads import esmm_logits
from gem_core.model.history_retrieval import engaged_events, retrieve_matching_events
from gem_core.model.id_bias import IdBias, model_schema
from gem_core.model.interaction import DotInteractionMLP, log_magnitude
from gem_core.model.last_forward import LastForward
from gem_core.model.learned_path_loss import LearnedPathLoss
from gem_core.model.module_flops import forward_flops_by_module
from gem_core.model.moe import auxiliary_losses, moe_layers, step_stats, summarize_step_stats
from gem_core.model.numeric import scale_numbers
from gem_core.model.pma import PooledMultiheadAttention
from gem_core.model.sequence_tower import JaggedSelfAttentionBlock, SequenceTower, SwiGLU
from gem_core.model.target_attention import TargetAwareAttention
from gem_core.model.target_match import (
    check_action_feature,
    check_view_action,
    shared_attributes,
    target_match_from_config,
)
from gem_core.model.token_norm import token_norm
from gem_core.model.tokens import EventTokenizer
from gem_core.model.wukong import WukongInteraction
from gem_core.norm import NormBackend, ReferenceNorm
from gem_core.schema import FeatureSchema

_log = logging.getLogger(__name__)


def embedding_tables(config: ModelConfig, schema: FeatureSchema) -> list[EmbeddingTableConfig]:
    """The sparse tables of the model: one per table the data set declares (see
    :mod:`gem_core.model.features`), each with ``[model.embedding_optimizer]`` for backends
    that train their tables themselves."""
    return [attrs.evolve(table, optimizer=config.embedding_optimizer)
            for table in feature_tables(config.embedding_dim, schema)]


#: What each kind of :meth:`GEMModel.stash_points` is, by class.
STASH_CLASSES: dict[str, tuple[type, ...]] = {
    "linear": (nn.Linear,),  # torchao's Float8Linear is an nn.Linear too
    "norm": (nn.RMSNorm, nn.LayerNorm),
    "swiglu": (SwiGLU,),
    "sequence_block": (JaggedSelfAttentionBlock,),
    "target_attention": (TargetAwareAttention,),
    "pma": (PooledMultiheadAttention,),
    "cross_attention": (CrossFeatureAttention,),
    "interaction": (DotInteractionMLP, WukongInteraction, CrossNetworkInteraction),
}


def resolve_multitask(config: ModelConfig, schema: FeatureSchema) -> str:
    """``model.multitask`` for this data: ``auto`` is ``esmm`` when the data has both
    ``esmm_tasks``, ``independent`` heads otherwise (a single-task log, other task names);
    the choice is logged."""
    if config.multitask != "auto":
        return config.multitask
    chosen = "esmm" if set(config.esmm_tasks) <= set(schema.tasks) else "independent"
    _log.info("model.multitask = auto: %s (the data's tasks %s; esmm_tasks %s)", chosen,
              list(schema.tasks), list(config.esmm_tasks))
    return chosen


class _Requests(NamedTuple):
    """What one forward computes once per request, before the candidates enter."""

    offsets: Tensor  # (R + 1,) offsets of the history events
    lengths: Tensor  # (R,) history lengths
    max_len: int
    rows: Tensor  # (E,) the request of each event
    ages: Tensor  # (E,) seconds from each event to its request
    events: Tensor  # (E, d) event tokens
    context: list[Tensor]  # non-sequence user and context tokens (sparse, then dense), (R, d)


class _Candidates(NamedTuple):
    """How the candidates of one forward map onto its requests."""

    candidate_offsets: Tensor  # (R + 1,) offsets of each request's candidates
    max_candidates: int
    owner: Tensor  # (N,) the request of each candidate


class GEMModel(nn.Module, StrategyModel, RankingModel):
    """Embeddings -> sequence tower (+ cross-attention to the user's non-sequence tokens) ->
    PMA user tokens -> target-aware attention -> interaction (dot, Wukong or cross) -> task heads.

    Everything up to PMA depends on the user and context only (the upstream user model); the
    candidate enters at target-aware attention and the interaction (the downstream ranker).
    """

    def __init__(self, config: ModelConfig, schema: FeatureSchema, *,
                 attention: AttentionBackend, embeddings: nn.Module,
                 norm: NormBackend | None = None) -> None:
        """``norm``: the gated-norm backend of ``config.attention_gate`` (default: gem-core's
        reference)."""
        super().__init__()
        dim = config.embedding_dim
        # The data's features (the model's inputs: the offsets of id_bias read their ids there)
        # and those it embeds, which every part below is built from.
        # model.action_feature = "schema" read from the data's declaration (the trainer has
        # already resolved it; a model built straight from a configuration does it here).
        config = declared_actions(config, schema)
        self.config, self.schema = config, schema
        self.embedded_schema = schema = model_schema(config, schema)
        norm = norm if norm is not None else ReferenceNorm()
        self.embeddings = embeddings
        self.lookup = FeatureLookup(schema)
        self.events = EventTokenizer(dim, config.time_buckets, schema.seq_dense_dim,
                                     config.position_buckets)
        self.attention_params = AttentionParams(
            causal=True, window=config.window or None, normalization=config.normalization
        )
        per_feature = config.dense_tokens == "per_feature"
        self.num_context = len(schema.sparse_features) + (
            schema.num_dense if per_feature else int(schema.num_dense > 0))
        if config.cross_attention and config.num_layers and not self.num_context:
            raise GemConfigError("model.cross_attention needs non-sequence sparse or dense "
                                 "features; the schema has none")
        moe = config.moe if config.moe.enabled else None
        # A ranker on cached user embeddings has no upstream: neither tower nor PMA.
        live = config.user_embeddings == "live"
        # The parts are built in forward order, as they always were: that order is the order
        # of the parameters (state dict, optimizer state) and of their seeded initialisation.
        self._build_upstream(attention, norm, moe, live)
        self._build_history_readers(attention, live)
        # The dense features: one token of all (dense_proj) or a token of each (dense_tokens).
        self.dense_proj = (nn.Linear(schema.num_dense, dim)
                           if schema.num_dense and not per_feature else None)
        self.dense_tokens = (PerFeatureDenseTokens(schema.num_dense, dim)
                             if schema.num_dense and per_feature else None)
        # A candidate's numeric features (price, bid) join its token, as its content vector does.
        self.candidate_numeric = (nn.Linear(schema.candidate_numeric_dim, dim)
                                  if schema.candidate_numeric_dim else None)
        self._build_distillation()
        self._build_interaction(moe)
        self._build_cross_branch()

    def _build_upstream(self, attention: AttentionBackend, norm: NormBackend, moe: Any,
                        live: bool) -> None:
        """The sequence tower and PMA (the upstream user model), or neither on cached user
        embeddings, which must then be as wide as PMA's output."""
        config, dim = self.config, self.config.embedding_dim
        self.tower = (SequenceTower(dim, config.num_heads, config.num_layers,
                                    int(config.mlp_ratio * dim), self.attention_params, attention,
                                    cross_attention=config.cross_attention,
                                    moe=moe if moe and "sequence" in moe.where else None,
                                    gate_norm=norm if config.attention_gate else None,
                                    relative_bias=config.relative_bias)
                      if live else None)
        self.pma = (PooledMultiheadAttention(dim, config.num_heads, config.pma_queries, attention)
                    if config.pma_queries and live else None)
        if not live and self.schema.user_embedding_dim != config.pma_queries * dim:
            raise GemConfigError(
                f"model.user_embeddings = 'cached' needs data with user embeddings of "
                f"pma_queries x embedding_dim = {config.pma_queries * dim} floats per sample; "
                f"the data has {self.schema.user_embedding_dim} (export them with gem "
                "export-user-embeddings from a run of the same model)")

    def _build_history_readers(self, attention: AttentionBackend, live: bool) -> None:
        """What reads the history for each candidate: target-aware attention, attribute
        attention and target match (each only where the config turns it on)."""
        config, schema, dim = self.config, self.embedded_schema, self.config.embedding_dim
        self.target_attention = (TargetAwareAttention(dim, config.num_heads, attention,
                                                      recent=config.target_history,
                                                      normalization=config.target_normalization)
                                 if config.target_attention else None)
        self.attribute_attention = (
            AttributeAttention(dim, shared_attributes(schema),
                               history=config.attribute_attention_history,
                               hidden=config.attribute_attention_hidden,
                               latest=config.attribute_attention_latest,
                               match_by_event=config.attribute_attention_match_by_event,
                               maps=config.attribute_attention_maps,
                               tower_keys=live and config.downstream_history == "tower")
            if config.attribute_attention else None)
        self.path_loss = (LearnedPathLoss(dim, list(schema.tasks), config.attribute_attention_loss)
                          if config.attribute_attention_loss else None)
        self._path_loss = LastForward(loss=None)  # the last training forward's
        if config.attribute_attention_retrieve_engaged:
            check_action_feature(schema, config.action_feature)
            check_view_action(config.view_action)
        self.target_match = target_match_from_config(dim, config, schema)

    def _build_distillation(self) -> None:
        """Distillation (gem distill): a teacher's user embedding as one more token, and a
        projection of this model's user embedding for matching the teacher's."""
        config, dim = self.config, self.config.embedding_dim
        self.teacher_token = (nn.Linear(config.teacher_embedding_dim, dim)
                              if config.teacher_embedding_dim else None)
        self.teacher_match = (nn.Linear(config.pma_queries * dim, config.teacher_match_dim)
                              if config.teacher_match_dim else None)
        self._matched_user_embedding: Tensor | None = None

    def _build_interaction(self, moe: Any) -> None:
        """The interaction over each candidate's tokens (dot, Wukong or cross) and the task
        heads."""
        config, schema, dim = self.config, self.embedded_schema, self.config.embedding_dim
        # candidate, target-aware summary, target match, history mean, PMA user tokens, sparse
        # features, dense
        self.num_tokens = (1 + int(config.target_attention)
                           + (self.target_match.tokens if self.target_match is not None else 0)
                           + int(config.attribute_attention)
                           + int(config.history_mean) + config.pma_queries + self.num_context
                           + int(config.teacher_embedding_dim > 0))
        # One channel per token: each position scaled on its own (token_norm).
        self.token_norm = token_norm(config.token_norm, self.num_tokens)
        if config.interaction == "wukong":
            self.interaction = WukongInteraction(
                self.num_tokens, dim, layers=config.wukong_layers, rank=config.wukong_fm_rank,
                fmb_tokens=config.wukong_fmb_tokens, lcb_tokens=config.wukong_lcb_tokens,
                mlp_dim=config.wukong_mlp_dim, hidden=config.interaction_dims,
                dropout=config.dropout, moe=moe if moe and "wukong" in moe.where else None)
        elif config.interaction == "cross":
            self.interaction = self._cross_network(self.num_tokens)
        else:
            self.interaction = DotInteractionMLP(self.num_tokens, dim, config.interaction_dims,
                                                 config.dropout)
        self.multitask = resolve_multitask(config, schema)
        if self.multitask == "esmm" and not set(config.esmm_tasks) <= set(schema.tasks):
            raise GemConfigError(
                f"model.multitask = 'esmm' combines the tasks model.esmm_tasks = "
                f"{list(config.esmm_tasks)}, but the data's tasks are {list(schema.tasks)}: set "
                "model.esmm_tasks to the data's (parent, child) task names, or model.multitask "
                "= 'independent'")
        self.heads = nn.ModuleDict({t: nn.Linear(self.interaction.out_dim, 1)
                                    for t in schema.tasks})
        # One first-order logit per task straight from the candidate's token (candidate_bias).
        self.candidate_bias = (nn.Linear(dim, len(schema.tasks)) if config.candidate_bias
                               else None)
        # One learned offset per id of the named candidate and request features (id_bias),
        # stepped per impression by SGD (gem_core.model.id_bias).
        self.id_bias = (IdBias(config.id_bias, self.schema, len(schema.tasks))
                        if config.id_bias
                        else None)

    def _build_cross_branch(self) -> None:
        """The cross network beside the interaction (``cross_branch``,
        :mod:`gem_core.model.cross_branch`), over every token or the candidate's and the
        request's own: position 0 and the ``num_context`` after the history's summaries (see
        :meth:`_candidate_tokens` for the order), less the tokens of the sparse features of
        :func:`~gem_core.model.cross_branch.cross_branch_skipped`."""
        config = self.config
        self.cross_branch = None
        if not config.cross_branch:
            return
        first_context = self.num_tokens - self.num_context - int(config.teacher_embedding_dim > 0)
        # The context tokens are the sparse features in the schema's order, then dense.
        skipped = {first_context + index for index in cross_branch_skipped(config, self.schema)}
        positions = (range(self.num_tokens) if config.cross_branch_tokens == "all"
                     else [0, *range(first_context, first_context + self.num_context)])
        positions = [position for position in positions if position not in skipped]
        if len(positions) == self.num_tokens:
            positions = None  # every token: no index copy
        self.cross_branch = CrossBranch(self.num_tokens, positions, list(self.schema.tasks),
                                        norm=config.cross_branch_norm,
                                        network=self._cross_network,
                                        opening=config.cross_branch_opening)

    def _cross_network(self, num_tokens: int) -> CrossNetworkInteraction:
        """The DCN-V2 cross network of ``cross_*`` over ``num_tokens`` tokens (the interaction,
        or the branch beside it)."""
        config = self.config
        return CrossNetworkInteraction(
            num_tokens, config.embedding_dim, layers=config.cross_layers,
            rank=config.cross_rank, hidden=config.interaction_dims, dropout=config.dropout,
            multiplier=config.cross_multiplier)

    def user_embedding(self, batch: JaggedBatch) -> Tensor:
        """The upstream output alone: ``(R, pma_queries * embedding_dim)`` flattened PMA user
        tokens, candidate-independent (what ``gem export-user-embeddings`` stores)."""
        if self.pma is None:
            raise ValueError("the user embedding is the PMA output: this model has no PMA "
                             "(model.pma_queries = 0) or no upstream (user_embeddings = "
                             "'cached')")
        return self._forward(batch, upstream_only=True)

    def forward(self, batch: JaggedBatch) -> dict[str, Tensor]:
        """Logits per task, each ``(N,)``: one per candidate (impression)."""
        return self._forward(batch, upstream_only=False)

    def _forward(self, batch: JaggedBatch, upstream_only: bool) -> Any:
        looked_up = self.lookup(self.embeddings, batch)
        requests = self._requests(batch, looked_up)
        history, user_tokens = self._upstream(batch, requests)
        if upstream_only:
            return user_tokens.flatten(1)
        if self.teacher_match is not None:
            self._matched_user_embedding = self.teacher_match(user_tokens.flatten(1))
        # The downstream reads the tower's outputs (one stage) or the raw event tokens (multi
        # stage: the upstream reaches it only through the user tokens, which can be cached).
        history = requests.events if self.config.downstream_history == "events" else history
        # Everything above ran once per request; from here on, once per candidate.
        tokens = self._candidate_tokens(batch, looked_up, requests, history, user_tokens)
        stacked = torch.stack(tokens, dim=1)
        shared = self.interaction(stacked if self.token_norm is None
                                  else self.token_norm(stacked))
        # A copy, not a view of the (N, 1) head output: FSDP2 warns about views returned from
        # a forward (N floats per task, nothing to save by avoiding it).
        logits = {task: head(shared).squeeze(-1).clone() for task, head in self.heads.items()}
        if self.cross_branch is not None:
            crossed = self.cross_branch(stacked)
            logits = {task: logit + crossed[task] for task, logit in logits.items()}
        for first_order in self._first_order(batch, tokens[0]):
            logits = {task: logit + first_order[:, i]
                      for i, (task, logit) in enumerate(logits.items())}
        if self.multitask == "esmm":
            return esmm_logits(logits, *self.config.esmm_tasks)
        return logits

    def _first_order(self, batch: JaggedBatch, candidate: Tensor) -> list[Tensor]:
        """The ``(N, tasks)`` terms added to the logits beside the interaction: the linear
        read of the candidate's token (``candidate_bias``) and the per-id offsets
        (``id_bias``), those the model has."""
        terms = [] if self.candidate_bias is None else [self.candidate_bias(candidate)]
        return terms if self.id_bias is None else [*terms, self.id_bias(batch)]

    def _requests(self, batch: JaggedBatch, looked_up: Any) -> _Requests:
        """The event tokens and the other per-request inputs of the forward."""
        offsets = batch.seq_offsets
        lengths = batch.seq_lengths()
        max_len = max_length(lengths)
        rows = torch.repeat_interleave(torch.arange(batch.batch_size, device=offsets.device),
                                       lengths, output_size=batch.seq_timestamps.shape[0])
        ages = batch.request_timestamps[rows] - batch.seq_timestamps
        events = self.events(looked_up.events, ages, offsets, batch.seq_dense)
        # Non-sequence user/context tokens: candidate-independent, so the tower may see them.
        context = list(looked_up.context)
        if self.dense_proj is not None or self.dense_tokens is not None:
            dense = scale_numbers(batch.dense, self.config.numeric_scale)
        if self.dense_proj is not None:
            context.append(self.dense_proj(dense))
        if self.dense_tokens is not None:
            context += list(self.dense_tokens(dense).unbind(1))
        return _Requests(offsets, lengths, max_len, rows, ages, events, context)

    def _upstream(self, batch: JaggedBatch, requests: _Requests
                  ) -> tuple[Tensor | None, Tensor | None]:
        """The tower's output over the history and the PMA user tokens ``(R, pma_queries, d)``
        (None without PMA); on cached user embeddings, no tower output and the batch's."""
        if self.tower is not None:
            history = self.tower(requests.events, requests.offsets, requests.max_len,
                                 torch.stack(requests.context, dim=1) if len(self.tower.cross)
                                 else None,
                                 timestamps=batch.seq_timestamps)
            user_tokens = (self.pma(history, requests.offsets, requests.max_len)
                           if self.pma is not None else None)
            return history, user_tokens
        if batch.user_embedding is None:
            raise GemConfigError("model.user_embeddings = 'cached' but the batch carries no user "
                                 "embeddings; train on a data set from gem export-user-embeddings")
        return None, batch.user_embedding.view(batch.batch_size, self.config.pma_queries, -1)

    def _candidate_tokens(self, batch: JaggedBatch, looked_up: Any, requests: _Requests,
                          history: Tensor, user_tokens: Tensor | None) -> list[Tensor]:
        """Each candidate's tokens for the interaction, ``(N, d)`` each, in the order
        :attr:`num_tokens` counts them."""
        candidate_offsets = batch.candidate_offsets
        counts = candidate_offsets[1:] - candidate_offsets[:-1]
        max_candidates = max_length(counts)
        owner = torch.repeat_interleave(torch.arange(batch.batch_size,
                                                     device=requests.offsets.device),
                                        counts, output_size=looked_up.candidates.shape[0])
        candidates = _Candidates(candidate_offsets, max_candidates, owner)
        candidate = looked_up.candidates
        candidate_content = self.events.content_vector(batch.candidate_dense)
        if candidate_content is not None:
            candidate = candidate + candidate_content
        if self.candidate_numeric is not None:
            candidate = candidate + self.candidate_numeric(
                scale_numbers(batch.candidate_numeric, self.config.numeric_scale))
        context = [token[owner] for token in requests.context]

        tokens = [candidate]
        if self.target_attention is not None:
            summary, context = self._target_attention(candidate, context, history, requests,
                                                      user_tokens, candidates)
            tokens.append(summary)
        # Sums over a variable number of events (match_token_scale).
        scale = log_magnitude if self.config.match_token_scale == "log" else (lambda x: x)
        if self.target_match is not None:
            matched = self.target_match(history, requests.offsets, owner, batch.candidate_ids,
                                        batch.event_ids, candidate_offsets=candidate_offsets,
                                        max_candidates=max_candidates, ages=requests.ages)
            # the sums are scaled; the latest matches' token (an MLP of bounded inputs) is not
            tokens.append(scale(matched[:, 0]))
            # the latest token, by index: an exported unbind of no tokens does not load
            tokens += [matched[:, i] for i in range(1, self.target_match.tokens)]
        if self.attribute_attention is not None:
            attended = scale(self._attribute_attention(batch, looked_up, requests, history, owner))
            self._path_loss.loss = (self.path_loss(attended, batch.labels)
                                    if self.path_loss is not None and self.training else None)
            tokens.append(attended)
        if self.config.history_mean:
            history_mean = history.new_zeros(batch.batch_size, history.shape[1]).index_add_(
                0, requests.rows, history)
            history_mean = history_mean / requests.lengths.clamp(min=1).unsqueeze(1).to(
                history.dtype)
            tokens.append(history_mean[owner])
        if user_tokens is not None:
            tokens += list(user_tokens[owner].unbind(1))
        tokens += context
        if self.teacher_token is not None:
            if batch.teacher_embedding is None:
                raise GemConfigError("model.teacher_embedding_dim is set but the batch carries no "
                                     "teacher embedding: train it with gem distill "
                                     "(distill.embedding_feature)")
            tokens.append(self.teacher_token(batch.teacher_embedding)[owner])
        return tokens

    def _target_attention(self, candidate: Tensor, context: list[Tensor], history: Tensor,
                          requests: _Requests, user_tokens: Tensor | None,
                          candidates: _Candidates) -> tuple[Tensor, list[Tensor]]:
        """The target-aware summary of the history for each candidate, and the context tokens:
        with ``target_queries = "all"`` they query the history too and get their answers
        added; otherwise they are returned as they are."""
        queries = (torch.stack([candidate, *context], dim=1)
                   if self.config.target_queries == "all" else candidate)
        attended = self.target_attention(queries, history, requests.offsets, requests.max_len,
                                         user_tokens, candidates.candidate_offsets,
                                         candidates.max_candidates)
        if self.config.target_queries != "all":
            return attended, context
        return attended[:, 0], [token + attended[:, 1 + i] for i, token in enumerate(context)]

    def _attribute_attention(self, batch: JaggedBatch, looked_up: Any, requests: _Requests,
                             history: Tensor, owner: Tensor) -> Tensor:
        """Attribute attention's token for each candidate, over its recent events and (with
        ``attribute_attention_retrieve``) the older events retrieved for matching it."""
        tower_output = None if history is requests.events else history
        retrieved = None
        if self.config.attribute_attention_retrieve:
            retrieved = retrieve_matching_events(
                requests.offsets, owner, batch.candidate_ids, batch.event_ids,
                self.attribute_attention.pairs,
                budget=self.config.attribute_attention_retrieve,
                skip_recent=self.config.attribute_attention_history, max_len=requests.max_len,
                engaged=engaged_events(self.config, batch.event_ids))
        return self.attribute_attention(
            looked_up.candidate_vectors, looked_up.event_vectors, requests.events, tower_output,
            requests.offsets, owner, requests.max_len, retrieved)

    # -- the model interface of strategies (gem_core.contracts) -------------------------------

    def parallel_units(self) -> list[nn.Module]:
        """The sequence tower's blocks (none without an upstream tower)."""
        return list(self.tower.blocks) if self.tower is not None else []

    def checkpoint_parts(self, kind: str) -> list[tuple[nn.Module, str]]:
        """``block``: every tower block and every cross-attention layer between them;
        ``attention``/``mlp``: the attention call and the MLP (or MoE) of every block. The
        cross-attention layers live in their own list so that every block keeps the
        ``(x, offsets, max_len) -> x`` form."""
        check_checkpoint_kind(kind)
        if self.tower is None:
            return []
        blocks = [(self.tower.blocks, str(i)) for i in range(len(self.tower.blocks))]
        if kind == "block":
            return blocks + [(self.tower.cross, str(i)) for i in range(len(self.tower.cross))]
        return [(block, kind) for block in self.tower.blocks]

    def moe_layers(self) -> list[tuple[str, nn.Module]]:
        return list(moe_layers(self))

    def output_heads(self) -> list[nn.Module]:
        heads = list(self.heads.values())
        return heads + [self.candidate_bias] if self.candidate_bias is not None else heads

    def stash_points(self) -> dict[str, list[nn.Module]]:
        return modules_of(self, STASH_CLASSES)

    def matched_user_embedding(self) -> Tensor:
        """``(R, teacher_match_dim)``: the projection of the last forward's user embedding that
        distillation's embedding-matching loss compares with the teacher's."""
        if self._matched_user_embedding is None:
            raise ValueError("no matched user embedding: model.teacher_match_dim is 0 or the "
                             "model has not run a forward yet")
        return self._matched_user_embedding

    def auxiliary_losses(self) -> dict[str, Tensor]:
        """The MoE load-balancing losses of the last training forward, weighted."""
        return auxiliary_losses(self)

    def impression_loss_sums(self) -> dict[str, Tensor]:
        """Attribute attention's own loss (``learned_path``) of the last training forward,
        weighted and summed over the impressions."""
        loss = self._path_loss.loss
        return {} if loss is None else {"learned_path": loss}

    def step_stats(self) -> dict[str, float]:
        """Additive per-step counts of the last training forward (summed across ranks by the
        trainer, then passed to ``summarize_step_stats``); empty without MoE."""
        return step_stats(self)

    @staticmethod
    def summarize_step_stats(summed: dict[str, float]) -> dict[str, Any]:
        """Metrics for ``metrics.jsonl`` from ``step_stats`` summed over ranks."""
        return summarize_step_stats(summed)

    def flops_by_module(self, lengths: Tensor, candidates: Tensor | None = None, *,
                        dense: bool = False) -> dict[str, int]:
        """Forward FLOPs per module of a training forward (:func:`forward_flops_by_module`)."""
        return forward_flops_by_module(self, lengths, candidates, dense=dense)

    def flops(self, lengths: Tensor, candidates: Tensor | None = None) -> Mapping[str, int]:
        """Training FLOPs (3 x forward) of one batch of requests with these history lengths
        and ``candidates`` per request (None: one each), jagged and as if every history were
        padded to the batch maximum (where a padded kernel computes every query x key tile)."""
        lengths = lengths.to(torch.int64).cpu()
        max_len = int(lengths.max()) if lengths.numel() else 0
        jagged = self.flops_by_module(lengths, candidates)
        padded = self.flops_by_module(torch.full_like(lengths, max_len), candidates, dense=True)

        def attention(counts: Mapping[str, int]) -> int:
            return sum(v for k, v in counts.items() if k.endswith(".attention"))

        return {
            "total": TRAIN_FACTOR * sum(jagged.values()),
            "attention": TRAIN_FACTOR * attention(jagged),
            "padded_total": TRAIN_FACTOR * sum(padded.values()),
            "padded_attention": TRAIN_FACTOR * attention(padded),
        }


def build_model(config: ModelConfig, schema: FeatureSchema, *, attention: AttentionBackend,
                embedding_backend, norm: NormBackend | None = None) -> GEMModel:
    """The model for ``schema`` with the given attention callable, embedding backend and
    gated-norm backend (default: gem-core's reference)."""
    embeddings = embedding_backend.build(embedding_tables(config, model_schema(config, schema)))
    return GEMModel(config, schema, attention=attention, embeddings=embeddings, norm=norm)
