"""Has a trained model learnt which categories are siblings? (``synthetic-ads``, ``hierarchy``)

For each run: the category vectors as attribute attention compares them (the table's rows,
RMS-normalised, through the query and key maps where ``model.attribute_attention_maps`` is on),
the cosine of every pair of distinct categories, and the AUC with which that cosine tells
siblings (one parent, the world's hidden hierarchy) from the other pairs: 0.5 means the vectors
say nothing about the hierarchy, 1.0 that every sibling pair is closer than every other pair.

    .venv/bin/python tools/hierarchy_siblings.py runs/A runs/B ...
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from gem_core.trained_run import load_run


def pair_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """The probability that a random positive pair scores above a random negative one (ties
    count half)."""
    pos, neg = scores[positive], scores[~positive]
    above = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(above / (pos.size * neg.size))


def sibling_figures(run_dir: str) -> dict[str, float]:
    run = load_run(run_dir)
    model = run.model
    if run.config.data.options.get("planted") != "hierarchy":
        raise SystemExit(f"{run_dir}: not a hierarchy run (data.options.planted)")
    if model.attribute_attention is None:
        raise SystemExit(f"{run_dir}: the model has no attribute attention")
    parent = run.source.generator.planted_world.category_parent
    pairs = model.attribute_attention.pairs
    slot = [i for i, (candidate, _) in enumerate(pairs) if candidate == "category"][0]
    rows = model.embeddings.tables.category.weight.detach().double()
    attention = model.attribute_attention.double()
    # every category as a candidate's (query side) and as an event's (key side) attribute
    stacked = rows[:, None, :].expand(-1, len(pairs), -1)
    queries = attention.compared(stacked, attention.query_maps)[:, slot]
    keys = attention.compared(stacked, attention.key_maps)[:, slot]
    cosine = (queries @ keys.T / rows.shape[1]).numpy()
    distinct = ~np.eye(len(parent), dtype=bool)
    siblings = (parent[:, None] == parent[None, :])[distinct]
    return {"sibling_auc": pair_auc(cosine[distinct], siblings),
            "sibling_cosine": float(cosine[distinct][siblings].mean()),
            "other_cosine": float(cosine[distinct][~siblings].mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    for run_dir in parser.parse_args().runs:
        figures = sibling_figures(run_dir)
        print(f"{run_dir}: sibling AUC {figures['sibling_auc']:.3f}, cosine of siblings "
              f"{figures['sibling_cosine']:+.3f}, of other pairs {figures['other_cosine']:+.3f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
