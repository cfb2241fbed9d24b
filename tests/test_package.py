"""The Python package surface."""

import torch

import torch_flash_v100 as flash


def test_attention_is_the_op():
    assert flash.attention is torch.ops.flashv100.attention


def test_version_and_build_info():
    assert flash.__version__
    info = flash.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    assert info["cuda"] == bool(info["cuda_archs"])


def test_volta_override_round_trip():
    before = flash.force_volta_atom()
    with flash.volta_atom(True):
        assert flash.force_volta_atom()
    assert flash.force_volta_atom() == before


def test_kernel_path_names_cpu():
    assert flash.kernel_path("cpu") == "cpu"


def test_seeded_tag():
    assert torch.Tag.nondeterministic_seeded in torch.ops.flashv100._attention_forward.default.tags
    assert torch.Tag.nondeterministic_seeded in torch.ops.flashv100.attention.default.tags
