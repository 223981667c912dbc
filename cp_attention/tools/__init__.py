"""Users of the library, not the library: checks, demos and benchmarks built on ``cp_attention``.

* :mod:`~cp_attention.tools.cli`: the ``cp-attention`` command (also ``python -m cp_attention``),
  which hands its command line to one of the three commands below.
* :mod:`~cp_attention.tools.probe`: does context parallelism keep a tiny model's masks?
  (``python -m cp_attention probe``, ``cp-attention probe``)
* :mod:`~cp_attention.tools.demo`: attention on gloo ranks, its error and K/V traffic
  (``python -m cp_attention demo``, ``cp-attention demo``)
* :mod:`~cp_attention.tools.bench`: single-device ``attention`` against SDPA with a dense mask
  (``python -m cp_attention bench``, ``cp-attention bench``)
* :mod:`~cp_attention.tools.harness`: what every benchmark shares (the bench above,
  ``benchmarks/*.py`` and ``benchmarks/gpu_check.py``): timing, the dense-mask oracle, FLOPs of
  the visible pairs, devices and dtypes.
* :mod:`~cp_attention.tools.launch`: run a function on N local gloo ranks (demo, probe, tests).
* :mod:`~cp_attention.tools.tiny_models`: tiny random models of every mask-bearing transformers
  family (probe, examples, tests).
* :mod:`~cp_attention.tools.refusal_page`: docs/refusals.md from the catalogue of refusals.
* :mod:`~cp_attention.tools.sweeps`: sweeps over every family of transformers' auto mappings
  (causal LMs, task heads, image-text-to-text) under cp_flash, and the support pages in ``docs/``
  rendered from their records (``python -m cp_attention.tools.sweeps.family``, ``.heads``, ``.vlm``).

Nothing in the engine imports this package. Not part of the stable API.
"""
