"""Second, independent computations of the numbers the reports print.

Each module here recomputes one command's report from the raw tensors that command dumps,
written from the report's definition in ``docs/`` alone: plain numpy and mpmath, slow and
obvious, sharing no code with the fast layer or the report code (an import-linter contract in
``pyproject.toml`` forbids it).  :mod:`ropestep.reference.atlas` covers ``ropestep atlas``;
:mod:`ropestep.reference.families` covers ``ropestep train-families`` from its checkpoints
(docs/math.md section 12); :mod:`ropestep.reference.validate` the reconstruction, reuse,
calibration and descent sections of ``ropestep validate`` (docs/protocol.md section 12);
:mod:`ropestep.reference.heads` every computed field of ``ropestep heads`` from its ``--dump-raw``
dump of W_q, W_k and the RoPE tables (docs/protocol.md section 13).
"""
