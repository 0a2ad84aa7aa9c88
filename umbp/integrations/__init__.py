"""Adapters that plug the pool into inference engines through the engines' own extension points.

Each subpackage targets one engine and imports that engine only inside itself, so ``import umbp`` never needs an
engine installed. Today: ``umbp.integrations.sglang`` (SGLang 0.5.23: a HiCache L3 storage backend and a direct
KV-store linker).
"""
