"""Check that a `speclm distill` folder works as transformers' own assistant model.

Loads the target and the draft with plain ``AutoModelForCausalLM.from_pretrained`` (no speclm
code involved), then runs ``generate(assistant_model=draft)`` and plain ``generate`` greedily on
a few of speclm's default prompts and reports whether the outputs are identical, with times.

    python benchmarks/assistant_check.py --draft ~/.cache/speclm/distilled/<name>-6layers
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speclm.models.loading import resolve_model_path
from speclm.prompts import encode_user_turn, load_prompts, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5, help="assistant tokens per round")
    args = parser.parse_args()

    target_dir = resolve_model_path(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    draft.generation_config.num_assistant_tokens = args.k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    print(f"target {target_dir.name}: {target.config.num_hidden_layers} layers; "
          f"draft {args.draft}: {draft.config.num_hidden_layers} layers")
    greedy = dict(do_sample=False, temperature=None, top_k=None, top_p=None,
                  max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    for row in spread(load_prompts(), args.prompts):
        ids = torch.tensor([encode_user_turn(tokenizer, row["turns"][0])])
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            t0 = time.perf_counter()
            plain = target.generate(ids, attention_mask=mask, **greedy)
            t1 = time.perf_counter()
            assisted = target.generate(ids, attention_mask=mask, assistant_model=draft, **greedy)
            t2 = time.perf_counter()
        new = plain.shape[1] - ids.shape[1]
        print(f"{row['category']:>14}: {new} tokens; plain {t1 - t0:.2f} s, assisted {t2 - t1:.2f} s; "
              f"outputs {'identical' if torch.equal(plain, assisted) else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
