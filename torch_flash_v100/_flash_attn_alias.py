"""``import flash_attn`` served by torch_flash_v100, for code that cannot be edited (a model's
remote code, a third-party training script): see alias_flash_attn."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

# flash_attn's module -> ours. The package itself re-exports the interface's functions, as
# flash_attn does.
_MODULES = {
    "flash_attn.flash_attn_interface": "torch_flash_v100.flash_attn_interface",
    "flash_attn.bert_padding": "torch_flash_v100.bert_padding",
    "flash_attn.layers": "torch_flash_v100.layers",
    "flash_attn.layers.rotary": "torch_flash_v100.layers.rotary",
}
_ALIAS_MARK = "__torch_flash_v100_alias__"
# The flash_attn release whose API these modules follow (some code gates features on it).
_API_VERSION = "2.8.0"


def _installed_flash_attn():
    """The spec of a real, importable flash_attn package, else None."""
    existing = sys.modules.get("flash_attn")
    if existing is not None:
        return None if getattr(existing, _ALIAS_MARK, False) else existing.__spec__
    return importlib.util.find_spec("flash_attn")


def alias_flash_attn() -> None:
    """Make ``import flash_attn`` load torch_flash_v100's FlashAttention-2 API.

    Afterwards, in this process, ``from flash_attn import flash_attn_func`` (and the other six
    functions), ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding`` and
    ``flash_attn.layers.rotary`` are torch_flash_v100's modules of the same names (FlashAttention-2
    v2.8's API; ``flash_attn.__version__`` is that release). Call it before the code that imports
    flash_attn. Other flash_attn modules (``flash_attn.ops``, ``flash_attn.modules``, ...) are not
    provided: importing them raises ModuleNotFoundError. Calling it again does nothing.

    Raises RuntimeError if a real flash_attn package is installed (or already imported): the
    alias never shadows it.
    """
    if getattr(sys.modules.get("flash_attn"), _ALIAS_MARK, False):
        return
    real = _installed_flash_attn()
    if real is not None:
        raise RuntimeError(
            f"alias_flash_attn: a flash_attn package is installed ({real.origin}); the alias "
            "would shadow it. Uninstall it, or import torch_flash_v100.flash_attn_interface "
            "instead of flash_attn")
    interface = importlib.import_module("torch_flash_v100.flash_attn_interface")
    package = types.ModuleType("flash_attn", "torch_flash_v100's FlashAttention-2 API")
    package.__path__ = []  # a package: its submodules come from sys.modules
    # importlib.util.find_spec("flash_attn") (package probes, transformers') reads it
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__version__ = _API_VERSION
    setattr(package, _ALIAS_MARK, True)
    for name in interface.__all__:
        setattr(package, name, getattr(interface, name))
    modules = {alias: importlib.import_module(ours) for alias, ours in _MODULES.items()}
    sys.modules["flash_attn"] = package
    for alias, module in modules.items():
        sys.modules[alias] = module
        parent, _, child = alias.rpartition(".")
        setattr(sys.modules[parent], child, module)
