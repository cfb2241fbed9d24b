"""End-to-end on HuggingFace ``transformers``: a Llama-style model (random weights, built from a
config, no download) trained and sampled with the flashv100 backend, ``sdpa`` and ``eager``.

    python -m torch_flash_v100 hf                       # best device, both model sizes
    python -m torch_flash_v100 hf --models tiny --json benchmarks/results/hf_h200.json

Training runs on batches of mixed lengths, in two layouts: ``padded`` (right padding, a 2D
attention mask) and ``packed`` (the same sequences concatenated into one row with position_ids
restarting per sequence, as ``DataCollatorWithFlattening`` makes them). Reported: real (non-pad)
tokens per second of forward + backward + optimizer step, and peak memory. Generation: greedy
``generate()`` of a left-padded batch of prompts, new tokens per second. Every implementation runs
the same weights, batches and step counts (fixed repetitions: no time budget).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

IMPLEMENTATIONS = ["flashv100", "sdpa", "eager"]
LAYOUTS = ["padded", "packed"]

# Llama-style sizes: (hidden, layers, heads, kv heads, intermediate, vocab).
MODELS = {
    "tiny": (256, 4, 4, 2, 688, 8192),
    "100m": (768, 12, 12, 4, 2048, 32000),
}


def llama(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab = MODELS[name]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=8192, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def mixed_lengths(batch: int, seq: int, seed: int) -> List[int]:
    """Lengths uniform in [seq / 4, seq], the first one full (the padded batch's width)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=g).tolist()
    lengths[0] = seq
    return lengths


def training_batch(layout: str, lengths: List[int], vocab: int, device: torch.device, seed: int):
    """Model inputs (with labels) of one layout for sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    if layout == "packed":
        ids = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
        labels[0, starts] = -100  # no target across a sequence boundary
        return {"input_ids": ids.to(device), "position_ids": positions.to(device),
                "labels": labels.to(device)}
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}


def _timed(fn, device: torch.device, warmup: int, reps: int) -> List[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def train_run(model, implementation: str, inputs: Dict[str, torch.Tensor], real_tokens: int,
              device: torch.device, warmup: int, steps: int) -> Dict[str, Any]:
    model.set_attn_implementation(implementation)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        opt.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _timed(step, device, warmup, steps)
    res = {"step_ms": statistics.median(times) * 1e3,
           "tokens_per_s": real_tokens / statistics.median(times)}
    if device.type == "cuda":
        res["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return res


def generate_run(model, implementation: str, prompts: Dict[str, torch.Tensor], new_tokens: int,
                 device: torch.device, warmup: int, reps: int) -> Dict[str, Any]:
    model.set_attn_implementation(implementation)
    model.eval()

    def sample():
        with torch.no_grad():
            return model.generate(**prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)

    times = _timed(sample, device, warmup, reps)
    batch = prompts["input_ids"].shape[0]
    return {"ms": statistics.median(times) * 1e3,
            "tokens_per_s": batch * new_tokens / statistics.median(times),
            "tokens": sample()[:, -new_tokens:].tolist()}


def left_padded_prompts(lengths: List[int], vocab: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def parse(argv=None, prog="python -m torch_flash_v100 hf"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    p.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None, help="longest training sequence")
    p.add_argument("--steps", type=int, default=None, help="timed training steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gen-batch", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None, help="longest prompt")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--gen-reps", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None)
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = a.device.startswith("cuda")
    defaults = dict(batch=16 if cuda else 2, seq=2048 if cuda else 64, steps=10 if cuda else 2,
                    gen_batch=8 if cuda else 2, prompt=512 if cuda else 16,
                    new_tokens=64 if cuda else 4)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def main(argv=None, prog="python -m torch_flash_v100 hf") -> int:
    args = parse(argv, prog)
    device = torch.device(args.device)
    try:
        from ..integrations.transformers import register
    except ImportError as e:
        raise SystemExit(f"the hf benchmark needs transformers: {e}")
    ours = register()
    # fp16 on CUDA: what the fused kernels (and FlashAttention-2) take; fp32 on CPU.
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    names = {"flashv100": ours, "sdpa": "sdpa", "eager": "eager"}
    impls = [i.strip() for i in args.implementations.split(",")]
    from .harness import collect_metadata

    doc: Dict[str, Any] = {"config": {**vars(args), "dtype": str(dtype)},
                           "metadata": collect_metadata(device), "train": [], "generate": []}
    lengths = mixed_lengths(args.batch, args.seq, seed=1)
    prompt_lengths = mixed_lengths(args.gen_batch, args.prompt, seed=2)
    for model_name in args.models.split(","):
        model = llama(model_name, device, dtype)
        vocab = model.config.vocab_size
        params = sum(p.numel() for p in model.parameters())
        print(f"{model_name}: {params / 1e6:.1f}M parameters, {dtype} on {device}", flush=True)
        for layout in args.layouts.split(","):
            inputs = training_batch(layout, lengths, vocab, device, seed=3)
            for impl in impls:
                row = {"model": model_name, "params_m": params / 1e6, "layout": layout,
                       "implementation": impl}
                try:
                    row.update(train_run(model, names[impl], inputs, sum(lengths), device,
                                         args.warmup, args.steps))
                except Exception as e:  # an implementation that cannot run this layout
                    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                doc["train"].append(row)
                print(f"  train {layout} {impl}: {row.get('tokens_per_s', row.get('error'))}",
                      flush=True)
        prompts = left_padded_prompts(prompt_lengths, vocab, device, seed=4)
        for impl in impls:
            row = {"model": model_name, "implementation": impl}
            try:
                row.update(generate_run(model, names[impl], prompts, args.new_tokens, device,
                                        min(args.warmup, 1), args.gen_reps))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            doc["generate"].append(row)
            print(f"  generate {impl}: {row.get('tokens_per_s', row.get('error'))}", flush=True)
        del model
    print(report(doc))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0 if all("error" not in r for r in doc["train"] + doc["generate"]) else 1


def _ratio(rows: List[Dict[str, Any]], row: Dict[str, Any], keys) -> str:
    """tokens/s of `row` over flashv100's in the same group."""
    ours = next((r for r in rows if r["implementation"] == "flashv100"
                 and all(r[k] == row[k] for k in keys) and "tokens_per_s" in r), None)
    if ours is None or "tokens_per_s" not in row:
        return ""
    return f"{ours['tokens_per_s'] / row['tokens_per_s']:.2f}x"


def report(doc: Dict[str, Any]) -> str:
    md = doc["metadata"]
    lines = [f"\n{md.get('device_name')} | torch {md.get('torch_version')} | commit "
             f"{str(md.get('git_commit'))[:10]}",
             "", "| model | layout | implementation | train tokens/s | step ms | peak MB | flashv100 speedup |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in doc["train"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layout']} | {r['implementation']} | error: {r['error']} | | | |")
            continue
        mem = f"{r['peak_mem_mb']:.0f}" if "peak_mem_mb" in r else ""
        lines.append(f"| {r['model']} | {r['layout']} | {r['implementation']} | {r['tokens_per_s']:.0f} | "
                     f"{r['step_ms']:.1f} | {mem} | {_ratio(doc['train'], r, ('model', 'layout'))} |")
    lines += ["", "| model | implementation | generate tokens/s | ms | flashv100 speedup | same tokens as eager |",
              "|---|---|---:|---:|---:|---|"]
    for r in doc["generate"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['implementation']} | error: {r['error']} | | | |")
            continue
        eager = next((e for e in doc["generate"] if e["model"] == r["model"]
                      and e["implementation"] == "eager" and "tokens" in e), None)
        same = "" if eager is None else ("yes" if eager["tokens"] == r["tokens"] else "no")
        lines.append(f"| {r['model']} | {r['implementation']} | {r['tokens_per_s']:.0f} | {r['ms']:.0f} | "
                     f"{_ratio(doc['generate'], r, ('model',))} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
