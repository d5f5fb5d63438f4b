"""One home for the checkpoint formats that are not ckptmgr's own, both directions.

- :mod:`.safetensors` and :mod:`.torch_save`: weights files, read by ``load_initial`` and written
  by ``ckptmgr export`` (one dtype table each, shared by the reader and the writer);
- :mod:`.hf`: Hugging Face model directories (index and shards), and which reader a source takes;
- :mod:`.plain_dcp`: checkpoints written by plain ``torch.distributed.checkpoint`` (torch_xla,
  torchtitan, ``dcp.save``): restored in place and imported as steps of a root, both only with
  ``trusted=True`` (DCP's metadata is pickle);
- :mod:`.files`: reading untrusted local files, shared by the readers.

Our own byte format is :mod:`ckptmgr.codec` (decoding, torch-free) and :mod:`ckptmgr.dcp`.
Import the defining modules; this package re-exports nothing.
"""
