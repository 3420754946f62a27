"""Whether a finished run of this trainer trained and evaluated on the impressions of a peer
export (:mod:`gem_data.peer_export`), so ``tools/peers.py`` may put its figures beside the
peers': the run's ``summary.json`` against the export's ``manifest.json``."""

from __future__ import annotations

from typing import Any

from gem_core.config import DataConfig
from gem_data.peer_export import applied_options

READ_AHEAD_OPTIONS = ("prefetch",)
"""``data.options`` that say how far a file-backed stream reads ahead (in a thread of its own),
never which batches it yields: not compared."""


def run_data_differences(summary: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """The keys on which a run (its ``summary.json``) was trained or evaluated on other data than
    the export, each with both values; empty when the data is the same. A run's ``config``
    records ``[data]`` as its source applied it (a data set's own ``max_seq_len``, an unset
    ``eval_rows`` for its whole eval split), as the manifest does."""
    config = summary.get("config", {})
    data, train = config.get("data", {}), config.get("train", {})
    differences = []

    def compare(key: str, ours: Any, exported: Any) -> None:
        if ours != exported:
            differences.append(f"{key} = {ours!r} (the export: {exported!r})")

    compare("data.source", data.get("source"), manifest["source"])
    if differences:
        return differences
    compare("data.path", data.get("path", ""), manifest["path"])
    compare("data.order", data.get("order", "shuffled"), manifest["order"])
    compare("data.eval_rows", data.get("eval_rows"), manifest["eval_rows"])
    compare("data.max_seq_len", data.get("max_seq_len"), manifest["max_seq_len"])
    compare("train.batch_size", train.get("batch_size"), manifest["batch_size"])
    # The steps trained decide the training impressions: train.steps, or fewer where
    # train.epochs passes over a data set ended first.
    compare(f"run.steps (steps trained; train.steps = {train.get('steps')!r}, train.epochs = "
            f"{train.get('epochs')!r})", summary.get("run", {}).get("steps"), manifest["steps"])
    try:
        options = applied_options(DataConfig(
            source=manifest["source"], options=data.get("options", {}),
            max_seq_len=data.get("max_seq_len") or manifest["max_seq_len"]))
    except Exception as error:  # a run of another version: say why
        return differences + [f"data.options do not read as this version's ({error})"]
    # synthetic-ads: data.options.data_seed counts as the seed it gives (below)
    not_data = READ_AHEAD_OPTIONS + (("data_seed",) if "data_seed" in manifest else ())
    for key in sorted(set(options) | set(manifest["options"])):
        if key not in not_data:
            compare(f"data.options.{key}", options.get(key), manifest["options"].get(key))
    if "data_seed" in manifest:  # synthetic-ads: the generator's seed decides the data
        data_seed = (options["data_seed"] if options.get("data_seed", -1) >= 0
                     else train.get("seed"))
        compare("data seed (data.options.data_seed, else train.seed)", data_seed,
                manifest["data_seed"])
    else:  # a data set's training order is shuffled with train.seed
        compare("train.seed", train.get("seed"), manifest["seed"])
    return differences
