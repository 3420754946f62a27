"""``[parallel.embedding] pipeline``: the steps of a ``torchrec``-sharded run through TorchRec's
train pipelines, so that the all-to-alls of the sparse lookups overlap the dense compute.

- ``sparse-dist``: TorchRec's ``TrainPipelineSparseDist``. While batch i computes, the ids of
  batch i+1 are already on their way to the tables' owners (``input_dist``: the splits all-to-all
  runs during batch i's step, the values' all-to-all is launched right after it), and batch i+2
  is fetched. The lookups and every update happen in the same order as without the pipeline:
  the numbers are the same (tested).
- ``semi-sync``: TorchRec's ``TrainPipelineSemiSync``. Batch i+1's vectors are also looked up
  (and their output all-to-all launched) before batch i's sparse update lands, so each step's
  lookups see the tables one update late; the dense parameters are not delayed. Close to
  ``none``, not equal (checked for convergence).

How GEM's step runs inside them. TorchRec's pipelines trace a model whose sharded modules take
attributes of the batch (``torch.fx``); GEM's model is not traceable and keeps the sharded
modules outside its module tree (:mod:`gem_parallel.torchrec.sharding`). So the pipeline gets a
small traceable stage (:class:`SparseInputs`: the sharded ``EmbeddingBagCollection`` and
``EmbeddingCollection`` called on the batch's two ``KeyedJaggedTensor``\\ s) and a
``custom_model_fwd`` that runs the trainer's whole step (forward, loss, backward, clipping, the
guard, the dense optimizer step, its metrics) on the batch. TorchRec swaps the sharded modules'
``forward`` for its pipelined forward, so when the model looks up the batch's ids, the tables
answer from the input distribution the pipeline already ran. The step has done the backward and
the optimizer step by the time TorchRec would: the pipeline gets an empty loss to backpropagate
and an optimizer with nothing to do (:class:`StepAlreadyTaken`); TorchRec's ordering of the
rest is unchanged. The batches are :class:`PipelinedBatch` es: the ``JaggedBatch`` with the two
KJTs built from it on the host (ids mapped by each table's id policy and checked against the
table, as the model's forward does) and the stream position after it, so a checkpoint records
the position of the last batch *trained*, not of the ones fetched ahead
(:mod:`gem_core.train.step_pipeline`).

CPU. ``TrainPipelineSparseDist`` runs on CPU over gloo as it is (no CUDA streams: the
copies and input distribution run inline, the all-to-alls asynchronously in gloo's threads).
``TrainPipelineSemiSync`` does not, in TorchRec 1.8: ``EmbeddingPipelinedForward`` takes the
device to be ``cuda`` when the pipeline has no data-distribution stream (``BaseForward``) and
calls ``torch.cuda.current_stream()``; its ``detach_embeddings`` and the pipeline's
``start_embedding_lookup`` call ``record_stream`` with the current CPU stream, which CPU tensors
refuse. :class:`_SemiSyncPipeline` and :class:`_EmbeddingForward` change exactly those for CPU
(no stream to record, nothing to wait for); on CUDA they are TorchRec's own. The KJTs come
from the collection's ``lookup_inputs``, as the plain forward's do: on CPU with
``table_row_wise`` tables the pooled lookups are padded to the largest batch of any rank
(gloo cannot all-gather the different sizes in TorchRec's backward).

Refused, with the reason: tables with ``id_policy = "managed"`` (their remappers run inside the
model's forward, all ranks' ids together, and insert ids: doing that ahead for a prefetched batch
would change what an earlier batch saw); ``semi-sync`` with ``layout = "2d"`` (the replicas are
averaged inside the forward, after semi-sync has already looked the batch up).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)
from torchrec.distributed.train_pipeline.utils import _start_embedding_lookup, _wait_for_events
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from gem_core.batch import JaggedBatch
from gem_core.contracts import StepRunner, TrainStream
from gem_core.distributed import ParallelContext
from gem_core.embedding import check_ids
from gem_core.errors import GemConfigError
from gem_core.jagged import Jagged
from gem_core.model.features import FeatureLookup
from gem_core.schema import FeatureSchema
from gem_core.train.step_pipeline import PositionedBatch, PositionedBatches

log = logging.getLogger(__name__)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a batch field (tensors, jagged tensors, mappings of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Jagged):
        yield value.values
        yield value.offsets
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


class PipelinedBatch(Pipelineable):
    """A training batch as TorchRec's pipelines want it (``Pipelineable``: ``to`` and
    ``record_stream``): the batch, the KJTs of its pooled and its sequence tables' features
    (None when the model has no such table) and where the stream stood after it."""

    def __init__(self, batch: JaggedBatch, *, pooled: KeyedJaggedTensor | None,
                 sequence: KeyedJaggedTensor | None, positioned: PositionedBatch) -> None:
        self.batch, self.pooled, self.sequence = batch, pooled, sequence
        self.positioned = positioned

    def to(self, device: torch.device, non_blocking: bool = False) -> PipelinedBatch:
        def move(kjt: KeyedJaggedTensor | None) -> KeyedJaggedTensor | None:
            return None if kjt is None else kjt.to(device, non_blocking=non_blocking)

        return PipelinedBatch(self.batch.to(device), pooled=move(self.pooled),
                              sequence=move(self.sequence), positioned=self.positioned)

    def record_stream(self, stream: torch.Stream | torch.cpu.Stream) -> None:
        if isinstance(stream, torch.cpu.Stream) or stream.device.type == "cpu":
            return  # CPU memory is not ordered by streams: nothing to record
        for kjt in (self.pooled, self.sequence):
            if kjt is not None:
                kjt.record_stream(stream)
        for name in self.batch.__attrs_attrs__:
            for tensor in _tensors(getattr(self.batch, name.name)):
                tensor.record_stream(stream)


class SparseInputs(nn.Module):
    """What the pipeline traces: the sharded modules called on the batch's KJTs (attributes of
    the batch only, as TorchRec's pipelines require). Never called for its outputs: TorchRec
    finds the sharded modules' inputs in its graph and runs their input distribution ahead."""

    def __init__(self, pooled: nn.Module | None, sequence: nn.Module | None) -> None:
        super().__init__()
        self.ebc, self.ec = pooled, sequence

    def forward(self, batch: PipelinedBatch) -> tuple[Any, Any]:
        pooled = self.ebc(batch.pooled) if self.ebc is not None else None
        sequence = self.ec(batch.sequence) if self.ec is not None else None
        return pooled, sequence


