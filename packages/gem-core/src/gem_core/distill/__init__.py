"""Knowledge distillation from a trained GEM run into a student run (``gem distill``).

:func:`resolve_distillation` fills the model options a ``[distill]`` section implies (from the
teacher's config); :func:`build_distiller` gives the trainer a :class:`Distiller`: a data source
whose batches carry the teacher's signals (computed online, or read from a data set written by
``gem distill-precompute``), optionally corrected by a fitted Student Adapter, and the student's
loss (hard labels, soft labels with temperature, embedding matching).

The trainer imports :mod:`gem_core.distill.distiller` and :mod:`gem_core.distill.setup`
directly; this package module imports nothing, so that opening a teacher
(:mod:`gem_core.distill.teacher` -> ``gem_core.trained_run`` -> ``gem_core.train``) never finds
it half initialised.
"""
