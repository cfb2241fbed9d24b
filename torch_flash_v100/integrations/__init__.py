"""Integrations with other libraries; each is imported on its own and only when used, so that
``import torch_flash_v100`` never imports them (``torch_flash_v100.integrations.transformers``)."""
