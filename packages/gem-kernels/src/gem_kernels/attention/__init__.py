"""Fast jagged attention backends: ``triton`` (kernels in triton_kernels.py, custom op in
triton_op.py) and ``fbgemm`` (FBGEMM's compiled jagged operators). Import the submodules
directly: importing this package imports neither triton nor fbgemm_gpu."""
