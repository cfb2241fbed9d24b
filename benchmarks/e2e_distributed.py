"""Distributed small GPT from a source checkout (torch_flash_v100.bench.e2e_distributed):

    torchrun --nproc-per-node 2 benchmarks/e2e_distributed.py --parallel ddp,fsdp
"""
import sys

from torch_flash_v100.bench.e2e_distributed import main

if __name__ == "__main__":
    sys.exit(main())
