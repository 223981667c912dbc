"""Sweeps over the model families of the installed transformers under ``attn_implementation="cp_flash"``.

Each sweep builds a tiny model of every family a transformers auto mapping lists, runs it under
context parallelism against eager on one device, and records one outcome per family (exact,
refused before anything ran, or what went wrong); the support pages in ``docs/`` are rendered from
their recorded JSON.

* :mod:`~.configs`: tiny configs of any family, shrunk by rules over attribute names, and their models.
* :mod:`~.compare`: the comparison with the ground truth, its tolerances and the outcome records.
* :mod:`~.family`: every causal-LM family at world size 1 and CP = 2
  (``python -m cp_attention.tools.sweeps.family``; page ``docs/supported_models.md``).
* :mod:`~.heads`: every task head (sequence, token, question answering, masked LM) at CP = 2
  (``python -m cp_attention.tools.sweeps.heads``; page ``docs/supported_heads.md``).
* :mod:`~.vlm_configs`, :mod:`~.vlm`: every image-text-to-text family, a text and an image batch
  (``python -m cp_attention.tools.sweeps.vlm``; page ``docs/supported_vlms.md``).
* :mod:`~.tables`: the tables and pages, rendered from a sweep's JSON record.
* :mod:`~.runner`: one family per process, under a timeout, two at a time.

Nothing here is imported by the package; it needs transformers. Not part of the stable API.
"""
