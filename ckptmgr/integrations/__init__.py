"""Adapters for training frameworks: :mod:`ckptmgr.integrations.lightning` (a Lightning
``CheckpointIO``). Each imports its framework, so import the module you use directly."""
