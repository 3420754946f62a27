"""The ``torchrec`` embedding sharding and the ``torchrec-managed`` embedding backend: what
gem-parallel builds on TorchRec, in one place.

- :mod:`~gem_parallel.torchrec.sharding`: the strategy (what it does to ``model.embeddings`` and
  why), its plan estimate, step runner and summary;
- :mod:`~gem_parallel.torchrec.collection`: the sharded collection that replaces
  ``model.embeddings``;
- :mod:`~gem_parallel.torchrec.plan`: the ``[parallel.embedding]`` options, the sharding types
  TorchRec offers, the planner's constraints, the plan as reported;
- :mod:`~gem_parallel.torchrec.two_d`: ``layout = "2d"``, sharding groups and their replicas;
- :mod:`~gem_parallel.torchrec.pipeline`: TorchRec's train pipelines around GEM's step;
- :mod:`~gem_parallel.torchrec.state`: the tables and their optimizer state in checkpoints;
- :mod:`~gem_parallel.torchrec.inputs`: features as ``KeyedJaggedTensor``;
- :mod:`~gem_parallel.torchrec.managed`: the ``torchrec-managed`` backend (managed-collision id
  remapping).

Nothing is imported here, so that reading the options (:mod:`~gem_parallel.torchrec.plan`)
does not import TorchRec.
"""
