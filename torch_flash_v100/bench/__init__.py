"""Side-by-side attention benchmarks for torch-flash-v100.

Part of the installed package: ``python -m torch_flash_v100 bench --suite quick`` and
``python -m torch_flash_v100 e2e`` run them from any install (a wheel included). In a source
checkout, ``benchmarks/bench_attention.py`` and ``benchmarks/e2e_gpt.py`` are the same commands
as scripts, next to the kernel-level tools and the recorded results.

Modules:
  suites           the configuration suites (seed, fa2, gqa, quick, tiny, masks)
  implementations  the attention implementations compared side by side
  harness          timing, memory, accuracy vs an fp64 reference, the run loop
  report           Markdown tables, JSON and the PNG plot
  cli              the command line (argparse) for the harness
  e2e_gpt          end-to-end: a small GPT trained under torch.compile with and without the pass
"""
