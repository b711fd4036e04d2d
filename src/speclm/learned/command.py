"""``speclm train-drafter``: make Medusa heads or an EAGLE head for a target, on CPU or CUDA.

    speclm train-drafter --method eagle --target default --out drafters/smollm2-eagle --max-minutes 20

Steps: the target answers the training prompts (cached), the drafter trains with a progress bar
and a held-out acceptance estimate after every epoch, and the folder is written after every
epoch, so an interrupted run leaves a usable drafter and running the same command again resumes.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

from ..errors import SpeclmError

STATE_FILE = "train-state.pt"


def add_parser(sub, number) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train-drafter", help="train Medusa heads or an EAGLE head on the target's own answers",
        description="Self-distillation: the target answers the prompts, the drafter learns to "
                    "predict its tokens from its hidden states. Stages: prompts the target writes "
                    "itself (--self-prompts), its greedy answers (--rows at a time on the batched "
                    "engine, kept in the speclm cache for every drafter of this target), its hidden "
                    "states (recorded in the same pass, bfloat16 shards in --out), training. Every "
                    "stage resumes where an interrupted run stopped when run again.")
    p.add_argument("--method", required=True, choices=["medusa", "eagle"], help="which drafter")
    p.add_argument("--target", default="default", help="target model (default: %(default)s)")
    p.add_argument("--out", required=True, help="folder for the drafter (and its feature shards)")
    p.add_argument("--prompts", action="append", default=[],
                   help="JSONL of extra training prompts ({\"turns\": [...]} or {\"prompt\": ...} per "
                        "line), repeatable")
    p.add_argument("--no-default-prompts", action="store_true",
                   help="train on --prompts only, without speclm's built-in training prompts")
    p.add_argument("--max-new-tokens", type=number(int), default=192,
                   help="length of the target's answers (default: %(default)s)")
    p.add_argument("--epochs", type=number(int), default=4, help="(default: %(default)s)")
    p.add_argument("--max-minutes", type=number(float), default=None,
                   help="training time bound (the data stages are bounded by --data-minutes); the "
                        "training state is saved every 10 minutes and at the bound, and a run with "
                        "the same --out resumes it")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="after training, also write a bfloat16 copy of the drafter to DIR (the form "
                        "speclm ships: half the bytes, drafting unchanged)")
    p.add_argument("--data-minutes", type=number(float), default=None,
                   help="time bound on writing prompts and answering them (default: none); answers "
                        "made so far are kept, the next run goes on from there, and features are "
                        "then recorded for every answer")
    p.add_argument("--data-only", action="store_true",
                   help="stop after the data stages (prompts, answers, features): train later, with "
                        "the same --out, from the data kept")
    p.add_argument("--self-prompts", type=number(int), default=0,
                   help="also train on this many prompts the target writes itself (a chat model "
                        "opens a user turn; deduplicated; degenerate ones dropped) (default: 0)")
    p.add_argument("--self-prompt-starts", default="tasks", metavar="tasks|free|FILE",
                   help="how self-written prompts begin: tasks (half of them with the opening words "
                        "of a kind of task: translate, summarise, answer from a passage, code, word "
                        "problems, role-play, ...), free (the model's own messages), or a text file "
                        "with one opening per line (\\n for a line break; an empty line: free); each "
                        "choice keeps its own store of prompts, so prompts written before this "
                        "option existed are found again with free (default: %(default)s)")
    p.add_argument("--passage-prompts", type=number(int), default=0, metavar="N",
                   help="also train on N prompts built on the target's own answers to the other "
                        "prompts: translate, summarise, list the points of, or answer a question "
                        "from one or two of them, so the data covers long inputs the model reads "
                        "(answered after the other prompts, in the same data stage) (default: 0)")
    p.add_argument("--rows", type=number(int), default=64,
                   help="answers decoded together, one batched forward per step (default: %(default)s)")
    p.add_argument("--max-feature-gb", type=number(float), default=16.0,
                   help="disk bound on the stored target features in --out (default: %(default)s)")
    p.add_argument("--batch-size", type=number(int), default=8, help="sequences per step (default: %(default)s)")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="precision of the training products: bfloat16 under autocast (the weights, "
                        "gradients and optimizer state stay float32), or float32; auto: bfloat16 where "
                        "the device computes it natively (CPUs with AMX or AVX512-BF16, GPUs with "
                        "bfloat16), else float32 (default: %(default)s)")
    p.add_argument("--lr", type=number(float), default=None, help="learning rate (default: 3e-4 eagle, 1e-3 medusa)")
    p.add_argument("--draft-vocab", type=number(int), default=None,
                   help="tokens the drafter can propose, the most frequent in the data; 0: the "
                        "target's whole vocabulary through its own LM head, shared (default: 0 for "
                        "medusa, as in Medusa; 8192 for eagle)")
    p.add_argument("--heads", type=number(int), default=4, help="medusa: number of heads (default: %(default)s)")
    p.add_argument("--tree-budget", type=number(int), default=24,
                   help="medusa: nodes of the static tree built from held-out accuracy (default: %(default)s)")
    p.add_argument("--feature-layers", default=None,
                   help="eagle: comma-separated target layers to read (default: low, middle, high)")
    p.add_argument("--parallel-draft", type=number(int), default=0, metavar="N",
                   help="eagle: train the head to propose N tokens in one forward (P-EAGLE / PARD "
                        "style: learned mask pairs stand for the positions not drafted yet; its "
                        "N - 1 training-time-test steps replace --unroll); such a head drafts a chain "
                        "of up to N tokens per round for one head forward (default: 0, one forward "
                        "per drafted token)")
    p.add_argument("--init", metavar="DIR", default=None,
                   help="start from the weights of a drafter made for the same target with the same "
                        "method, feature layers and draft vocabulary (for example an autoregressive "
                        "EAGLE head, to make a parallel one in fewer epochs); parts it lacks start "
                        "fresh")
    p.add_argument("--unroll", type=number(int), default=2,
                   help="eagle: training-time-test steps on its own outputs (default: %(default)s)")
    p.add_argument("--held-out", type=number(float), default=0.1,
                   help="fraction of the answers held out, each drawn by a hash of its prompt and "
                        "--seed, so answers held out stay held out as the store grows (default: "
                        "%(default)s)")
    p.add_argument("--restart", action="store_true", help="ignore a saved training state in --out")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--seed", type=number(int), default=0)
    return p


def split_held_out(sequences: list, fraction: float, seed: int) -> tuple[list, list]:
    """(held out, train): each answer is held out by a hash of its key and the seed, so a store
    that grows keeps its held-out answers held out (a head trained before, then continued with
    ``--init`` or resumed on more data, never trains on what it is measured on). At least one of
    each, for stores of a handful of answers."""
    def draw(s) -> float:
        return int(hashlib.sha256(f"{seed}:{s.key}".encode()).hexdigest()[:12], 16) / 16**12

    ranked = sorted(sequences, key=draw)
    cut = min(max(1, sum(draw(s) < fraction for s in ranked)), len(ranked) - 1)
    train = ranked[cut:]
    random.Random(seed).shuffle(train)
    return ranked[:cut], train


def _prompt_starts(spec: str) -> tuple[str, ...]:
    """--self-prompt-starts: the built-in task openings, none, or a file's lines."""
    from .self_prompts import TASK_STARTS

    if spec == "tasks":
        return TASK_STARTS
    if spec == "free":
        return ("",)
    try:
        lines = Path(spec).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpeclmError(f"--self-prompt-starts: not tasks, free or a readable text file: {spec!r} "
                          f"({getattr(exc, 'strerror', None) or exc})") from None
    if not lines:
        raise SpeclmError(f"--self-prompt-starts: {spec} has no lines")
    return tuple(line.replace("\\n", "\n") for line in lines)


