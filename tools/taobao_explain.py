"""Where a trained model's NE goes on a Taobao-shaped log (``tools/taobao_shaped.py``): its eval
logits regressed on the known parts of the click logit, beside the one-pass reference's.

The log's click logit is ``b + user effect + ad effect + 1.5 ENGAGED + 0.3 VIEWED``
(truth.csv holds each part per impression). Per model this prints its NE and calibration, each
part's slope (1: the model carries all of that part, 0: none) and the standard deviation of what
the parts leave of its logit (what the model adds that the generating process does not have),
via :mod:`gem_data.logit_decomposition`. Two models at one NE can differ here: one that carries
half the user's effect, another that carries all of it and adds noise; they need different
fixes. The reference row is the one-pass regression of ``taobao_shaped.py measure`` (the
indicators fitted offline, the ad's and the user's offsets learnt in one pass, ``fisher``):

    gem export-model runs/tiny-s0 --out runs/tiny-s0-export
    gem score runs/tiny-s0-export --data runs/taobao-s0-data --out runs/tiny-s0-score
    python tools/taobao_explain.py --raw runs/taobao-s0 --data runs/taobao-s0-data \\
        --predictions runs/tiny-s0-score/predictions-eval.parquet
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq


def _world():
    """``tools/taobao_shaped.py`` (the log's generator, its truth join and reference)."""
    spec = importlib.util.spec_from_file_location(
        "_taobao_shaped", Path(__file__).resolve().parent / "taobao_shaped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


world = _world()
TruthJoinError = world.TruthJoinError

PARTS = ("user_effect", "ad_effect", "engaged_described", "viewed_described", "ad_described")
"""The known parts of the click logit each model's logits are regressed on: the effects, and the
indicators as the imported tables show them (``*_described``: 0 where the ad has no category
there, so no model can know them; ``ad_described`` itself, which a model does see)."""

REFERENCE = "one-pass reference"


def explain(raw: Path, data: Path, predictions: list[Path]) -> dict[str, dict[str, float]]:
    """Per model (the one-pass reference, then each of ``predictions``: ``gem score``'s
    ``predictions-eval.parquet`` on ``data``'s eval split) its NE, calibration (predicted over
    observed clicks) and the decomposition of its eval logits on :data:`PARTS`; last the
    truth's NE."""
    from gem_data.generator import normalized_entropy_of_probabilities as ne
    from gem_data.logit_decomposition import decompose_logits, logits_of

    truth = world.read_truth(raw)
    if "user_effect" not in truth.column_names:
        raise TruthJoinError(f"{raw / 'truth.csv'} has no user_effect column: it was written "
                             "by an older version of taobao_shaped.py; run generate again "
                             "(same seed: the same tables)")
    splits = {split: world.join_truth(world.imported_impressions(data, split), truth,
                                      f"{data} ({split} split)") for split in ("train", "eval")}

    def column(split: str, name: str) -> np.ndarray:
        return splits[split].column(name).to_numpy().astype(np.float64)

    def indicators(split: str) -> list[np.ndarray]:
        return list(world.indicators_as_seen(splits[split], raw).values())

    parts = dict(zip(PARTS, [column("eval", "user_effect"), column("eval", "ad_effect"),
                             *indicators("eval")]))
    design = {split: np.column_stack([np.ones(splits[split].num_rows), *indicators(split)])
              for split in splits}
    ids = {split: [column(split, "adgroup_id"), column(split, "user")] for split in splits}
    y_eval = column("eval", "clk")
    scored = {REFERENCE: world.one_pass_offsets(
        design["train"], ids["train"], column("train", "clk"), design["eval"], ids["eval"],
        fisher=True)}
    for path in predictions:
        table = pq.read_table(path)
        if not {"row", "clk"} <= set(table.column_names):
            raise TruthJoinError(f"{path}: no row and clk columns (gem score's predictions "
                                 f"have both); it has {table.column_names}")
        values = pc.list_flatten(table.sort_by("row").column("clk")).to_numpy()
        if values.size != y_eval.size:
            raise TruthJoinError(f"{path}: {values.size} scored impressions where the eval "
                                 f"split of {data} has {y_eval.size} (scored on another data "
                                 f"set?)")
        scored[str(path)] = values.astype(np.float64)
    result = {}
    for name, p in scored.items():
        fit = decompose_logits(logits_of(p), parts)
        result[name] = {"ne": ne(p, y_eval), "calibration": float(p.sum() / y_eval.sum()),
                        **{f"slope_{part}": fit.slopes[part] for part in PARTS},
                        "residual_sd": fit.residual_sd, "r_squared": fit.r_squared}
    result["truth"] = {"ne": ne(column("eval", "p_click"), y_eval)}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, required=True,
                        help="the directory taobao_shaped.py generate wrote")
    parser.add_argument("--data", type=Path, required=True, help="gem data import's --out")
    parser.add_argument("--predictions", type=Path, action="append", default=[],
                        help="gem score's predictions-eval.parquet on --data (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        result = explain(args.raw, args.data, args.predictions)
    except TruthJoinError as error:
        sys.exit(f"error: {error}")
    for name, figures in result.items():
        print(f"{name}: " + ", ".join(f"{key} {value:.4f}" for key, value in figures.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
