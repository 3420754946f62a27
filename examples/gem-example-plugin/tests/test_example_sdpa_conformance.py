"""example-sdpa passes gem-core's attention conformance suite: softmax against the reference on
drawn jagged batches (self, cross and PMA shapes, masks, gradients), and refuses what it does not
declare (silu, a relative bias) by name. Run it with the plugin installed, so the suite reads the
registration's declared capabilities: ``pytest examples/gem-example-plugin/tests``."""

from __future__ import annotations

import torch
from gem_example_plugin.attention import SdpaAttention

from gem_core.testing import AttentionConformance


class TestExampleSdpaConformance(AttentionConformance):
    registered_as = "example-sdpa"
    dtypes = (torch.float32,)
    normalizations = ("softmax",)
    max_tokens = 96
    max_examples = 4  # raise for a thorough local run

    def make_backend(self):
        return SdpaAttention()
