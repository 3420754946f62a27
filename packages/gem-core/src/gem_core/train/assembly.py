"""A run's parts, built once from its configuration and plugins: every backend resolved here and
injected (nothing is global), the data source (with a distiller's teacher signals), the time
order, the model, its engine (parallelized, with the optimizer) and the step runner over the
training stream. The trainer (:mod:`gem_core.train.trainer`) is such a run with its loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gem_core.capabilities import FUSED_OPTIMIZER
from gem_core.compile import start_compiled_run
from gem_core.config import GemConfig
from gem_core.contracts import LearningRateFollower
from gem_core.distill.distiller import build_distiller
from gem_core.distributed import ParallelContext, all_reduce_max
from gem_core.embedding import check_fused_optimizer
from gem_core.flops import sample_costs
from gem_core.ids import check_managed_ids
from gem_core.model.building import build_run_model, check_token_norm
from gem_core.model.id_bias import model_schema
from gem_core.parallelize import parallelize
from gem_core.plugins import GemPlugins, build_data_source
from gem_core.train.applied import config_as_source_applies
from gem_core.train.backends import RunBackends, resolve_backends
from gem_core.train.data_fingerprint import data_fingerprint
from gem_core.train.data_log import data_report
from gem_core.train.evaluate import check_validation_parts
from gem_core.train.loss import mean_loss
from gem_core.train.optim import lr_schedule, make_optimizer, schedule_steps
from gem_core.train.random_state import seed_everything
from gem_core.train.table_optimizer import (
    check_id_bias_stepper,
    id_bias_arguments,
    resolve_table_optimizer,
)
from gem_core.train.table_reset import check_table_reset, check_tables_drawable
from gem_core.train.time_order import TimeOrder, check_time_order

log = logging.getLogger(__name__)


class RunAssembly:
    """The parts, built in this order: the random state is seeded before the data source and
    the model draw from it, and a precision recipe calibrates before the model is
    parallelized."""

    def __init__(self, config: GemConfig, plugins: GemPlugins, run_dir: Path,
                 ctx: ParallelContext) -> None:
        self.config, self.ctx = config, ctx
        self.tc = config.train
        self.backends: RunBackends = resolve_backends(config, plugins, ctx)
        self.compiled = start_compiled_run(config, self.backends.attention.spec,
                                           plugins.registry("attention").specs(), run_dir)
        seed_everything(self.tc.seed)
        self.source = build_data_source(self.backends.data, config.data, seed=self.tc.seed)
        # The config as the source applies it (e.g. a data set's own max_seq_len in place of a
        # preset's, a view action's text as its id): what the run records (config.toml,
        # checkpoints) and builds the rest from.
        self.config = config = config_as_source_applies(config, self.source)
        # Where the data's passes end the run before train.steps (train.epochs), the
        # learning-rate schedule ends with them (read before distillation wraps the source).
        self.schedule_steps = schedule_steps(self.tc, self.source.requests_per_pass())
        # Distillation: batches carry the teacher's signals; the loss adds the soft labels.
        self.distiller = build_distiller(config, self.source, ctx)
        if self.distiller is not None:
            self.source = self.distiller.source
        self.schema = self.source.schema
        # data.order = "time": the windows once, each evaluated before it is trained on.
        self.time_order: TimeOrder | None = None
        if config.data.order == "time":
            self.time_order = TimeOrder(
                check_time_order(config, self.backends.data.spec, self.source), self.schema.tasks)
        if self.tc.validation_share:
            # Every rank divides the same split the same way: all refuse together, before a
            # step is trained, when a part would be empty.
            divided = check_validation_parts(
                self.source.eval_batches(batch_size=self.tc.eval_batch_size),
                self.tc.validation_share)
            if ctx.is_main:
                log.info("%s", divided)
        self.lr_schedule = lr_schedule(config)
        check_managed_ids(self.schema, embedding=self.backends.embedding.spec,
                          embedding_sharding=self.backends.embedding_sharding.spec,
                          world_size=ctx.world_size, plugins=plugins)
        check_fused_optimizer(config.model, embedding=self.backends.embedding.spec,
                              embedding_sharding=self.backends.embedding_sharding.spec,
                              world_size=ctx.world_size)
        check_token_norm(config.model, world_size=ctx.world_size)
        # dense_tables = "auto" decided for these backends; "same" refused where it cannot be.
        self.table_optimizer = resolve_table_optimizer(
            config.model.embedding_optimizer, embedding=self.backends.embedding.spec,
            embedding_sharding=self.backends.embedding_sharding.spec,
            dense_sharding=self.backends.dense_sharding.spec, plugins=plugins)
        check_id_bias_stepper(config.model, dense_sharding=self.backends.dense_sharding.spec,
                              plugins=plugins)
        self.model = build_run_model(self.backends, config.model, self.schema)
        if self.tc.tables_each_pass == "reinitialize":
            check_table_reset(tables=self.model.embeddings, embedding=self.backends.embedding.spec,
                              embedding_sharding=self.backends.embedding_sharding.spec,
                              dense_sharding=self.backends.dense_sharding.spec, plugins=plugins,
                              has_passes=self.source.requests_per_pass() is not None,
                              time_order=self.time_order is not None)
        window = config.model.window or None
        self.stream_args = dict(
            batch_size=self.tc.batch_size, rank=ctx.rank, world_size=ctx.world_size,
            balancer=self.backends.balancer.impl,
            cost_fn=lambda b: sample_costs(b.seq_lengths(), window, b.candidate_counts()),
        )
        self._calibrate_precision()
        self.engine = parallelize(
            self.model, ctx=ctx, precision=self.backends.precision,
            embedding_sharding=self.backends.embedding_sharding,
            activation_checkpointing=self.backends.activation_checkpointing,
            dense_sharding=self.backends.dense_sharding,
            make_optimizer=make_optimizer(self.tc, self.table_optimizer,
                                          feature_tables=self.model.embeddings,
                                          **id_bias_arguments(config.model)),
            config=config,
        )
        if self.tc.tables_each_pass == "reinitialize":
            check_tables_drawable(self.model.embeddings, self.backends.dense_sharding.spec.name)
        self._lr_followers = [m for m in self.engine.unwrapped.modules()
                              if isinstance(m, LearningRateFollower)]
        self._say_where_embedding_lr_scale_applies()
        self.stream = self.source.train_stream(**self.stream_args)
        # One step at a time, or a pipeline working ahead (e.g. TorchRec's train pipelines),
        # given the features the model embeds (a pipeline feeds its tables those alone).
        embedded = model_schema(config.model, self.schema)
        self.steps = self.backends.embedding_sharding.impl.step_runner(
            self.stream, model=self.engine.unwrapped, schema=embedded, ctx=ctx,
            options=self.backends.embedding_sharding.options)

    def _say_where_embedding_lr_scale_applies(self) -> None:
        """``train.embedding_lr_scale`` shapes the tables the dense AdamW trains. Where the run's
        feature tables train with an optimizer of their own (an embedding backend with the fused
        optimizer, TorchRec's sharded tables), the scale reaches none of them: a preset's tuned
        scale would be inert without a word, so the start-up log says which learning rate they
        follow instead."""
        scale = self.tc.embedding_lr_scale
        if scale == 1.0:
            return
        chosen = self.table_optimizer
        embedding = self.backends.embedding.spec
        if chosen.dense_tables == "same" and FUSED_OPTIMIZER not in embedding.capabilities:
            if self.config.model.embedding_optimizer.dense_tables == "auto":
                return  # the start-up log has said what the tables train with
            log.warning("train.embedding_lr_scale = %g applies to none of this run's feature "
                        "tables: [model.embedding_optimizer] dense_tables = 'same' steps them with "
                        "%s at lr %g, not AdamW at train.lr x %g", scale, chosen.name, chosen.lr,
                        scale)
            return
        tables = self.model.embeddings
        if any(p.requires_grad for m in tables.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
               for p in m.parameters(recurse=False)):
            return
        if FUSED_OPTIMIZER in embedding.capabilities:
            instead = (f"the embedding backend {embedding.name!r} trains them with "
                       f"[model.embedding_optimizer] ({chosen.name}, lr {chosen.lr:g})")
        else:
            instead = (f"the embedding sharding {self.backends.embedding_sharding.spec.name!r} "
                       "trains them with its own optimizer ([parallel.embedding] optimizer and lr)")
        log.warning("train.embedding_lr_scale = %g applies to none of this run's feature tables: "
                    "%s, not AdamW at train.lr x %g", scale, instead, scale)

    def _calibrate_precision(self) -> None:
        """Recipes that choose by measuring (automatic FP8 selection) see a few training
        batches from a separate stream, so the training stream starts untouched."""
        recipe, options = self.backends.precision.impl, self.backends.precision.options
        count = recipe.calibration_batches_for(options)
        if count == 0:
            return
        stream = self.source.train_stream(**self.stream_args)
        batches = [next(stream).to(self.ctx.device) for _ in range(count)]
        self.model.to(self.ctx.device)
        tasks = self.schema.tasks
        recipe.calibrate(self.model, batches,
                         lambda logits, batch: mean_loss(logits, batch, tasks), options)

    def _data_fingerprint(self) -> dict[str, Any]:
        return data_fingerprint(self.config, self.source.fingerprint())

    def _passes(self) -> int | None:
        """Complete passes over the training data at the last trained batch, or None when the
        stream has none (generated data). With ``train.epochs``, the most of any rank's (a
        collective: every rank calls it), so all ranks stop at the same step."""
        position = self.steps.data_position()
        epoch = position.get("epoch") if isinstance(position, dict) else None
        if not isinstance(epoch, int):
            return None
        if self.tc.epochs and self.ctx.world_size > 1:
            epoch = int(all_reduce_max(torch.tensor([float(epoch)]), self.ctx).item())
        return epoch

    def _windows_trained(self) -> int:
        index, begun = self.time_order.position(self.steps.data_position())
        return index + int(begun)

    def _part_reports(self) -> dict[str, Any]:
        """What the parts report for ``summary.json``."""
        backends = self.backends
        return {
            "precision": backends.precision.impl.summary(),
            # e.g. the TorchRec plan: sharding type and ranks per table
            "embedding_sharding": backends.embedding_sharding.impl.summary(),
            # e.g. expert parallelism's all-to-all bytes per step (this rank's)
            "dense_sharding": self.engine.summary(),
            "backends": backends.describe(),
            **({"compile": self.compiled.summary(self.engine.unwrapped)}
               if self.compiled is not None else {}),
            "data": data_report(self.source),
            **({"distill": self.distiller.summary()} if self.distiller is not None else {}),
        }

