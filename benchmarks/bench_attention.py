"""Side-by-side attention benchmark from a source checkout: the same command as
``python -m torch_flash_v100 bench`` (the harness is torch_flash_v100.bench).

    python benchmarks/bench_attention.py --suite quick
"""
import sys

from torch_flash_v100.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="bench_attention.py"))
