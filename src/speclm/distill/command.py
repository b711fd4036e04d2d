"""``speclm distill``: its flags and the command (a small draft model trained on the target)."""

from __future__ import annotations

import argparse


def add_parser(sub, number) -> argparse.ArgumentParser:
    """Register ``distill`` on the CLI's subparsers; ``number(type)`` parses numeric flags."""
    dist = sub.add_parser(
        "distill", help="make a small draft model for a target (minutes, no data needed)",
        description="Build a draft model for --target: the target's architecture with --layers "
                    "decoder layers copied from it, trained on the target's own answers to a "
                    "built-in prompt set (plus --prompts) to match its next-token distributions. "
                    "Saves an ordinary transformers folder (config, safetensors, tokenizer) that "
                    "`--draft-model DIR`, `--drafter distilled` and transformers' "
                    "generate(assistant_model=...) load.")
    dist.add_argument("--target", "-m", default="default", help="target model (default: %(default)s)")
    dist.add_argument("--layers", type=number(int), required=True,
                      help="decoder layers of the draft model (spread over the target's depth)")
    dist.add_argument("--out", help="output folder (default: the speclm cache, where "
                                    "`--drafter distilled` finds it)")
    dist.add_argument("--prompts", action="append", default=[],
                      help="extra prompt JSONL file(s) in the bench format (repeatable)")
    dist.add_argument("--num-prompts", type=number(int), default=0,
                      help="use only the first N prompts (default: all)")
    dist.add_argument("--max-minutes", type=number(float), default=15.0,
                      help="training time bound; target answers are made first (default: %(default)s)")
    dist.add_argument("--max-steps", type=number(int), default=0, help="step bound (default: none)")
    dist.add_argument("--max-new-tokens", type=number(int), default=128,
                      help="length of each target answer (default: %(default)s)")
    dist.add_argument("--batch-tokens", type=number(int), default=512,
                      help="tokens per training step (default: %(default)s)")
    dist.add_argument("--lr", type=number(float), default=1e-3, help="peak learning rate (default: %(default)s)")
    dist.add_argument("--loss", choices=["kl", "ce"], default="kl",
                      help="kl: match the target's top-32 distributions; ce: its answer tokens (default: kl)")
    dist.add_argument("--train-embeddings", action="store_true",
                      help="also train the embeddings and LM head (default: frozen, the target's)")
    dist.add_argument("--seed", type=number(int), default=0, help="shuffling seed (default: 0)")
    dist.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    return dist


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .train import DistillConfig, check_output

    config = DistillConfig(layers=args.layers, max_minutes=args.max_minutes, max_steps=args.max_steps,
                           max_new_tokens=args.max_new_tokens, batch_tokens=args.batch_tokens,
                           lr=args.lr, loss=args.loss, train_embeddings=args.train_embeddings,
                           num_prompts=args.num_prompts, seed=args.seed, extra_prompts=args.prompts)
    config.check()
    if args.out:
        check_output(Path(args.out))
    from ..prompts import load_prompts

    for path in args.prompts:
        load_prompts(path)  # a bad file fails now, not after the target has answered
    from . import default_distill_dir
    from .train import distill
    from ..models import load_model

    loaded = load_model(args.target, device=args.device, dtype="float32")
    out = Path(args.out) if args.out else default_distill_dir(loaded.path, args.layers)
    check_output(out)
    figures = distill(loaded.backend.model, loaded.tokenizer, sorted(loaded.backend.eos_token_ids), out,
                      config, target_path=str(loaded.path))
    agree = figures["holdout_agreement_before"], figures["holdout_agreement_after"]
    print(f"wrote {out}\n"
          f"draft model: {figures['layers']} layers {figures['student_layers']}, "
          f"{figures['parameters'] / 1e6:.1f}M parameters, {figures['size_bytes'] / 2**20:.0f} MiB\n"
          f"data: {figures['examples']} target answers, {figures['data_seconds']:.0f} s; training: "
          f"{figures['steps']} steps in {figures['train_seconds'] / 60:.1f} min, loss "
          f"{figures['loss_first'] or 0:.3f} -> {figures['loss_last'] or 0:.3f}")
    if agree[0] is not None:
        print(f"held-out top-1 agreement with the target: {agree[0]:.2f} before, {agree[1]:.2f} after")
    print(f"use it: speclm generate --draft-model {out} ...  (or --drafter distilled)")
    return 0
