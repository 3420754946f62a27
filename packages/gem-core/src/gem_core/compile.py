"""``train.compile``: the model's forward and backward compiled by ``torch.compile`` (inductor).

What is compiled: each parallel unit of the model (:meth:`StrategyModel.parallel_units`, the GEM
model's sequence-tower blocks), whole (``fullgraph``: a graph break there is an error, not a
silent slowdown), after activation checkpointing has wrapped it and before dense sharding does:
FSDP2's gather/free hooks stay outside the compiled region, a checkpointed block is traced with
its checkpoint (dynamo's activation-checkpoint operator), and parameters keep their names. A model
with no parallel units is compiled whole instead, where graph breaks are allowed. AOTAutograd
compiles the backward of each unit from the same trace.

Jagged batches change the token count every step: the token and batch dimensions of every tensor
argument are marked dynamic before each call (``maybe_mark_dynamic``), so one graph serves every
batch; the longest-history ``max_len`` argument, a Python int, becomes dynamic after the first
value change (dynamo's automatic dynamic shapes): one recompile. Evaluation (no autograd) compiles
once more. The compile-event hook (:class:`CompileTracker`) counts every compilation and its
time, which the trainer reports (``compile_s`` per step in metrics.jsonl, ``compile`` in
summary.json).

Inductor keeps compiled kernels and graphs in ``TORCHINDUCTOR_CACHE_DIR``
(:func:`inductor_cache_dir`), so a second run of the same model skips most of the code
generation and C++ compilation.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from gem_core.attention.choice import check_attention_backend
from gem_core.config import GemConfig
from gem_core.contracts import ActivationCheckpointing, require_strategy_model
from gem_core.distributed import ParallelContext
from gem_core.errors import GemConfigError

#: ``train.compile_mode`` -> ``torch.compile``'s ``mode``.
TORCH_MODES: dict[str, str | None] = {"default": None, "reduce-overhead": "reduce-overhead",
                                      "max-autotune": "max-autotune"}


def check_compile_setup(config: GemConfig, *, attention_spec: Any, installed: list[Any]
                        ) -> None:
    """At start-up: refuse a compiled run whose attention backend does not declare
    ``torch_compile`` (its calls would break the graph of every block), or whose model cannot be
    compiled yet: :func:`gem_core.attention.choice.check_attention_backend`, the one check of
    what a run asks of its attention backend, with ``compile=True``. (Not folded into
    ``resolve_backends``: :func:`gem_core.trained_run.load_run` resolves a compiled run's
    backends too, to run it uncompiled, possibly on another attention backend.)"""
    if config.train.compile:
        check_attention_backend(config.model, attention_spec, installed, compile=True)


def inductor_cache_dir(config: GemConfig, run_dir: Path) -> Path:
    """Where inductor's persistent cache goes: ``train.compile_cache``, else a shared
    ``$TORCHINDUCTOR_CACHE_DIR``, else ``<run_dir>/inductor-cache``."""
    if config.train.compile_cache:
        return Path(config.train.compile_cache)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return run_dir / "inductor-cache"


def use_inductor_cache(directory: Path) -> Path:
    """Point inductor (and Triton, whose cache defaults to a folder of it) at ``directory``
    for this process; set before the first compilation."""
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


def inductor_cache_in_use() -> str:
    """The directory inductor caches in for this process (its default when none was set)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compiler_settings(policy: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``torch._functorch.config`` settings an activation-checkpointing policy asks of the
    compiled step (:meth:`ActivationCheckpointing.compiler_settings`; none for a policy that
    does not implement the contract)."""
    if isinstance(policy, ActivationCheckpointing):
        return dict(policy.compiler_settings(options))
    return {}


class CompiledForward:
    """Stands in for ``module.forward``: what the forward was (the class's, or the stand-in an
    activation-checkpointing policy put there), compiled. Dynamic token/batch dimensions are
    marked on every call; ``settings`` (``torch._functorch.config``, e.g. the activation memory
    budget) are in force while a call compiles.

    It holds the module, not a bound method, so ``copy.deepcopy`` of the model (evaluation
    replicas) gives the copy a compiled forward of its own."""

    def __init__(self, module: nn.Module, inner: Any, *, mode: str, fullgraph: bool,
                 settings: Mapping[str, Any]) -> None:
        self.module, self.inner = module, inner
        self.mode, self.fullgraph, self.settings = mode, fullgraph, dict(settings)
        # Dynamo keeps compiled graphs per code object (``_forward``, shared by every instance)
        # and does not guard on the functorch config: the settings are read while tracing
        # (below), so a graph compiled under other settings fails its guard instead of being
        # reused.
        self.settings_key = repr(sorted(self.settings.items()))
        self.compiled = torch.compile(self._forward, mode=TORCH_MODES[mode], fullgraph=fullgraph)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.settings_key == "":  # never true: makes dynamo guard on the key's value
            raise AssertionError("settings_key is never empty")
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        # type(...).forward, not the instance attribute (which is this object).
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor) and value.dim() > 0:
                # Tokens (or rows, or offsets): every jagged tensor's first dimension varies.
                torch._dynamo.maybe_mark_dynamic(value, 0)
        if not self.settings:
            return self.compiled(*args, **kwargs)
        with torch._functorch.config.patch(self.settings):
            return self.compiled(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> "CompiledForward":
        return CompiledForward(copy.deepcopy(self.module, memo), copy.deepcopy(self.inner, memo),
                               mode=self.mode, fullgraph=self.fullgraph, settings=self.settings)


def compile_module(module: nn.Module, *, mode: str = "default", fullgraph: bool = True,
                   settings: Mapping[str, Any] | None = None) -> None:
    """Replace ``module``'s forward (on the instance) by its compiled version."""
    current = module.__dict__.get("forward")
    if isinstance(current, CompiledForward):
        raise RuntimeError(f"{type(module).__name__} is already compiled")
    module.forward = CompiledForward(module, current, mode=mode, fullgraph=fullgraph,
                                     settings=settings or {})


def compile_model(model: nn.Module, *, ctx: ParallelContext, config: GemConfig,
                  settings: Mapping[str, Any] | None = None) -> list[nn.Module]:
    """Compile ``model``'s parallel units in place (the whole model when it has none) with
    ``train.compile_mode``; return what was compiled."""
    units = require_strategy_model(model, "train.compile", "parallel_units").parallel_units()
    mode = config.train.compile_mode
    if mode == "reduce-overhead" and ctx.device.type != "cuda":
        raise GemConfigError(
            "train.compile_mode = 'reduce-overhead' replays the compiled step as CUDA graphs; "
            f"this run is on {ctx.device.type}: use 'default' or 'max-autotune'")
    for unit in units:
        compile_module(unit, mode=mode, fullgraph=True, settings=settings)
    if not units:
        compile_module(model, mode=mode, fullgraph=False, settings=settings)
        return [model]
    return units


def compiled_units(model: nn.Module) -> int:
    """How many modules of ``model`` run a compiled forward."""
    return sum(isinstance(m.__dict__.get("forward"), CompiledForward) for m in model.modules())


class CompileTracker:
    """Counts compilations and their seconds through dynamo's compile-event hooks (a frame
    traced for the first time or again after a guard failed, a backward compiled lazily), from
    :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.frames = 0
        self.backward = 0
        self._started: float | None = None
        self._read = 0.0
        self._active = False

    def _on_start(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        self._started = time.perf_counter()
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.frames += 1
        elif args.callback_trigger == CallbackTrigger.LAZY_BACKWARD:
            self.backward += 1

    def _on_end(self, args: Any) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None

    def start(self) -> "CompileTracker":
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        self._active = True
        return self

    def stop(self) -> None:
        from torch._dynamo.callback import callback_handler

        if self._active:
            callback_handler.remove_start_callback(self._on_start)
            callback_handler.remove_end_callback(self._on_end)
            self._active = False

    def take_seconds(self) -> float:
        """Compile seconds since the previous call (the trainer's per-step ``compile_s``)."""
        new, self._read = self.seconds - self._read, self.seconds
        return new

    def __enter__(self) -> "CompileTracker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_compiled_run(config: GemConfig, attention_spec: Any, installed: list[Any],
                       run_dir: Path) -> "CompiledRun | None":
    """The trainer's start-up for ``train.compile`` (None when it is off): check the attention
    backend, point inductor at its cache, start counting compilations."""
    if not config.train.compile:
        return None
    check_compile_setup(config, attention_spec=attention_spec, installed=installed)
    return CompiledRun(config, run_dir)


class CompiledRun:
    """The trainer's side of ``train.compile``: the cache, the tracker, the report."""

    def __init__(self, config: GemConfig, run_dir: Path) -> None:
        self.config = config
        self.cache_dir = use_inductor_cache(inductor_cache_dir(config, run_dir))
        self.tracker = CompileTracker().start()
        self.first_step_compile_s: float | None = None

    def step_record(self) -> dict[str, float]:
        """``compile_s`` of the step that just ran (0 when nothing compiled)."""
        seconds = self.tracker.take_seconds()
        if self.first_step_compile_s is None:
            self.first_step_compile_s = seconds
        return {"compile_s": seconds}

    def summary(self, model: nn.Module) -> dict[str, Any]:
        return {
            "mode": self.config.train.compile_mode,
            "units": compiled_units(model),
            "first_step_compile_s": self.first_step_compile_s,
            "compile_s_total": self.tracker.seconds,
            "frames_compiled": self.tracker.frames,
            "backward_compiles": self.tracker.backward,
            "cache_dir": str(self.cache_dir),
        }

    def close(self) -> None:
        self.tracker.stop()
