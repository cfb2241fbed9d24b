import os
import sys

import pytest
import torch

# Tests import helpers from this folder (attention_testing).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_flash_v100  # noqa: E402,F401  (registers the ops)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(params=[True, False], ids=["volta", "native"])
def atom(request):
    """CUDA cases on both tensor-core atoms (the Volta one forced on newer GPUs)."""
    with torch_flash_v100.volta_atom(request.param):
        yield request.param


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "device" in getattr(item, "fixturenames", ()) and "[cuda" in item.nodeid:
            item.add_marker(pytest.mark.cuda)
