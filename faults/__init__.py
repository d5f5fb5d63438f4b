"""The fault catalogue: long-running drivers that attack ckptmgr from outside (docs/testing.md).

Each driver is a script with a short form that CI runs (``tests/adversary/test_faults_*.py``) and
a long form on demand:

- :mod:`faults.kill_loop`: SIGKILL the trainer (and, in process mode, the writer process) at
  random moments of ``save_async``; restart it on the same root; after every kill every listed
  step must restore bit-exact. ``python -m faults.kill_loop --kills 1000 --backend s3``.
- :mod:`faults.proxy_loop`: saves and restores through a seeded chaos proxy in front of the S3
  server (resets, 500/503, slow answers, truncated bodies): each either succeeds exactly or
  raises our errors. ``python -m faults.proxy_loop --saves 500``.
- :mod:`faults.disk_loop`: a size-limited tmpfs filled up mid-save, and a root remounted
  read-only (needs root and ``mount``). ``python -m faults.disk_loop --rounds 50``.

Every driver raises :class:`~faults._common.FaultFound` (exit status 1) with what it saw and the
seed that reproduces it, and prints a one-line JSON summary otherwise.
"""
