"""torch_flash_v100.alias_flash_attn: ``import flash_attn`` serves our modules, in a fresh
interpreter each (the alias changes sys.modules for the rest of a process)."""

import subprocess
import sys
import textwrap

import pytest


def _run(code: str, *, pythonpath: str = "") -> subprocess.CompletedProcess:
    env_path = f"import sys; sys.path.insert(0, {pythonpath!r})\n" if pythonpath else ""
    return subprocess.run([sys.executable, "-c", env_path + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_flash_attn_imports_resolve_to_ours():
    result = _run("""
        import importlib.util
        import torch
        import torch_flash_v100
        from torch_flash_v100 import bert_padding, flash_attn_interface
        from torch_flash_v100.layers import rotary

        assert importlib.util.find_spec("flash_attn") is None
        torch_flash_v100.alias_flash_attn()
        torch_flash_v100.alias_flash_attn()  # again: nothing changes
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func
        from flash_attn.bert_padding import pad_input, unpad_input
        from flash_attn.layers.rotary import apply_rotary_emb_func
        import flash_attn.flash_attn_interface as interface

        assert flash_attn_func is flash_attn_interface.flash_attn_func
        assert flash_attn_varlen_func is flash_attn_interface.flash_attn_varlen_func
        assert interface is flash_attn_interface and flash_attn.bert_padding is bert_padding
        assert unpad_input is bert_padding.unpad_input and pad_input is bert_padding.pad_input
        assert apply_rotary_emb_func is rotary.apply_rotary_emb
        assert flash_attn.__version__ == "2.8.0"
        assert importlib.util.find_spec("flash_attn") is not None  # package probes see it
        q = torch.randn(1, 8, 2, 16)
        torch.testing.assert_close(flash_attn_func(q, q, q, causal=True),
                                   flash_attn_interface.flash_attn_func(q, q, q, causal=True))
        try:
            import flash_attn.ops.triton.rotary  # noqa: F401  (not provided)
        except ModuleNotFoundError:
            print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_real_flash_attn_is_never_shadowed(tmp_path):
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("__version__ = 'real'\n")
    result = _run("""
        import torch_flash_v100
        try:
            torch_flash_v100.alias_flash_attn()
        except RuntimeError as error:
            print(error)
        import flash_attn
        print(flash_attn.__version__)
    """, pythonpath=str(tmp_path))
    assert result.returncode == 0, result.stderr
    message, version = result.stdout.strip().splitlines()
    assert "a flash_attn package is installed" in message and "would shadow it" in message
    assert version == "real"


@pytest.mark.parametrize("first", ["interface", "padding"])
def test_alias_before_any_other_import(first):
    """Importing flash_attn's submodules right after the alias, in either order."""
    module = {"interface": "flash_attn.flash_attn_interface", "padding": "flash_attn.bert_padding"}
    result = _run(f"""
        import torch_flash_v100
        torch_flash_v100.alias_flash_attn()
        import {module[first]}
        import flash_attn.layers.rotary
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
