"""Benchmarks of gem-kernels, exposed as ``gem bench ...`` commands through the plugin."""
