"""How fast the target answers training prompts: the data stage of ``speclm train-drafter``.

    python benchmarks/answer_throughput.py [--prompts FILE] [--num 64] [--max-new-tokens 128] \
        [--modes generate,solo,torch:64,llamacpp:16]

Modes, each answering the same prompts greedily (prefill included), one after another:

- ``generate``: transformers' ``generate`` on left-padded batches of 8, the way the data stage
  answered before it ran on the engine;
- ``solo``: one request at a time on the engine (eager float32, or ``--dtype``): single-stream decoding;
- ``torch:R``: the engine over R rows of the eager-torch ragged cache (the data stage's default);
- ``llamacpp:R``: the engine over R llama.cpp rows in one ``llama_decode`` (the GGUF's kernels).

Prints answer tokens, seconds and tokens/s per mode, and whether the torch modes' answers are
identical (greedy decodes of the same model; in float32 a row's answer equals its solo answer
except at near-ties, where a wider batch can round differently).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "train_prompts" / "prompts.jsonl"


def _generate(model, tokenizer, texts, eos, max_new_tokens, batch=8):
    """The former data stage: left-padded transformers generate, batches of similar lengths."""
    from speclm.prompts import encode_user_turn

    encoded = [encode_user_turn(tokenizer, t, 384) for t in texts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    answers = {}
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), eos[0], dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, temperature=None, top_k=None, top_p=None,
                                 eos_token_id=eos, pad_token_id=eos[0])
        for row, i in enumerate(chunk):
            answer = out[row, width:].tolist()
            for j, tok in enumerate(answer):
                if tok in eos:
                    answer = answer[: j + 1]
                    break
            answers[i] = answer
    return [answers[i] for i in range(len(texts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with 'prompt' or 'turns'")
    ap.add_argument("--num", type=int, default=64, help="prompts to answer (default: 64)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--modes", default="generate,solo,torch:64,llamacpp:16")
    ap.add_argument("--dtype", default="float32", help="the torch modes' precision (default: float32)")
    args = ap.parse_args()

    from speclm.learned.answers import AnswerStore, answer_prompts, text_key
    from speclm.models import load_model
    from speclm.prompts import load_prompts

    texts = [row["turns"][0] for row in load_prompts(args.prompts)][: args.num]
    torch_model = load_model("default", dtype=args.dtype)
    llama = None
    results = {}
    for mode in args.modes.split(","):
        name, _, rows = mode.partition(":")
        start = time.monotonic()
        if name == "generate":
            eos = sorted(torch_model.backend.eos_token_ids)
            answers = _generate(torch_model.backend.model, torch_model.tokenizer, texts, eos, args.max_new_tokens)
        else:
            if name == "llamacpp":
                llama = llama or load_model("default", backend="llamacpp")
                loaded = llama
            else:
                loaded = torch_model
            with tempfile.TemporaryDirectory() as tmp:
                store = AnswerStore(Path(tmp))
                answer_prompts(loaded.backend, loaded.tokenizer, texts, store, max_new_tokens=args.max_new_tokens,
                               rows=1 if name == "solo" else int(rows), progress=False)
                answers = [a.ids[a.prompt_len :] for a in store.answers([text_key(t) for t in texts])]
        seconds = time.monotonic() - start
        tokens = sum(len(a) for a in answers)
        results[mode] = answers
        print(json.dumps(dict(mode=mode, prompts=len(texts), tokens=tokens, seconds=round(seconds, 1),
                              tokens_per_s=round(tokens / seconds, 1))), flush=True)
    torch_modes = [m for m in results if not m.startswith("llamacpp")]
    if len(torch_modes) > 1:
        ref = results[torch_modes[0]]
        same = {m: sum(a == b for a, b in zip(ref, results[m])) for m in torch_modes[1:]}
        print(json.dumps(dict(identical_to=torch_modes[0], answers=same)))


if __name__ == "__main__":
    main()
