"""``python -m torch_flash_v100``: see :mod:`torch_flash_v100.cli`."""
import sys

from torch_flash_v100.cli import main

if __name__ == "__main__":
    sys.exit(main())
