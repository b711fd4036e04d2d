"""How fast ``speclm train-drafter`` trains the EAGLE head, by compute precision, on this machine.

    python benchmarks/train_speed.py [--precisions float32,bfloat16] [--steps 12] [--rounds 2]
    python benchmarks/train_speed.py --features OUT/features --sequences 600 [--epochs 1]

The default model's EAGLE head (three feature layers, an 8,192-token draft vocabulary, two
training-time-test steps: the command's defaults) takes optimizer steps on batches of 8 synthetic
sequences shaped like the data stage's (prompt + answer, 150-500 tokens, features in bfloat16):
the cost of a step does not depend on the values. Each precision starts from the same head and
runs ``--steps`` steps after one warm-up step; precisions alternate for ``--rounds`` rounds in one
process. Prints sequence positions per second (median over rounds) and each precision's loss
after its steps.

``--features`` trains on real data instead: the first ``--sequences`` of a ``train-drafter --out``
folder's feature shards (shuffled, a tenth held out), ``--epochs`` epochs per precision from the
same head over the same batches, and prints seconds, positions per second and held-out top-1
accuracy by draft depth: whether a precision learns as well, not only as fast.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

import torch


def synthetic_sequences(count: int, features: int, vocab: torch.Tensor, seed: int = 0) -> list:
    """Sequences of the data stage's shapes: ids from the draft vocabulary, random features."""
    from speclm.learned.train import Sequence

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = rng.randint(150, 500)
        ids = vocab[torch.randint(len(vocab), (t,), generator=gen)]
        out.append(Sequence(ids=ids, prompt_len=t // 3,
                            features=torch.randn(t, features, generator=gen).to(torch.bfloat16),
                            target_next=torch.roll(ids, -1)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=12, help="timed optimizer steps per precision and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--features", default=None, help="a train-drafter --out folder's features/ (real data)")
    ap.add_argument("--sequences", type=int, default=600, help="with --features: sequences to use")
    ap.add_argument("--epochs", type=int, default=1, help="with --features: epochs per precision")
    args = ap.parse_args()
    if args.features:
        return real_data(args)

    from speclm.learned.modules import EagleHead
    from speclm.learned.train import EagleTrainer
    from speclm.models import load_model

    loaded = load_model("default", dtype="float32")
    target = loaded.backend.model
    for p in target.parameters():
        p.requires_grad_(False)
    layers = target.config.num_hidden_layers
    feature_layers = [2, layers // 2, layers - 1]
    vocab = torch.arange(8192) * (target.config.vocab_size // 8192)
    head = EagleHead.create(target, feature_layers, vocab)
    sequences = synthetic_sequences(8 * (args.steps + 1), len(feature_layers) * target.config.hidden_size, vocab)
    rates: dict[str, list[float]] = {p: [] for p in args.precisions.split(",")}
    losses: dict[str, float] = {}
    for _ in range(args.rounds):
        for name in rates:
            trainer = EagleTrainer(copy.deepcopy(head), target.get_input_embeddings(), sequences, [],
                                   vocab_size=target.config.vocab_size, epochs=1, batch_size=8, lr=3e-4,
                                   device="cpu", unroll=args.unroll, max_seconds=None, progress=False,
                                   compute_dtype=getattr(torch, name))
            batches = [sequences[i : i + 8] for i in range(0, len(sequences), 8)]
            trainer.train_step(batches[0])  # warm-up
            start = time.perf_counter()
            for chunk in batches[1:]:
                loss, _ = trainer.train_step(chunk)
            seconds = time.perf_counter() - start
            rates[name].append(sum(s.ids.shape[0] for s in sequences[8:]) / seconds)
            losses[name] = loss
    base = statistics.median(next(iter(rates.values())))
    for name, values in rates.items():
        rate = statistics.median(values)
        print(json.dumps(dict(precision=name, positions_per_s=round(rate), vs_first=round(rate / base, 2),
                              rounds=[round(v) for v in values], loss_after=round(losses[name], 3))))


def real_data(args) -> None:
    from speclm.learned.features import INDEX_FILE, FeatureShards
    from speclm.learned.modules import EagleHead
    from speclm.learned.train import EagleTrainer, draft_vocabulary
    from speclm.models import load_model

    meta = json.loads((Path(args.features) / INDEX_FILE).read_text())["meta"]
    sequences = FeatureShards(Path(args.features), meta).load()
    random.Random(0).shuffle(sequences)
    sequences = sequences[: args.sequences]
    cut = max(1, len(sequences) // 10)
    held_out, train = sequences[:cut], sequences[cut:]
    loaded = load_model(meta["target"], dtype="float32")
    target = loaded.backend.model
    for p in target.parameters():
        p.requires_grad_(False)
    vocab_size = target.config.vocab_size
    head = EagleHead.create(target, meta["layers"], draft_vocabulary(train, 8192, vocab_size,
                                                                     sorted(loaded.backend.eos_token_ids)))
    positions = args.epochs * sum(s.ids.shape[0] for s in train)
    print(json.dumps(dict(train=len(train), held_out=len(held_out),
                          answer_tokens=sum(s.ids.shape[0] - s.prompt_len for s in train))))
    for name in args.precisions.split(","):
        trainer = EagleTrainer(copy.deepcopy(head), target.get_input_embeddings(), train, held_out,
                               vocab_size=vocab_size, epochs=args.epochs, batch_size=8, lr=3e-4, device="cpu",
                               unroll=args.unroll, max_seconds=None, progress=False,
                               compute_dtype=getattr(torch, name))
        start = time.perf_counter()
        state = trainer.run()
        seconds = time.perf_counter() - start  # held-out scoring after each epoch included
        print(json.dumps(dict(precision=name, seconds=round(seconds), positions_per_s=round(positions / seconds),
                              steps=state.step, loss=round(state.history[-1]["loss"], 3),
                              held_out_top1=[round(a[0], 3) for a in state.history[-1]["accuracy"]])))


if __name__ == "__main__":
    main()
