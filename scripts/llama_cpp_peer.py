#!/usr/bin/env python3
"""Peer for `deepinfer bench --peer`: times llama.cpp (through llama-cpp-python) on the same
GGUF file with the same prompt length, new-token count and thread count.

Reads DEEPINFER_BENCH_{MODE,MODEL,PROMPT_LEN,NEW_TOKENS,BATCH,THREADS,CACHED_PREFIX,CHUNK} and
prints one JSON line {"raw_s": [...]}: prefill -> seconds for the prompt's uncached suffix (a
cached prefix is evaluated first, untimed, and kept in llama.cpp's KV cache; CHUNK sets its
n_batch); decode -> seconds per decode step.
Install: pip install llama-cpp-python (built from source by pip).
"""
import json
import os
import random
import sys
import time

from llama_cpp import Llama

env = os.environ
mode = env["DEEPINFER_BENCH_MODE"]
n_prompt = int(env["DEEPINFER_BENCH_PROMPT_LEN"])
n_new = int(env.get("DEEPINFER_BENCH_NEW_TOKENS", "0"))
threads = int(env["DEEPINFER_BENCH_THREADS"])
cached = int(env.get("DEEPINFER_BENCH_CACHED_PREFIX") or "0")
chunk = int(env.get("DEEPINFER_BENCH_CHUNK") or "0")
if int(env.get("DEEPINFER_BENCH_BATCH", "1")) != 1:
    sys.exit("this peer measures batch 1 only")
if cached and mode != "prefill":
    sys.exit("a cached prefix is a prefill option")
cached -= cached % 16  # whole blocks, as deepinfer rounds it

n_batch = chunk if chunk > 0 else max(512, n_prompt)
llm = Llama(model_path=env["DEEPINFER_BENCH_MODEL"], n_ctx=n_prompt + n_new + 8, n_batch=n_batch,
            n_ubatch=n_batch, n_threads=threads, n_threads_batch=threads, verbose=False)
rng = random.Random(1)
vocab = llm.n_vocab()
prompt = [rng.randrange(3, vocab) for _ in range(n_prompt)]

llm.reset()
if cached:
    llm.eval(prompt[:cached])
t = time.perf_counter()
llm.eval(prompt[cached:])
prefill = time.perf_counter() - t
if mode == "prefill":
    print(json.dumps({"raw_s": [prefill]}))
    sys.exit(0)

steps = []
tok = int(llm.scores[llm.n_tokens - 1].argmax())
for _ in range(n_new):
    t = time.perf_counter()
    llm.eval([tok])
    steps.append(time.perf_counter() - t)
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
print(json.dumps({"raw_s": steps}))
