"""End-to-end small GPT from a source checkout: the same command as
``python -m torch_flash_v100 e2e`` (torch_flash_v100.bench.e2e_gpt).

    python benchmarks/e2e_gpt.py --steps 5
"""
import sys

from torch_flash_v100.bench.e2e_gpt import main

if __name__ == "__main__":
    sys.exit(main(prog="e2e_gpt.py"))
