"""The largest gap between a running stream's chunks while a ~6,600-token prompt joins.

    python benchmarks/prefill_gap.py 512      # the --prefill-chunk to serve with
    python benchmarks/prefill_gap.py 512 --draft-model DIR   # more `speclm serve` flags after it

One `speclm serve --model default --max-batch 4` process; client A streams a 600-token answer,
client B sends the long prompt 4 s later; prints the largest and median gaps of A's stream.
"""
import json
import sys
import tempfile
import threading
import time
import openai
from speclm.serve.process import serve_process
from pathlib import Path

chunk = sys.argv[1]
args = ["--model", "default", "--max-batch", "4", "--prefill-chunk", chunk, "--log-level", "warning", *sys.argv[2:]]
with tempfile.TemporaryDirectory() as logs, serve_process(args, Path(logs)) as srv:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", timeout=600, max_retries=0)
    long_text = " ".join(f"item {i} is the number {i * 7 % 1000}." for i in range(520))
    n_long = None
    def late():
        global n_long
        time.sleep(4)
        r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": long_text + "\nSum the first three numbers."}], max_tokens=4, temperature=0)
        n_long = r.usage.prompt_tokens
    t = threading.Thread(target=late); t.start()
    stamps = []
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}], max_tokens=600, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for c in stream:
        stamps.append(time.perf_counter())
    t.join()
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    print(json.dumps({"prefill_chunk": int(chunk), "flags": sys.argv[2:], "long_prompt_tokens": n_long, "chunks": len(stamps),
                      "max_gap_s": round(gaps[-1], 2), "median_gap_s": round(gaps[len(gaps)//2], 3)}))
