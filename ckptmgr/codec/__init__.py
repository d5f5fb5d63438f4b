"""One codec for the bytes ckptmgr reads back from storage: torch-free and fsspec-free.

Everything read from a checkpoint root is untrusted until one of these modules has decoded and
validated it: the step directory and file names (:mod:`.layout`), the commit manifest
(:mod:`.manifest`), Python values stored as tagged JSON (:mod:`.values`), the checksum of every
file and item (:mod:`.checksum`), the DCP metadata files (:mod:`.metadata_file`, in either
format: :mod:`.metadata_json` or :mod:`.metadata_columnar`, decoded into the structures of
:mod:`.metadata` and :mod:`.chunks`, whose checks use numpy) and the dtype names they use
(:mod:`.dtypes`). Nothing here imports torch or fsspec, so ``ckptmgr ls``, ``inspect`` and
``verify`` read steps without them; the layers above turn the decoded structures into tensors
and DCP objects.

Import the defining modules (``from ckptmgr.codec.manifest import Manifest``); this package
re-exports nothing.
"""
