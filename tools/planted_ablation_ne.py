"""What a model that learned only part of a planted kind of ``synthetic-ads`` reaches: the eval NE
of logistic regressions on subsets of the true click logit's inputs.

    python tools/planted_ablation_ne.py --planted order --max-length 64 [--seed 0]

The generating process's click logit is a weighted sum of the kind's planted indicators, its
affinity and four request-level terms (``gem_data.planted``, ``gem_data.generator``). A
regression on all of them reproduces the achievable NE; one on the affinity and the request
terms alone is what a model reaches that found nothing of the planted pattern; and one per
indicator left out says what that indicator is worth. A trained model's eval NE read against
these rows says which parts it learned (e.g. on ``order``: the existence of the two kinds of
event, or also their order). Fitted with ``gem_data.indicator_ne.fit_logistic`` on 16,384
training requests, evaluated on the 8,192 eval requests ``gem train`` reports the achievable NE
on (``--max-length`` is ``data.options.max_length``, which defaults to ``data.max_seq_len``).
"""

from __future__ import annotations

import argparse

import numpy as np

from gem_data.generator import (
    EVAL_CHUNK_ROWS,
    AdsLogGenerator,
    PlantedChunk,
    normalized_entropy_of_probabilities,
)
from gem_data.indicator_ne import fit_logistic, sigmoid
from gem_data.planted import INDICATOR_NAMES
from gem_data.synth_options import PLANTED_KINDS, SynthOptions

TRAIN_ROWS, EVAL_ROWS = 16384, 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planted", choices=[k for k in PLANTED_KINDS if k in INDICATOR_NAMES],
                        required=True)
    parser.add_argument("--max-length", type=int, required=True,
                        help="longest history (data.options.max_length = data.max_seq_len)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = AdsLogGenerator(SynthOptions(planted=args.planted, max_length=args.max_length),
                                seed=args.seed)
    train = [generator.chunk_with_indicators(min(EVAL_CHUNK_ROWS, TRAIN_ROWS - start),
                                             split="train", index=index)
             for index, start in enumerate(range(0, TRAIN_ROWS, EVAL_CHUNK_ROWS))]
    evals = [generator.chunk_with_indicators(size, split="eval", index=index)
             for index, size in generator.eval_chunks(EVAL_ROWS)]
    names = INDICATOR_NAMES[args.planted]

    def design(chunks: list[PlantedChunk], kept: list[int]) -> np.ndarray:
        return np.concatenate([np.hstack([np.ones((c.indicators.shape[0], 1)),
                                          c.indicators[:, kept], c.request_terms])
                               for c in chunks])

    labels = np.concatenate([c.batch.labels["click"].numpy() for c in train]).astype(np.float64)
    eval_labels = np.concatenate([c.batch.labels["click"].numpy() for c in evals])
    truth = np.concatenate([c.probabilities["click"] for c in evals])
    print(f"{args.planted}, seed {args.seed}, histories up to {args.max_length} events: "
          f"achievable click NE {normalized_entropy_of_probabilities(truth, eval_labels):.4f}")
    everything = list(range(len(names)))
    rows = [("every input", everything),
            ("the affinity and request terms only", [names.index("affinity")])]
    rows += [(f"every input but {name}", [j for j in everything if j != i])
             for i, name in enumerate(names) if name != "affinity"]
    for label, kept in rows:
        weights = fit_logistic(design(train, kept), labels)
        ne = normalized_entropy_of_probabilities(sigmoid(design(evals, kept) @ weights),
                                                 eval_labels)
        print(f"  regression on {label}: click NE {ne:.4f}")


if __name__ == "__main__":
    main()
