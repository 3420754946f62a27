"""The data-source contract, and gem-core's small generated data set (``synthetic``)."""

from gem_core.data.api import (
    Balancer,
    DataSource,
    TrainStream,
    contiguous_balancer,
    local_share,
)

__all__ = ["Balancer", "DataSource", "TrainStream", "contiguous_balancer", "local_share"]
