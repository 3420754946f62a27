"""Fused gated normalisation (LayerNorm or RMSNorm, affine, times a gate), the memory-bound work
around HSTU-style attention: ``out = norm(x) * weight (+ bias), then * gate``.

``reference.py`` is the pure-PyTorch definition; ``triton_op.py`` the fused Triton kernels as a
custom op with autograd. Import the submodules directly (this package imports nothing heavy).
"""
