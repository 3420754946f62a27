"""Whole-data-set checks and descriptions behind ``gem data validate`` and ``gem data inspect``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gem_core.errors import GemDataError

from gem_data import format as fmt
from gem_data.dataset import DatasetReader, open_parquet, split_units
from gem_data.manifest import read_manifest


def validate_dataset(directory: Path) -> dict[str, Any]:
    """Check every row group of every split with the strict policy; one error per bad row group
    (or per unreadable file), each naming file, row group, row, feature and value."""
    errors: list[str] = []
    try:
        reader = DatasetReader(directory)
    except GemDataError as error:
        return {"directory": str(directory), "rows_checked": 0, "row_groups": 0,
                "errors": [str(error)]}
    checked = 0
    broken_files: set[str] = set()
    for split in reader.manifest.splits:
        for unit in split_units(reader.manifest, split):
            if unit.file in broken_files:
                continue
            try:
                reader.read(unit)
            except GemDataError as error:
                errors.append(str(error))
                if not reader.opened(unit.file):  # the file itself failed to open
                    broken_files.add(unit.file)
                continue
            checked += 1
    return {"directory": str(directory), "rows_checked": reader.report.rows_checked,
            "row_groups": checked, "errors": errors}


def describe_dataset(directory: Path) -> dict[str, Any]:
    """Rows, history events, length distribution and label rates per split, schema, id spaces."""
    manifest = read_manifest(directory)
    splits = {}
    for split, files in manifest.splits.items():
        lengths, labels = [], {task: [] for task in manifest.schema.tasks}
        for entry in files:
            open_parquet(directory / entry.path, manifest.schema)
            columns = [fmt.HISTORY_ITEM] + [fmt.label_column(t) for t in manifest.schema.tasks]
            table = pq.read_table(directory / entry.path, columns=columns)
            lengths.append(pc.list_value_length(table.column(fmt.HISTORY_ITEM)).to_numpy())
            for task in manifest.schema.tasks:
                labels[task].append(table.column(fmt.label_column(task)).to_numpy())
        n = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        splits[split] = {
            "rows": manifest.rows(split),
            "history_events": manifest.tokens(split),
            "files": [entry.path for entry in files],
            "row_groups": sum(len(entry.row_groups) for entry in files),
            "history_length": _percentiles(n),
            "empty_histories": float((n == 0).mean()) if n.size else 0.0,
            "label_rate": {task: float(np.concatenate(v).mean()) if v else 0.0
                           for task, v in labels.items()},
        }
    data = manifest.to_dict()
    return {"directory": str(directory), "splits": splits, "schema": data["schema"],
            "id_spaces": data["id_spaces"], "info": manifest.info}


def _percentiles(lengths: np.ndarray) -> dict[str, float]:
    if lengths.size == 0:
        return {}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"mean": float(lengths.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": int(lengths.max())}
