"""The trainer (:mod:`gem_core.train.trainer`: resolves backends, builds the model, runs the loop,
writes the run directory) and the parts it runs. The package imports nothing, so that reading a
checkpoint (``train.backends``, ``train.checkpointer``, ``train.resume``) does not import the
loop."""
