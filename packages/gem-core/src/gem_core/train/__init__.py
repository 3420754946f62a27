"""The trainer (:mod:`gem_core.train.trainer`: resolves backends, builds the model, runs the loop,
writes the run directory) and the parts it runs. The package imports nothing, so that opening a
trained run (``train.backends``; its checkpoint through :mod:`gem_core.checkpoint`) does not
import the loop."""
