"""Test suites any implementation (ours or a third party's) subclasses to prove it conforms.

Importing this package needs ``pytest`` and ``hypothesis`` (gem-core's ``test`` extra); the trainer
never imports it.
"""

from gem_core.testing.attention_conformance import AttentionCase, AttentionConformance, Tolerance
from gem_core.testing.norm_conformance import NormConformance

__all__ = ["AttentionCase", "AttentionConformance", "NormConformance", "Tolerance"]
