"""The attention conformance suite: subclass it to prove a backend computes the reference function.

Usage, in a backend's own tests::

    class TestMyAttention(AttentionConformance):
        dtypes = (torch.float32, torch.bfloat16)
        max_tokens = 128            # keep small for slow interpreters

        def make_backend(self):
            return MyAttention()

Every test draws jagged batches with hypothesis (lengths 0 and 1, just below, at and above
``block_size``, windows smaller and larger than the sequences, contextual prefix and target tokens)
for the three shapes of the GEM model (self-attention, cross-attention with a long query over a
short K/V, PMA with a short query over a long K/V) and both normalisations, and compares the output
and the gradients of q, k and v with the reference backend computed in float64 on the same
(already rounded) inputs. Tolerances are per dtype (:attr:`AttentionConformance.tolerances`).

Capabilities a backend does not declare are not drawn; instead the suite checks that asking for
them raises an error whose message names the missing capability (no silent fallback).

The relative attention bias (:mod:`gem_core.attention.relative_bias`) is an optional capability
the backend's registration declares (``"relative_bias"`` in its spec's ``capabilities``; set
:attr:`AttentionConformance.registered_as` to the registered name): a backend that declares
it is compared, forward and gradients of q, k, v and both bias weight tables, with a float64
padded oracle written independently here (:func:`padded_biased_attention`); one that does not
must refuse a bias with an error naming ``relative_bias``.

pytest and hypothesis are imported inside the tests, so :meth:`AttentionConformance.check_case`
also serves scripts on machines without them (``python -m gem_kernels.bench.gpu_check``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from gem_core.attention.api import AttentionParams
from gem_core.attention.relative_bias import RelativeBias
from gem_core.capabilities import NORMALIZATIONS, RELATIVE_BIAS
from gem_core.testing.attention_checks import AttentionCaseChecks
from gem_core.testing.attention_drawing import AttentionCaseDrawing
from gem_core.testing.attention_oracle import (
    DEFAULT_TOLERANCES,
    AttentionCase,
    BiasSpec,
    Tolerance,
    padded_biased_attention,
)

if TYPE_CHECKING:
    from hypothesis import strategies as st

# Importable from here as before the suite's parts moved out (backends' tests and
# norm_conformance import the case and tolerance types from this module).
__all__ = ["DEFAULT_TOLERANCES", "AttentionCase", "AttentionCaseChecks", "AttentionCaseDrawing",
           "AttentionConformance", "BiasSpec", "Tolerance", "padded_biased_attention"]


class AttentionConformance(AttentionCaseChecks):
    """Base class of an attention backend's conformance tests. Override :meth:`make_backend`.

    Class attributes declare what the backend supports and size the drawn cases (those are
    inherited from :class:`~gem_core.testing.attention_checks.AttentionCaseChecks` and
    :class:`~gem_core.testing.attention_drawing.AttentionCaseDrawing`); override them in the
    subclass. Keep ``max_tokens`` and ``max_examples`` small for interpreted kernels.
    """

    def test_registration_declares_the_tested_normalizations(self) -> None:
        """The normalisations the registration declares (what a run checks at start-up) are
        the ones this suite proves; the others are refused (see the undeclared test)."""
        import pytest

        if self.registered_as is None:
            pytest.skip("not a registered backend (registered_as is None)")
        declared = self.declared_capabilities() & set(NORMALIZATIONS)
        assert declared == set(self.normalizations), (
            f"attention backend {self.registered_as!r} declares normalisations "
            f"{sorted(declared)} but its conformance suite tests {sorted(self.normalizations)}")

    # ----------------------------------------------------------------------------------------
    # The relative bias (each case compared by AttentionCaseChecks.check_bias_case).
    # ----------------------------------------------------------------------------------------

    bias_max_examples: ClassVar[int | None] = None
    """Hypothesis examples of :meth:`test_relative_bias`; None: :attr:`max_examples`."""

    def _draw_bias(self, data: st.DataObject, max_len: int) -> BiasSpec:
        from hypothesis import strategies as st

        return BiasSpec(
            num_position_buckets=data.draw(
                st.sampled_from([1, 2, 5, self.block_size + 3, max_len + 5]),
                label="num_position_buckets"),
            num_time_buckets=data.draw(st.sampled_from([0, 1, 7, 24]), label="num_time_buckets"),
            time_bucket_divisor=data.draw(st.sampled_from([0.301, 0.5]),
                                          label="time_bucket_divisor"),
        )

    def _skip_unless_bias(self) -> None:
        import pytest

        if not self.declares_relative_bias():
            pytest.skip(f"backend does not declare the {RELATIVE_BIAS} capability")
        if "self" not in self.shapes:
            pytest.skip("backend does not declare the self shape")

    def test_relative_bias(self) -> None:
        """Drawn self-attention cases (every declared mask feature and normalisation) with a
        relative position bias and, in most, a time bias."""
        from hypothesis import given
        from hypothesis import strategies as st

        self._skip_unless_bias()
        settings = self._settings()
        if self.bias_max_examples is not None:
            from hypothesis import settings as with_settings

            settings = with_settings(settings, max_examples=self.bias_max_examples)

        @settings
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            case = self._draw_case(data, "self")
            long_len = max(1, self.max_tokens // len(case.q_lengths))
            self.check_case(attrs.evolve(case, bias=self._draw_bias(data, long_len)))

        run()

    def test_relative_bias_fixed_cases(self) -> None:
        """Causal, windowed (with prefix and targets where declared) and full attention, in every
        normalisation, over samples empty, of length 1 and across block boundaries; then a batch
        without tokens."""
        self._skip_unless_bias()
        features = self.mask_features
        block = self.block_size
        lengths = (block + 5, 0, 1, 2 * block + 3)
        lengths = tuple(min(n, self.max_tokens // len(lengths)) for n in lengths)
        spec = BiasSpec(num_position_buckets=block // 2 + 3, num_time_buckets=24)
        configs = [AttentionParams()]
        if "causal" in features:
            configs.append(AttentionParams(causal=True))
        configs.append(AttentionParams(
            causal="causal" in features,
            window=block // 2 + 1 if "window" in features else None,
            num_prefix=3 if "prefix" in features else 0))
        for normalization in self.normalizations:
            for n, params in enumerate(configs):
                targets = None
                if n == len(configs) - 1 and "targets" in features:
                    targets = tuple(min(2, x) for x in lengths)
                self.check_case(AttentionCase(
                    shape="self", q_lengths=lengths, kv_lengths=lengths,
                    params=attrs.evolve(params, normalization=normalization),
                    num_targets=targets, heads=self.max_heads, head_dim=self.head_dims[0],
                    dtype=self.dtypes[0], seed=5 + n, bias=spec if n % 2 == 0 else
                    attrs.evolve(spec, num_time_buckets=0),
                ))
        for lengths in ((0, 0), (1,), (0, 1, 1, 0)):
            self.check_case(AttentionCase(
                shape="self", q_lengths=lengths, kv_lengths=lengths,
                params=AttentionParams(normalization=self.normalizations[0]), num_targets=None,
                heads=1, head_dim=self.head_dims[0], dtype=self.dtypes[0], seed=1, bias=spec,
            ))

    def test_relative_bias_needs_self_attention(self) -> None:
        """A declared relative bias is refused for cross-attention (different offsets)."""
        import pytest

        self._skip_unless_bias()
        backend = self.make_backend()
        d = self.head_dims[0]
        x = torch.randn(9, 1, d, dtype=self.dtypes[0], device=self.device)
        y = torch.randn(3, 1, d, dtype=self.dtypes[0], device=self.device)
        bias = RelativeBias(position_weights=torch.randn(1, 4, device=self.device))
        with pytest.raises(ValueError, match="self-attention"):
            backend(x, y, y, torch.tensor([0, 5, 9], device=self.device),
                    torch.tensor([0, 2, 3], device=self.device),
                    params=AttentionParams(normalization=self.normalizations[0]), bias=bias)

    def test_undeclared_relative_bias_raises_naming_it(self) -> None:
        """A backend that does not declare ``relative_bias`` must refuse a bias by that name."""
        import pytest

        if self.declares_relative_bias():
            pytest.skip(f"backend declares {RELATIVE_BIAS}")
        backend = self.make_backend()
        d = self.head_dims[0]
        x = torch.randn(9, 1, d, dtype=self.dtypes[0], device=self.device)
        offsets = torch.tensor([0, 5, 9], device=self.device)
        bias = RelativeBias(position_weights=torch.randn(1, 4, device=self.device),
                            time_weights=torch.randn(1, 3, device=self.device),
                            timestamps=torch.arange(9, device=self.device))
        with pytest.raises((NotImplementedError, ValueError, TypeError)) as caught:
            backend(x, x, x, offsets, offsets,
                    params=AttentionParams(normalization=self.normalizations[0]), bias=bias)
        assert RELATIVE_BIAS in str(caught.value), (
            f"an undeclared {RELATIVE_BIAS} raised {caught.value!r}, which does not name it")

    def _run_drawn(self, shape: str) -> None:
        import pytest
        from hypothesis import given
        from hypothesis import strategies as st

        if shape not in self.shapes:
            pytest.skip(f"backend does not declare the {shape} shape")

        @self._settings()
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            self.check_case(self._draw_case(data, shape))

        run()

    # ----------------------------------------------------------------------------------------
    # The tests.
    # ----------------------------------------------------------------------------------------

    def test_self_attention(self) -> None:
        self._run_drawn("self")

    def test_cross_attention(self) -> None:
        self._run_drawn("cross")

    def test_pma(self) -> None:
        self._run_drawn("pma")

    def test_every_mask_feature_at_once(self) -> None:
        """A fixed case with everything on, across block boundaries, in every normalisation."""
        import pytest

        if "self" not in self.shapes:
            pytest.skip("backend does not declare the self shape")
        features = self.mask_features
        block = self.block_size
        lengths = (block + 5, 0, 1, 2 * block + 3)
        lengths = tuple(min(n, self.max_tokens // len(lengths)) for n in lengths)
        for normalization in self.normalizations:
            params = AttentionParams(
                causal="causal" in features,
                window=block // 2 + 1 if "window" in features else None,
                num_prefix=3 if "prefix" in features else 0,
                normalization=normalization,
            )
            self.check_case(AttentionCase(
                shape="self", q_lengths=lengths, kv_lengths=lengths, params=params,
                num_targets=tuple(min(2, n) for n in lengths) if "targets" in features else None,
                heads=self.max_heads, head_dim=self.head_dims[0], dtype=self.dtypes[0], seed=7,
            ))

    def test_empty_sequences_give_zeros(self) -> None:
        """Samples without tokens (or without keys) are valid: zeros out, finite gradients."""
        for shape in self.shapes:
            q_lengths, kv_lengths = (0, 3, 0), (0, 3, 0)
            if shape == "cross":
                q_lengths, kv_lengths = (5, 3, 0), (0, 2, 0)
            elif shape == "pma":
                q_lengths, kv_lengths = (2, 0, 0), (0, 0, 5)
            for normalization in self.normalizations:
                self.check_case(AttentionCase(
                    shape=shape, q_lengths=q_lengths, kv_lengths=kv_lengths,
                    params=AttentionParams(normalization=normalization), num_targets=None,
                    heads=1, head_dim=self.head_dims[0], dtype=self.dtypes[0], seed=3,
                ))
        # A batch with no tokens at all.
        self.check_case(AttentionCase(
            shape="self", q_lengths=(0, 0), kv_lengths=(0, 0), params=AttentionParams(),
            num_targets=None, heads=1, head_dim=self.head_dims[0], dtype=self.dtypes[0], seed=0,
        ))

    def test_rejects_mismatched_batches(self) -> None:
        import pytest

        backend = self.make_backend()
        dtype = self.dtypes[0]
        q = torch.randn(4, 1, self.head_dims[0], dtype=dtype, device=self.device)
        with pytest.raises(ValueError):
            backend(q, q, q, torch.tensor([0, 4], device=self.device),
                    torch.tensor([0, 2, 4], device=self.device), params=AttentionParams())

    def test_undeclared_capabilities_raise_naming_them(self) -> None:
        """What a backend does not declare must fail loudly, never fall back silently."""
        import pytest

        backend = self.make_backend()
        dtype = self.dtypes[0]
        d = self.head_dims[0]
        lengths = torch.tensor([0, 5, 9], device=self.device)
        x = torch.randn(9, 1, d, dtype=dtype, device=self.device)
        short = torch.tensor([0, 2, 3], device=self.device)
        y = torch.randn(3, 1, d, dtype=dtype, device=self.device)
        unsupported: list[tuple[str, tuple, dict]] = []
        for feature, params, targets in (
            ("causal", AttentionParams(causal=True), None),
            ("window", AttentionParams(window=2), None),
            ("prefix", AttentionParams(num_prefix=1), None),
            ("targets", AttentionParams(), torch.tensor([1, 1], device=self.device)),
        ):
            if feature not in self.mask_features and "self" in self.shapes:
                unsupported.append((feature, (x, x, x, lengths, lengths),
                                    {"params": params, "num_targets": targets}))
        for normalization in NORMALIZATIONS:
            if normalization not in self.normalizations:
                unsupported.append((normalization, (x, x, x, lengths, lengths),
                                    {"params": AttentionParams(normalization=normalization)}))
        if "cross" not in self.shapes:
            unsupported.append(("cross", (x, y, y, lengths, short), {"params": AttentionParams()}))
        if "pma" not in self.shapes:
            unsupported.append(("pma", (y, x, x, short, lengths), {"params": AttentionParams()}))
        if not unsupported:
            pytest.skip("backend declares every capability the suite knows")
        for name, args, kwargs in unsupported:
            with pytest.raises((NotImplementedError, ValueError, TypeError)) as caught:
                backend(*args, **kwargs)
            assert name in str(caught.value), (
                f"unsupported {name!r} raised {caught.value!r}, which does not name it"
            )