def _feature_layers(text: str | None, num_layers: int) -> list[int]:
    if text is None:
        return [2, num_layers // 2, num_layers - 1] if num_layers >= 4 else list(range(1, num_layers + 1))
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpeclmError(f"--feature-layers takes comma-separated integers, got {text!r}") from None
    if not layers or any(not 0 <= x <= num_layers for x in layers):
        raise SpeclmError(f"--feature-layers must be in 0..{num_layers} (0 = embeddings)")
    return layers


def _start_from(module, folder: Path, config, identity, layers: list[int], draft_ids):
    """Load ``folder``'s weights into ``module`` (--init) after checking they fit; returns the
    draft vocabulary the module now has (the folder's)."""
    from .checkpoint import load_weights

    if not config.target.same_as(identity):
        raise SpeclmError(f"--init {str(folder)!r} was made for {config.target.name}, not this target")
    if config.feature_layers != layers:
        raise SpeclmError(f"--init {str(folder)!r} reads layers {config.feature_layers}, not {layers}")
    size = 0 if draft_ids is None else int(draft_ids.shape[0])
    if config.draft_vocab_size != size:
        raise SpeclmError(f"--init {str(folder)!r} drafts over {config.draft_vocab_size} tokens, not {size} "
                          "(--draft-vocab)")
    load_weights(module, folder, strict=False)
    print(f"speclm: starting from the drafter in {folder}", file=sys.stderr)
    return None if draft_ids is None else module.draft_to_target


def run(args: argparse.Namespace) -> int:
    import torch

    from ..distill.data import distill_prompts
    from ..models import load_model
    from .checkpoint import DrafterConfig, TargetIdentity, save_weights
    from .data import build_dataset
    from .modules import EagleHead, MedusaHeads
    from .train import EagleTrainer, MedusaTrainer, draft_vocabulary

    if not 0 < args.held_out < 0.5:
        raise SpeclmError(f"--held-out must be in (0, 0.5), got {args.held_out}")
    for flag in ("epochs", "max_new_tokens", "batch_size", "heads", "tree_budget", "draft_vocab",
                 "max_minutes", "lr", "data_minutes", "rows", "max_feature_gb"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SpeclmError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if min(args.unroll, args.seed, args.self_prompts, args.passage_prompts) < 0:
        raise SpeclmError(f"--unroll, --seed, --self-prompts and --passage-prompts must be >= 0, got "
                          f"{args.unroll}, {args.seed}, {args.self_prompts} and {args.passage_prompts}")
    if args.parallel_draft and (args.method != "eagle" or args.parallel_draft < 2):
        raise SpeclmError(f"--parallel-draft is for --method eagle and at least 2, got {args.parallel_draft}")
    if args.init is not None:
        init_config = DrafterConfig.load(Path(args.init).expanduser())
        if init_config.kind != args.method:
            raise SpeclmError(f"--init {args.init!r} holds a {init_config.kind} drafter, not {args.method}")
    if args.no_default_prompts and not args.prompts and not args.self_prompts:
        raise SpeclmError("--no-default-prompts needs --prompts FILE or --self-prompts N")
    _feature_layers(args.feature_layers, 10**6)  # malformed text fails before the model loads
    starts = _prompt_starts(args.self_prompt_starts)
    prompts = distill_prompts(args.prompts)
    if args.no_default_prompts:
        prompts = prompts[len(distill_prompts()):]
    out = Path(args.out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpeclmError(f"cannot create {args.out!r}: {exc.strerror}") from None

    loaded = load_model(args.target, device=args.device, dtype="float32")
    target = loaded.backend.model
    for p in target.parameters():
        p.requires_grad_(False)
    from ..models.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    identity = TargetIdentity.of(target, DEFAULT_MODEL_NAME if loaded.name == DEFAULT_MODEL else loaded.name)
    layers = [-1] if args.method == "medusa" else _feature_layers(args.feature_layers, target.config.num_hidden_layers)
    start = time.monotonic()
    deadline = start + 60 * args.data_minutes if args.data_minutes else None
    if args.self_prompts:
        from .answers import answers_folder
        from .self_prompts import write_prompts
        from ..models.loading import cache_dir

        folder = answers_folder(cache_dir(), loaded.name, identity.fingerprint, "torch", args.max_new_tokens)
        written, _ = write_prompts(loaded.backend, loaded.tokenizer, args.self_prompts, folder, seed=args.seed,
                                   known=prompts, rows=args.rows, deadline=deadline, starts=starts)
        print(f"speclm: {len(written)} prompts written by the target", file=sys.stderr)
        prompts = prompts + written
    sequences = build_dataset(loaded.backend, loaded.tokenizer, prompts, target_name=loaded.name,
                              fingerprint=identity.fingerprint, feature_layers=layers,
                              max_new_tokens=args.max_new_tokens, folder=out, rows=args.rows,
                              deadline=deadline, max_feature_bytes=int(args.max_feature_gb * 2**30),
                              load=not args.data_only, passages=args.passage_prompts, seed=args.seed)
    if args.data_only:
        print(f"speclm: data stages done in {(time.monotonic() - start) / 60:.1f} min; run again without "
              f"--data-only (same --out) to train", file=sys.stderr)
        return 0
    data_minutes = (time.monotonic() - start) / 60
    if len(sequences) < 4:
        raise SpeclmError(f"only {len(sequences)} usable answers; give more prompts")
    held_out, train = split_held_out(sequences, args.held_out, args.seed)
    vocab = args.draft_vocab if args.draft_vocab is not None else (0 if args.method == "medusa" else 8192)
    if vocab == 0 and args.method == "eagle":
        vocab = identity.vocab_size  # the whole vocabulary, in its own trained head
    draft_ids = (None if vocab == 0 else
                 draft_vocabulary(train, vocab, identity.vocab_size, sorted(loaded.backend.eos_token_ids)))
    device = loaded.backend.device
    from ..models.dtypes import fast_dtype

    compute = fast_dtype(device) if args.precision == "auto" else getattr(torch, args.precision)
    print(f"speclm: training products in {str(compute).removeprefix('torch.')}", file=sys.stderr)
    if args.method == "medusa":
        module = MedusaHeads.create(target, args.heads, draft_ids).to(device)
    else:
        module = EagleHead.create(target, layers, draft_ids, args.parallel_draft).to(device)
    if args.init is not None:
        draft_ids = _start_from(module, Path(args.init).expanduser(), init_config, identity, layers, draft_ids)
    if args.method == "medusa":
        trainer = MedusaTrainer(module, train, held_out, vocab_size=identity.vocab_size, epochs=args.epochs,
                                batch_size=args.batch_size, lr=args.lr or 1e-3, device=device,
                                max_seconds=args.max_minutes * 60 if args.max_minutes else None, seed=args.seed,
                                compute_dtype=compute)
    else:
        trainer = EagleTrainer(module, target.get_input_embeddings(), train, held_out,
                               vocab_size=identity.vocab_size, epochs=args.epochs, batch_size=args.batch_size,
                               lr=args.lr or 3e-4, device=device,
                               unroll=args.parallel_draft - 1 if args.parallel_draft else args.unroll,
                               max_seconds=args.max_minutes * 60 if args.max_minutes else None, seed=args.seed,
                               compute_dtype=compute)
    state_path = out / STATE_FILE
    if state_path.is_file() and not args.restart:
        saved = torch.load(state_path, weights_only=False)
        if saved.get("method") != args.method or saved.get("fingerprint") != identity.fingerprint:
            raise SpeclmError(f"{state_path} is a {saved.get('method')} run for another target or method; "
                              "use --restart or another --out")
        trainer.load_state_dict(saved["trainer"])
        print(f"speclm: resuming at epoch {trainer.state.epoch + 1} ({trainer.state.seconds / 60:.1f} min "
              "trained so far)", file=sys.stderr)
        if trainer.max_seconds is not None:
            trainer.max_seconds += trainer.state.seconds  # --max-minutes counts this run's time

    def write(figures: dict | None) -> None:
        history = trainer.state.history
        accuracy = history[-1]["accuracy"] if history else []
        training = dict(sequences=len(train), held_out=len(held_out), answer_tokens=sum(
            s.ids.shape[0] - s.prompt_len for s in train), data_minutes=round(data_minutes, 1),
            train_minutes=round(trainer.state.seconds / 60, 1), epochs=trainer.state.epoch,
            held_out_accuracy=accuracy, history=history, max_new_tokens=args.max_new_tokens)
        if args.method == "medusa" and accuracy:
            from ..drafters.medusa import best_static_tree

            training["tree"] = best_static_tree(accuracy, args.tree_budget)
        config = DrafterConfig(kind=args.method, target=identity,
                               draft_vocab_size=0 if draft_ids is None else int(draft_ids.shape[0]),
                               feature_layers=layers, num_heads=args.heads if args.method == "medusa" else 0,
                               parallel=args.parallel_draft, training=training)
        save_weights(module, out)
        config.save(out)
        torch.save(dict(method=args.method, fingerprint=identity.fingerprint, trainer=trainer.state_dict()), state_path)
        if figures is not None:
            top1 = " ".join(f"{a:.2f}" for a in figures["held_out_top1"])
            print(f"epoch {figures['epoch']}: loss {figures['loss']:.3f}, held-out top-1 accuracy by "
                  f"draft position {top1} ({figures['seconds'] / 60:.1f} min)", file=sys.stderr)

    trainer.run(on_epoch=write, on_checkpoint=lambda: write(None))
    if not trainer.state.history:
        write(None)
    if args.export:
        from .checkpoint import export_drafter

        size = export_drafter(out, Path(args.export))
        print(f"speclm: exported a bfloat16 copy to {args.export} ({size / 2**20:.1f} MiB)", file=sys.stderr)
    params = sum(p.numel() for p in module.parameters())
    vocab_text = "the target's LM head (shared)" if draft_ids is None else f"{draft_ids.shape[0]} tokens"
    print(f"wrote {out}: {args.method} drafter, {params / 1e6:.1f}M parameters, draft vocabulary "
          f"{vocab_text}, trained {trainer.state.seconds / 60:.1f} min on {len(train)} answers")
    return 0