class StepAlreadyTaken(torch.optim.Optimizer):
    """The optimizer TorchRec's pipeline steps: nothing, because GEM's step (run as the
    pipeline's ``custom_model_fwd``) has already stepped the dense optimizer, and the fused
    sparse optimizer updates inside the backward."""

    def __init__(self) -> None:  # no parameters: torch.optim.Optimizer would refuse an empty list
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}
        self.defaults: dict[str, Any] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self, closure: Callable[[], float] | None = None) -> None:
        return None


class _EmbeddingForward(EmbeddingPipelinedForward):
    """TorchRec's semi-sync pipelined forward, with the CPU device when there is no
    data-distribution stream (TorchRec assumes ``cuda`` then) and no ``record_stream`` of a
    pooled output on CPU (CPU tensors refuse it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    def detach_embeddings(self, embeddings: Any, cur_stream: torch.Stream) -> None:
        if self._device.type != "cpu" or not isinstance(embeddings, KeyedTensor):
            return super().detach_embeddings(embeddings, cur_stream)
        # TorchRec's pooled branch without its record_stream.
        tensor = embeddings.values()
        detached = tensor.detach().requires_grad_()
        detached.retain_grad()
        embeddings._values = detached
        self._context.embedding_tensors.append([tensor])
        self._context.embedding_features.append([list(embeddings.keys())])
        self._context.detached_embedding_tensors.append([detached])
        return None


class _SemiSyncPipeline(TrainPipelineSemiSync):
    """``TrainPipelineSemiSync`` with :class:`_EmbeddingForward` and, on CPU, the embedding
    lookup of the next batch started without streams to record."""

    _pipelined_forward_type = _EmbeddingForward

    def start_embedding_lookup(self, batch: Any, context: Any) -> None:
        if self._device.type != "cpu":
            return super().start_embedding_lookup(batch, context)
        if batch is None:
            return None
        _wait_for_events(batch, context, None)
        for module in self._pipelined_modules:
            _start_embedding_lookup(module, context, source_stream=None, target_stream=None,
                                    stream_context=self._stream_context)
        return None


class PipelinedSteps(StepRunner):
    """The trainer's steps through one of TorchRec's train pipelines (see the module
    docstring)."""

    def __init__(self, stream: TrainStream, collection: nn.Module, *, schema: FeatureSchema,
                 ctx: ParallelContext, kind: str, options: Any) -> None:
        managed = [name for name in collection.remappers]
        if managed:
            raise GemConfigError(
                f"parallel.embedding.pipeline = {kind!r} cannot run with table(s) "
                f"{', '.join(managed)} of id_policy 'managed': their ids are remapped inside the "
                "model's forward, all ranks' together, and remapping a prefetched batch ahead "
                "would change the rows earlier batches saw; use pipeline = 'none' with them")
        if kind == "semi-sync" and options.layout == "2d":
            raise GemConfigError(
                "parallel.embedding.pipeline = 'semi-sync' cannot run with layout = '2d': the "
                "replicas are averaged inside the forward, after semi-sync has already looked "
                "the batch up; use pipeline = 'sparse-dist' (exact) with the 2d layout")
        self.kind = kind
        self._collection = collection
        self._sharded = collection.sharded_modules()
        self._lookup = FeatureLookup(schema)
        self._positions = PositionedBatches(stream)
        self._batches = map(self._prepare, self._positions)
        self._step: Callable[[JaggedBatch], dict[str, Any]] | None = None
        self.pipelined_modules: list[str] = []
        """``ebc`` (pooled tables) and/or ``ec`` (sequence tables), once the first step ran."""
        stage = SparseInputs(self._sharded.ebc, self._sharded.ec)
        common = dict(model=stage, optimizer=StepAlreadyTaken(), device=ctx.device,
                      execute_all_batches=True, custom_model_fwd=self._run_step_on)
        if kind == "sparse-dist":
            self.pipeline: TrainPipelineSparseDist = TrainPipelineSparseDist(**common)
        else:
            # From the first batch on (TorchRec's default waits 900 batches), without stashing
            # the dense gradients: the dense update is not delayed.
            self.pipeline = _SemiSyncPipeline(**common, start_batch=0, stash_gradients=False)

    def _prepare(self, positioned: PositionedBatch) -> PipelinedBatch:
        """The batch's KJTs, from the ids the model's forward would hand the tables."""
        features = self._lookup.inputs(positioned.batch)
        for config in self._collection.table_configs.values():
            for feature in config.features:
                # Before the ids travel: TorchRec's kernels do not check them.
                check_ids(features[feature].values, config, feature)
        # The KJTs the forward would build (on CPU with table_row_wise tables, the pooled one
        # padded to the largest batch of any rank): the tables answer from these.
        pooled, sequence = self._collection.lookup_inputs(features)
        return PipelinedBatch(positioned.batch, positioned=positioned, pooled=pooled,
                              sequence=sequence)

    def _run_step_on(self, batch: PipelinedBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        assert self._step is not None
        record = self._step(batch.batch)
        self._positions.trained(batch.positioned)
        # The step has backpropagated already: TorchRec's backward of an empty loss is a no-op.
        return torch.zeros(0, requires_grad=True), record

    def run_step(self, step: Callable[[JaggedBatch], dict[str, Any]]) -> dict[str, Any]:
        self._step = step
        try:
            record = self.pipeline.progress(self._batches)
        finally:
            self._step = None
        if not self.pipelined_modules:
            self._check_pipelined()
        return record

    def _check_pipelined(self) -> None:
        """After the first step: TorchRec found the sharded modules in the traced stage and
        swapped their forwards; a pipeline that pipelines nothing would silently be ``none``."""
        stage = self.pipeline._model  # TorchRec keeps the traced stage and what it rewrote
        names = {id(module): name for name, module in stage.named_children()}
        self.pipelined_modules = sorted(names[id(m)] for m in self.pipeline._pipelined_modules
                                        if id(m) in names)
        expected = sorted(name for name, module in stage.named_children() if module is not None)
        if self.pipelined_modules != expected:
            raise RuntimeError(f"TorchRec's {type(self.pipeline).__name__} pipelined "
                               f"{self.pipelined_modules or 'no module'} of {expected}")
        log.info("torchrec pipeline %s: the lookups' input distribution runs a batch ahead "
                 "for %s", self.kind, ", ".join(self.pipelined_modules))

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``: the pipeline and the sharded modules it pipelined."""
        torchrec_class = (TrainPipelineSparseDist if self.kind == "sparse-dist"
                          else TrainPipelineSemiSync)
        return {"kind": self.kind, "torchrec_class": torchrec_class.__name__,
                "pipelined_modules": self.pipelined_modules}

    def data_position(self) -> dict[str, Any]:
        return self._positions.data_position()
