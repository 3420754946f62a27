"""``gem export-model``: a trained run as ``torch.export`` programs plus a JSON manifest.

The programs (:mod:`gem_core.serving.programs`) are captured with dynamic requests, events,
candidates and multi-valued id counts, saved as ``<program>.pt2`` (``torch.export.save``) and,
with ``aoti=True``, compiled by AOTInductor into ``<program>.aoti.pt2``. Either loads in a
process that has only torch installed (``torch.export.load(path).module()(inputs)`` or
``torch._inductor.aoti_load_package(path)(inputs)``); this repository's readers load them
through :func:`gem_core.serving.loading.load_program`, which refuses code in an archive.
``manifest.json`` names every input with its dtype, symbolic shape and the schema feature it
carries, the outputs, the tasks, the run, the checkpoint step, the attention backend, and the
size and SHA-256 of every file (:mod:`gem_core.serving.integrity`). The export is written to a
staging directory beside ``out`` and published whole (:mod:`gem_core.serving.publish`).

Attention backends declare whether ``torch.export`` can capture them (the ``torch_export``
capability). When the run's backend cannot, the exporter swaps in one that declares it and
everything else the model needs (gem-core's ``padded`` backend when it does; the weights do not
depend on the backend) and says so; a backend the user names explicitly that cannot export is an
error, and so is a model that no installed backend can export. Every export is checked before it
is written: the exported programs score a held-out batch (other sizes than the capture's example)
and must agree with the run's model on its own backend, in memory and once more as loaded back
from the saved file (what ``gem score`` and a server run).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
from torch import Tensor

from gem_core.attention.choice import attention_needs, check_attention_backend
from gem_core.batch import JaggedBatch, select_ids
from gem_core.capabilities import TORCH_EXPORT
from gem_core.contracts import WindowedSource
from gem_core.errors import GemConfigError, GemDataError
from gem_core.jagged import offsets_from_lengths
from gem_core.plugins import build_plugins
from gem_core.schema import schema_to_dict
from gem_core.serving.inputs import batch_inputs, input_specs
from gem_core.serving.integrity import MANIFEST, MANIFEST_FORMAT, record_files
from gem_core.serving.loading import program_from_bytes
from gem_core.serving.programs import RANKER, USER_TOWER, logit_name, programs_of
from gem_core.serving.publish import check_target, staged
from gem_core.trained_run import LoadedRun, load_run

log = logging.getLogger(__name__)

#: The attention backend swapped in when the run's cannot be exported (when it declares what the
#: export of the model needs; else the first installed backend that does).
EXPORT_ATTENTION = "padded"
#: Largest absolute difference between exported and eager outputs the export accepts (float32).
PARITY_TOLERANCE = 1e-5


def _dim_name(name: str) -> str:
    """A Python identifier for ``torch.export.Dim`` from a manifest dim name."""
    return re.sub(r"\W", "_", name)


def dim_names(specs) -> list[str]:
    """The symbolic dims of the inputs ``specs`` (``requests``, ``events``, ...), in order."""
    names: list[str] = []
    for spec in specs:
        for d in spec.shape:
            if isinstance(d, str):
                name = d[:-2] if d.endswith("+1") else d
                if name not in names:
                    names.append(name)
    return names


def dynamic_shapes(specs, minimum: Mapping[str, int] | None = None) -> dict[str, dict[int, Any]]:
    """``torch.export`` dynamic shapes of the inputs ``specs``: one ``Dim`` per symbolic name,
    ``name+1`` for offsets. Every dim is at least 1 (a call scores at least one request, with
    at least one history event and one candidate in all) or its ``minimum``."""
    dims: dict[str, Any] = {}

    def dim(name: str) -> Any:
        if name not in dims:
            dims[name] = torch.export.Dim(_dim_name(name), min=(minimum or {}).get(name, 1))
        return dims[name]

    shapes: dict[str, dict[int, Any]] = {}
    for spec in specs:
        shapes[spec.name] = {i: dim(d[:-2]) + 1 if d.endswith("+1") else dim(d)
                             for i, d in enumerate(spec.shape) if isinstance(d, str)}
    return shapes


def with_candidate_counts(batch: JaggedBatch, copies: Tensor) -> JaggedBatch:
    """``batch`` with candidate ``i`` repeated ``copies[i]`` times within its request (the
    capture's example needs requests of different candidate counts, none of them 1)."""
    index = torch.repeat_interleave(torch.arange(batch.num_candidates), copies)
    counts = torch.zeros(batch.batch_size, dtype=torch.int64).index_add_(
        0, batch.candidate_rows(), copies)
    return attrs.evolve(
        batch, candidate_offsets=offsets_from_lengths(counts),
        candidate_ids={k: select_ids(v, index) for k, v in batch.candidate_ids.items()},
        labels={k: v[index] for k, v in batch.labels.items()},
        candidate_dense=None if batch.candidate_dense is None else batch.candidate_dense[index],
        candidate_numeric=(None if batch.candidate_numeric is None
                           else batch.candidate_numeric[index]))


def capture(program, inputs: dict[str, Tensor], specs,
            minimum: Mapping[str, int] | None = None) -> Any:
    """``torch.export`` of ``program`` on ``inputs`` with every dim of ``specs`` dynamic.

    Size-oblivious reasoning for backed sizes: without it, layout checks (``is_contiguous``
    asks whether a dim is 1) would specialise the program to two or more requests, events or
    candidates, and a server's request of one candidate would fail the program's guards."""
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(program, (inputs,),
                                   dynamic_shapes=(dynamic_shapes(specs, minimum),))


def capture_with_minimums(name: str, program, inputs: dict[str, Tensor], specs, *,
                          may_specialise: bool) -> tuple[Any, dict[str, int]]:
    """:func:`capture`, and the smallest size of each dim the program accepts. Only a model
    with layers that cannot run a size of 1 the same way as larger sizes (``may_specialise``:
    the mixture-of-experts layers specialise on more than one history event) may raise a dim's
    minimum, to 2, logged; the manifest records it and the program's guard refuses a smaller
    input by name. Any other model whose capture specialises is refused, naming the dims: a
    server's request of one candidate (or one event) would fail the program's guard, so it is a
    bug in the model's code, not a limit to ship."""
    minimum = {d: 1 for d in dim_names(specs)}
    for _ in range(len(minimum) + 1):
        try:
            return capture(program, inputs, specs, minimum), minimum
        except torch._dynamo.exc.UserError as error:
            found = [d for d in minimum
                     if f"Not all values of {_dim_name(d)} " in str(error) and minimum[d] == 1]
            if not found:
                raise GemConfigError(f"torch.export cannot capture program {name!r}: "
                                     f"{str(error).splitlines()[0]}") from error
            if not may_specialise:
                raise GemConfigError(
                    f"program {name!r} specialises on {', '.join(found)} > 1: it would refuse a "
                    f"request of one, and only a mixture-of-experts model may export with such "
                    f"a minimum; the export was not written (torch.export: "
                    f"{str(error).splitlines()[0]})") from error
            log.warning("program %r specialises on %s > 1: it accepts 2 or more", name,
                        ", ".join(found))
            minimum.update({d: 2 for d in found})
    raise GemConfigError(f"torch.export cannot capture program {name!r}")


def example_batches(run: LoadedRun) -> tuple[JaggedBatch, JaggedBatch]:
    """Two batches of the run's eval split (in time order, which holds nothing out: of its
    newest window): the capture's example (3 requests of 2-4 candidates) and a held-out check
    batch (5 other requests of 1-3 candidates)."""
    source = run.source
    if run.config.data.order == "time" and isinstance(source, WindowedSource):
        batch = next(iter(source.window_eval_batches(len(source.windows()) - 1, batch_size=8)))
    else:
        batch = next(iter(source.eval_batches(batch_size=8)))
    if batch.batch_size < 8:
        raise GemConfigError(f"the eval split of {run.run_dir} has fewer than 8 requests; the "
                             "export needs 8 to check itself")
    example = batch.select(torch.arange(3))
    example = with_candidate_counts(example, torch.arange(example.num_candidates) % 3 + 2)
    held_out = batch.select(torch.arange(3, 8))
    held_out = with_candidate_counts(held_out, torch.arange(held_out.num_candidates) % 3 + 1)
    return example, held_out


def _output_specs(name: str, run: LoadedRun) -> list[dict[str, Any]]:
    if name == USER_TOWER:
        width = run.config.model.pma_queries * run.config.model.embedding_dim
        return [{"name": "user_embedding", "dtype": "float32", "shape": ["requests", width],
                 "what": "upstream user embedding (flattened PMA user tokens)"}]
    out = []
    for task in run.schema.tasks:
        out.append({"name": task, "dtype": "float32", "shape": ["candidates"],
                    "what": f"probability of {task!r} per candidate"})
        out.append({"name": logit_name(task), "dtype": "float32", "shape": ["candidates"],
                    "what": f"logit of {task!r} per candidate"})
    return out


def _program_inputs(program, batch: JaggedBatch, run: LoadedRun) -> dict[str, Tensor]:
    if "user_embedding" in program.groups and batch.user_embedding is None:
        with torch.no_grad():
            batch = attrs.evolve(batch, user_embedding=run.model.user_embedding(batch))
    return batch_inputs(batch, program.model.schema, program.groups)


def _eager_outputs(name: str, run: LoadedRun, batch: JaggedBatch) -> dict[str, Tensor]:
    """What the run's model on its own backend gives for ``batch`` (the parity reference)."""
    with torch.no_grad():
        if name == USER_TOWER:
            return {"user_embedding": run.model.user_embedding(batch)}
        logits = run.model(batch)
    out = {task: torch.sigmoid(logit) for task, logit in logits.items()}
    out.update({logit_name(task): logit for task, logit in logits.items()})
    return out


def resolve_export_attention(run_dir: Path, attention: str | None,
                             step: int | None) -> tuple[LoadedRun, LoadedRun, dict[str, Any]]:
    """The run on its own backends (the parity reference), the run on a backend that exports,
    and the manifest's account of the choice."""
    plugins = build_plugins()
    registry = plugins.registry("attention")
    reference = load_run(run_dir, step=step, plugins=plugins)
    model, run_spec = reference.config.model, reference.backends.attention.spec
    run_backend = run_spec.name
    if attention is not None:  # named: it exports, or the export stops (never a fallback)
        check_attention_backend(model, registry.get(attention), registry.specs(), export=True)
        chosen = load_run(run_dir, step=step, backends={"attention": attention}, plugins=plugins)
        return reference, chosen, {"run": run_backend, "exported": attention,
                                   "swapped": attention != run_backend, "chosen_by": "user"}
    if TORCH_EXPORT in run_spec.capabilities:
        return reference, reference, {"run": run_backend, "exported": run_backend,
                                      "swapped": False, "chosen_by": "run"}
    needs = attention_needs(model, export=True)
    able = [spec.name for spec in registry.specs() if needs.keys() <= spec.capabilities]
    if not able:  # names the run's backend, what it lacks and that none has everything
        check_attention_backend(model, run_spec, registry.specs(), export=True)
    swap = EXPORT_ATTENTION if EXPORT_ATTENTION in able else able[0]
    log.warning("attention backend %r of %s does not declare %s; exporting with %r, which "
                "declares what the export needs, instead", run_backend, run_dir, TORCH_EXPORT,
                swap)
    chosen = load_run(run_dir, step=step, backends={"attention": swap}, plugins=plugins)
    return reference, chosen, {
        "run": run_backend, "exported": swap, "swapped": True, "chosen_by": "export",
        "why": f"{run_backend!r} does not declare the {TORCH_EXPORT!r} capability"}


def _check_parity(name: str, got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> float:
    worst = 0.0
    for key, expected in want.items():
        diff = (float((got[key] - expected).abs().max().detach()) if expected.numel()
                else 0.0)
        if not diff <= PARITY_TOLERANCE:
            raise GemConfigError(f"exported program {name!r} disagrees with the run's model on "
                                 f"{key!r} by {diff:.3g} (> {PARITY_TOLERANCE}) on a held-out "
                                 "batch; the export was not written")
        worst = max(worst, diff)
    return worst


def export_model(run_dir: Path, out: Path, *, attention: str | None = None,
                 step: int | None = None, aoti: bool = False) -> dict[str, Any]:
    """Export ``run_dir`` into ``out`` (replacing an export there only once the new one is
    complete); returns the manifest (also written as ``out/manifest.json``). ``attention``:
    the backend to export with (must declare ``torch_export`` and what the model needs; None:
    the run's, or one that does when the run's cannot export)."""
    check_target(Path(out))
    reference, run, attention_info = resolve_export_attention(Path(run_dir), attention, step)
    if run.config.model.teacher_embedding_dim:
        raise GemConfigError(
            f"{run_dir} is a distilled student that reads its teacher's user embedding as an "
            f"input (model.teacher_embedding_dim = {run.config.model.teacher_embedding_dim}, "
            "from distill.embedding_feature); the export has no input for it yet: distil "
            "without embedding_feature for a student that serves on its own")
    managed = [t.name for t in run.schema.tables if t.id_policy == "managed"]
    if managed:
        raise GemConfigError(
            f"{run_dir} has tables with id_policy 'managed' ({', '.join(managed)}): their rows "
            "come from TorchRec's managed-collision remapper, which the export cannot capture "
            "yet; export a run whose tables use the 'hash' policy")
    example, held_out = example_batches(run)
    with staged(Path(out)) as staging:
        programs = _write_programs(run, reference, example, held_out, staging, aoti)
        manifest = {
            "format": MANIFEST_FORMAT, "run": str(run_dir), "checkpoint_step": run.step,
            "checkpoint": str(run.checkpoint), "preset": run.config.name,
            "tasks": list(run.schema.tasks), "attention": attention_info,
            "torch_version": torch.__version__,
            "multi_stage": USER_TOWER in programs,
            "user_embedding_dim": (run.config.model.pma_queries * run.config.model.embedding_dim
                                   if RANKER in programs else 0),
            "programs": programs, "schema": schema_to_dict(run.schema),
            "parity_tolerance": PARITY_TOLERANCE,
            "files": record_files(staging),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_programs(run: LoadedRun, reference: LoadedRun, example: JaggedBatch,
                    held_out: JaggedBatch, staging: Path, aoti: bool) -> dict[str, Any]:
    """Capture, check and save every program of ``run`` into ``staging``; their manifest
    entries. Each saved ``.pt2`` must pass the loaders' rules
    (:func:`gem_core.serving.archive.inspect_program`), load, and score the held-out batch as
    the eager model does: an export that ``gem score`` would refuse or misread is not
    written."""
    programs: dict[str, Any] = {}
    for name, program in programs_of(run.model, run.backends.attention.impl).items():
        specs = input_specs(program.model.schema, program.groups)
        started = time.perf_counter()
        exported, minimum = capture_with_minimums(
            name, program, _program_inputs(program, example, run), specs,
            may_specialise=run.config.model.moe.enabled)
        capture_s = time.perf_counter() - started
        check_inputs = _program_inputs(program, held_out, run)
        with torch.no_grad():
            got = exported.module()(check_inputs)
        parity = _check_parity(name, got, _eager_outputs(name, reference, held_out))
        path = staging / f"{name}.pt2"
        torch.export.save(exported, path)
        # What serves is the file, not the program in memory: a program can run in memory and
        # still not load (torch 2.x's deserializer fails on an unbind with no outputs), so the
        # saved file is loaded back as gem score loads it and must score as the capture did.
        try:
            reloaded = program_from_bytes(path.read_bytes(), Path(path.name))
        except GemDataError as error:
            raise GemConfigError(f"program {name!r} as torch {torch.__version__} saved it would "
                                 f"be refused by gem score ({error}); the export was not "
                                 "written") from None
        with torch.no_grad():
            parity = max(parity, _check_parity(f"{name} (loaded from its file)",
                                               reloaded(check_inputs),
                                               _eager_outputs(name, reference, held_out)))
        entry: dict[str, Any] = {
            "file": path.name, "groups": list(program.groups),
            "inputs": [{**attrs.asdict(s), "shape": list(s.shape)} for s in specs],
            "outputs": _output_specs(name, run),
            "min_sizes": minimum,
            "capture_s": round(capture_s, 2), "parity_max_abs_diff": parity}
        if aoti:
            entry["aoti_file"] = _compile_aoti(exported, staging / f"{name}.aoti.pt2", name,
                                               check_inputs, got)
        programs[name] = entry
        log.info("exported %s (%.1f s, max |exported - eager| %.2g)", name, capture_s, parity)
    return programs


def _compile_aoti(exported, path: Path, name: str, inputs: Mapping[str, Tensor],
                  want: Mapping[str, Tensor]) -> str:
    """Compile ``exported`` with AOTInductor into ``path``; the compiled program must agree with
    the exported one on ``inputs``."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    try:
        aoti_compile_and_package(exported, package_path=str(path))
    except Exception as error:  # noqa: BLE001 - a compiler/toolchain failure, reported whole
        raise GemConfigError(f"AOTInductor could not compile program {name!r} on this machine "
                             f"({type(error).__name__}: {str(error).splitlines()[0][:300]}); "
                             "export without --aoti for the plain .pt2") from error
    got = aoti_load_package(str(path))(dict(inputs))
    _check_parity(f"{name} (AOTInductor)", got, want)
    return path.name

