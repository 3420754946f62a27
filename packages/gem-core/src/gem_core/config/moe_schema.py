"""``[model.moe]``: mixture of experts in place of the dense model's MLPs (a section of
:class:`gem_core.config.model_schema.ModelConfig`)."""

from __future__ import annotations

import attrs

from gem_core.config.validators import at_least, choice, each, greater_than


@attrs.frozen(kw_only=True)
class MoeConfig:
    """Mixture of experts in place of the dense model's MLPs (``[model.moe]``); off while
    ``num_experts`` is 0."""

    num_experts: int = attrs.field(default=0, validator=at_least(0))
    """Routed experts per MoE layer, each the size of the MLP it replaces; 0: no MoE."""

    top_k: int = attrs.field(default=2, validator=greater_than(0))
    """Experts each token (sequence layers) or sample (Wukong layers) is routed to."""

    capacity_factor: float = attrs.field(default=1.25, validator=at_least(0))
    """An expert takes at most ``ceil(capacity_factor * rows * top_k / num_experts)``
    assignments per forward; the rest are dropped (first choices before second choices, earlier
    rows first) and their rows keep only the residual and the shared expert. 0: no limit."""

    shared_expert: bool = False
    """Add one always-on expert of the same size that every row goes through."""

    aux_loss_weight: float = attrs.field(default=0.01, validator=at_least(0))
    """Weight of the Switch/GShard load-balancing loss ``E * sum_e f_e * P_e`` per layer,
    added to the training loss."""

    where: tuple[str, ...] = attrs.field(default=("sequence",), converter=tuple,
                                         validator=each(choice("sequence", "wukong")))
    """MLPs that become MoE: ``sequence`` (the SwiGLU of every sequence layer) and/or
    ``wukong`` (the MLP of every Wukong factorization-machine block)."""

    impl: str = attrs.field(default="grouped", validator=choice("reference", "grouped"))
    """``reference``: experts run one after another over their tokens; ``grouped``: tokens
    sorted by expert and all expert matmuls batched (torch._grouped_mm where it runs)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def __attrs_post_init__(self) -> None:
        if self.enabled and self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts "
                             f"({self.num_experts})")
        if self.enabled and not self.where:
            raise ValueError("where must name at least one of sequence, wukong")
