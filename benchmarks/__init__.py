"""Side-by-side attention benchmarks for torch-flash-v100.

Importable as a package (``import benchmarks.harness``) from a source checkout, and runnable as a
script (``python benchmarks/bench_attention.py --suite quick``) or through the CLI
(``python -m torch_flash_v100 bench --suite quick``).

Modules:
  suites           the configuration suites (seed, fa2, gqa, quick, tiny, masks)
  implementations  the attention implementations compared side by side
  harness          timing, memory, accuracy vs an fp64 reference, the run loop
  report           Markdown tables, JSON and the PNG plot
  bench_attention  the command line (argparse) for the harness
  e2e_gpt          end-to-end: a small GPT trained under torch.compile with and without the pass
"""
