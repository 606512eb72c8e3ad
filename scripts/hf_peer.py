#!/usr/bin/env python3
"""HF transformers peer for the GPU decode benchmark (issue 6).

Builds a Llama-3-8B-shaped LlamaForCausalLM with random bf16 weights on the GPU, generates with a
static KV cache (`generation_config.cache_implementation = "static"`, which makes `generate`
compile the decode step with torch.compile, mode "reduce-overhead": CUDA graphs) and times every
decode step: a logits processor synchronizes and stamps the clock once per generated token, so
a step is one whole iteration of HF's decode loop (compiled forward, processors, argmax, cache
update). Greedy, random prompts, `min_new_tokens` = `max_new_tokens` (EOS never ends early).

Standalone (what doc/benchmarks.md uses; one process, one compile per batch size):

    python3 scripts/hf_peer.py --batch 1,32,128 --prompt-len 128 --new-tokens 128 \
        --repeats 2 --warmup 1 [--ours ours.jsonl] [--eager] [--json out.jsonl]

`--ours` reads `deepinfer bench decode` JSONL records and prints the speed ratio per batch.
As a `deepinfer bench --peer` command it reads DEEPINFER_BENCH_{MODE,PROMPT_LEN,NEW_TOKENS,BATCH}
and prints {"raw_s": [...]} (slow: the model is built and compiled again for every repeat).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList


def llama3_8b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        pad_token_id=128001,
    )


class Stamp(LogitsProcessor):
    """Synchronizes and records the time once per generated token."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores


def build(eager: bool):
    torch.manual_seed(0)
    cfg = llama3_8b()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.eval()
    # Random weights: uniform in ±sqrt(3/fan_in)-ish so activations stay finite.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.uniform_(-1.0, 1.0).mul_((3.0 / p.shape[1]) ** 0.5)
    gc = model.generation_config
    gc.do_sample = False
    gc.pad_token_id = cfg.pad_token_id
    gc.eos_token_id = cfg.eos_token_id
    if not eager:
        gc.cache_implementation = "static"
    return model


def generate_once(model, batch: int, prompt_len: int, new_tokens: int, seed: int):
    """Returns (decode step seconds, whole generate seconds)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    stamp = Stamp()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([stamp]),
        )
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    assert out.shape == (batch, prompt_len + new_tokens), out.shape
    steps = [b - a for a, b in zip(stamp.t, stamp.t[1:])]
    return steps, total


def run_point(model, batch, prompt_len, new_tokens, repeats, warmup):
    t = time.perf_counter()
    for w in range(warmup):
        generate_once(model, batch, prompt_len, new_tokens, 1000 + w)
    warm_s = time.perf_counter() - t
    steps, totals = [], []
    for r in range(repeats):
        s, tot = generate_once(model, batch, prompt_len, new_tokens, r)
        steps += s
        totals.append(tot)
    return steps, totals, warm_s


def peer_mode():
    env = os.environ
    if env["DEEPINFER_BENCH_MODE"] != "decode":
        sys.exit("hf_peer.py measures decode only")
    model = build(eager=False)
    b = int(env.get("DEEPINFER_BENCH_BATCH", "1"))
    p = int(env["DEEPINFER_BENCH_PROMPT_LEN"])
    n = int(env["DEEPINFER_BENCH_NEW_TOKENS"])
    steps, _, _ = run_point(model, b, p, n, 1, 1)
    print(json.dumps({"raw_s": steps}))


def main():
    if "DEEPINFER_BENCH_MODE" in os.environ:
        return peer_mode()
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="dynamic cache, no torch.compile")
    ap.add_argument("--ours", help="deepinfer bench decode JSONL records to compare with")
    ap.add_argument("--json", help="append one JSON line per batch size here")
    a = ap.parse_args()
    print(
        f"hf_peer: transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()}, {'eager' if a.eager else 'static cache + torch.compile'}",
        file=sys.stderr,
        flush=True,
    )
    t = time.perf_counter()
    model = build(a.eager)
    print(f"hf_peer: model built in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        steps, totals, warm_s = run_point(model, b, a.prompt_len, a.new_tokens, a.repeats, a.warmup)
        med = statistics.median(steps)
        rec = {
            "engine": "hf-eager" if a.eager else "hf-static-compile",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "compiled": getattr(model, "_compiled_call", None) is not None,
            "batch": b,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "repeats": a.repeats,
            "median_step_s": med,
            "min_step_s": min(steps),
            "max_step_s": max(steps),
            "tok_s": b / med,
            "generate_s": totals,
            "warmup_s": warm_s,
        }
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(
            f"hf_peer: batch {b}: {med * 1e3:.2f} ms/step, {b / med:.0f} tok/s "
            f"(warm-up incl. compile {warm_s:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    ours = {}
    if a.ours and os.path.exists(a.ours):
        for line in open(a.ours):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("mode") == "decode" and r.get("engine") == "deepinfer":
                ours[r["batch"]] = r["median_s"]
    print(f"{'batch':>5} {'HF ms/step':>11} {'HF tok/s':>9} {'ours ms':>8} {'ours tok/s':>10} {'ratio':>6}")
    for r in rows:
        b, h = r["batch"], r["median_step_s"]
        o = ours.get(b)
        if o:
            print(f"{b:>5} {h * 1e3:>11.2f} {b / h:>9.0f} {o * 1e3:>8.2f} {b / o:>10.0f} {h / o:>5.2f}x")
        else:
            print(f"{b:>5} {h * 1e3:>11.2f} {b / h:>9.0f}")


if __name__ == "__main__":
    main()
