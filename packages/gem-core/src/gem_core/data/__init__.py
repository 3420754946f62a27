"""The data-source contract, and gem-core's small generated data set (``synthetic``)."""

from gem_core.data.api import (
    Balancer,
    DataSource,
    IndexedStream,
    TrainStream,
    contiguous_balancer,
    local_share,
)

__all__ = ["Balancer", "DataSource", "IndexedStream", "TrainStream", "contiguous_balancer",
           "local_share"]
