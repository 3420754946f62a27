"""How the attention conformance suite draws its cases: jagged lengths clustered around the
backend's tile size, mask parameters and shapes, with hypothesis. The sizing attributes here are
the ones a backend's test class overrides (see :class:`gem_core.testing.AttentionConformance`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gem_core.attention.api import AttentionParams
from gem_core.capabilities import NORMALIZATIONS
from gem_core.testing.attention_oracle import AttentionCase

if TYPE_CHECKING:
    from hypothesis import strategies as st

SHAPES = ("self", "cross", "pma")
MASK_FEATURES = ("causal", "window", "prefix", "targets")


class AttentionCaseDrawing:
    """What the drawn cases may contain and how big they get; the drawing itself."""

    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    """Input dtypes the backend accepts; each drawn case picks one."""

    shapes: ClassVar[tuple[str, ...]] = SHAPES
    normalizations: ClassVar[tuple[str, ...]] = NORMALIZATIONS
    mask_features: ClassVar[tuple[str, ...]] = MASK_FEATURES
    """Self-attention mask features supported: ``causal``, ``window``, ``prefix``, ``targets``."""

    max_tokens: ClassVar[int] = 160
    """Upper bound of the q tokens and of the kv tokens of one drawn batch."""

    max_batch: ClassVar[int] = 4
    block_size: ClassVar[int] = 32
    """The backend's tile size: drawn lengths cluster around it and its multiples."""

    head_dims: ClassVar[tuple[int, ...]] = (16, 32)
    max_heads: ClassVar[int] = 2
    max_examples: ClassVar[int] = 10
    """Hypothesis examples per test; raise it for a thorough local run."""

    derandomize: ClassVar[bool] = True
    """Draw the same examples every run, so CI failures reproduce."""

    # ----------------------------------------------------------------------------------------
    # Drawing cases.
    # ----------------------------------------------------------------------------------------

    def _length(self, data: st.DataObject, max_len: int, label: str) -> int:
        from hypothesis import strategies as st

        block = self.block_size
        special = [n for n in (0, 1, 2, block - 1, block, block + 1, 2 * block + 1) if n <= max_len]
        return data.draw(st.one_of(st.sampled_from(special), st.integers(0, max_len)), label=label)

    def _lengths(self, data: st.DataObject, batch: int, max_len: int, label: str) -> list[int]:
        return [self._length(data, max_len, f"{label}[{b}]") for b in range(batch)]

    def _params(self, data: st.DataObject, shape: str, max_len: int) -> AttentionParams:
        from hypothesis import strategies as st

        normalization = data.draw(st.sampled_from(self.normalizations), label="normalization")
        scale = data.draw(st.sampled_from([None, None, 0.5]), label="scale")
        if shape != "self":
            return AttentionParams(normalization=normalization, scale=scale)
        features = self.mask_features
        causal = data.draw(st.booleans(), label="causal") if "causal" in features else False
        window = None
        if "window" in features:
            block = self.block_size
            window = data.draw(
                st.one_of(
                    st.none(),
                    st.sampled_from([0, 1, 3, block - 1, block + 3, max_len + 5]),
                    st.integers(0, max_len + 2),
                ),
                label="window",
            )
        prefix = 0
        if "prefix" in features:
            prefix = data.draw(
                st.one_of(st.just(0), st.integers(1, 4), st.just(self.block_size + 1)),
                label="num_prefix",
            )
        return AttentionParams(
            causal=causal, window=window, num_prefix=prefix, normalization=normalization,
            scale=scale,
        )

    def _draw_case(self, data: st.DataObject, shape: str) -> AttentionCase:
        from hypothesis import strategies as st

        batch = data.draw(st.integers(1, self.max_batch), label="batch")
        long_len = max(1, self.max_tokens // batch)
        short_len = min(4, long_len)
        if shape == "self":
            q_lengths = self._lengths(data, batch, long_len, "lengths")
            kv_lengths = q_lengths
        elif shape == "cross":  # every history token attends to a few feature tokens
            q_lengths = self._lengths(data, batch, long_len, "q_lengths")
            kv_lengths = [data.draw(st.integers(0, short_len), label=f"kv_lengths[{b}]")
                          for b in range(batch)]
        else:  # PMA: a few queries over the whole history
            q_lengths = [data.draw(st.integers(0, short_len), label=f"q_lengths[{b}]")
                         for b in range(batch)]
            kv_lengths = self._lengths(data, batch, long_len, "kv_lengths")
        params = self._params(data, shape, long_len)
        num_targets = None
        if shape == "self" and "targets" in self.mask_features and data.draw(st.booleans()):
            num_targets = tuple(
                data.draw(st.integers(0, min(n, 4)), label=f"num_targets[{b}]")
                for b, n in enumerate(q_lengths)
            )
        return AttentionCase(
            shape=shape,
            q_lengths=tuple(q_lengths),
            kv_lengths=tuple(kv_lengths),
            params=params,
            num_targets=num_targets,
            heads=data.draw(st.integers(1, self.max_heads), label="heads"),
            head_dim=data.draw(st.sampled_from(self.head_dims), label="head_dim"),
            dtype=data.draw(st.sampled_from(self.dtypes), label="dtype"),
            seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        )

    def _settings(self) -> Any:
        from hypothesis import HealthCheck, settings

        return settings(
            max_examples=self.max_examples,
            deadline=None,
            derandomize=self.derandomize,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
