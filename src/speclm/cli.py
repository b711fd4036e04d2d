"""``speclm`` command line: generate and chat, streaming, with speculative decoding stats.

User mistakes (bad flags or values, missing files, bad models) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .bench import command as bench_command
from .distill import command as distill_command
from .learned import command as train_command
from .errors import SpeclmError
from .flags import _positive, add_backend_flags, add_target_flags
from .sampling import SamplingParams

EXIT_USAGE = 2
_DRAFTERS_HELP = """drafters (--drafter NAME[:key=value,...]):
  ngram[:min=2,max=3]             prompt lookup in the request's own text
  suffix[:capacity=262144,factor=1]  suffix matching over every prompt and output of the session
  recycle[:topk=8]                token recycling: the target's own top-k from earlier verifies
  layerskip[:skip=3,5-9]          the target minus some layers; without skip= the set is searched
                                  for this model once (minutes; measured speedup; cached)
  early-exit[:layers=N]           the target's first N layers (default: a third)
  draft:path=DIR[,p_min=P]        a smaller model with the target's tokenizer (= --draft-model)
  distilled[:path=DIR]            the draft model `speclm distill` made for this target
  quant[:bits=4,fast=0]           the quantized self-draft: the target's own weights at fewer bits
                                  (torch: an int8/int4 copy, bits=8/4; llama.cpp: a requantized
                                  copy of its GGUF, bits=2/3/4/8, made once and cached); fast=1
                                  runs an eager target's draft compiled (minutes to compile, once)
  auto[:candidates=a,b,...]       the default: measure candidates on the live requests, keep the
                                  fastest, remember the choice per model (default candidates:
                                  none = plain decoding, ngram, suffix, recycle, plus layerskip
                                  and distilled where already prepared for this model)"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own code)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    add_backend_flags(add_target_flags(p))
    d = p.add_argument_group("speculative decoding")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--ngram", action="store_true",
                       help="draft by prompt lookup (n-gram match in prompt + output) only")
    which.add_argument("--draft-model", metavar="PATH",
                       help="draft with a smaller model sharing the target's tokenizer "
                            "(HF folder, .gguf, or 'default')")
    which.add_argument("--drafter", metavar="NAME[:OPTS]",
                       help="a drafter by name: ngram, suffix, recycle, layerskip[:skip=3,5-9], "
                            "early-exit[:layers=N], draft:path=DIR, distilled, quant[:bits=4], "
                            "medusa:path=DIR, eagle:path=DIR, auto (the default; see below)")
    which.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    d.add_argument("--draft-max", type=_positive(int), default=None,
                   help="K, most tokens drafted per round: the adaptive policy's upper bound, "
                        "or every round's K with --no-adaptive (default: the drafter's own: 10 for "
                        "auto, --ngram and suffix, whose drafts cost little; 5 for a draft model; "
                        "3 for layerskip and early-exit; 2 for recycle)")
    d.add_argument("--draft-min", type=_positive(int), default=0,
                   help="drop drafts shorter than this (default: %(default)s)")
    d.add_argument("--draft-p-min", type=_positive(float), default=0.0,
                   help="draft model stops when its top probability is below this (default: off)")
    d.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="choose K (up to --draft-max) each round from the live acceptance and the "
                        "target's measured cost model (timed once per model and backend, cached), "
                        "drafting nothing when speculation would not pay; --no-adaptive drafts "
                        "--draft-max every round (default: on)")
    d.add_argument("--async", dest="async_draft", action="store_true",
                   help="speculative speculative decoding: while the target verifies, the draft "
                        "model drafts the next round for the likeliest outcomes (draft models only)")
    d.add_argument("--fanout", type=_positive(int), default=8,
                   help="with --async: outcomes drafted ahead per round (default: %(default)s)")
    d.add_argument("--ngram-min", type=_positive(int), default=2,
                   help="smallest n-gram; 1-grams match often and are mostly rejected (default: 2)")
    d.add_argument("--ngram-max", type=_positive(int), default=3, help="largest n-gram (default: 3)")

    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", "--temp", type=_positive(float), default=0.0,
                   help="0 = greedy, identical to plain greedy decoding (default: %(default)s)")
    s.add_argument("--top-k", type=_positive(int), default=0, help="0 = off (default)")
    s.add_argument("--top-p", type=_positive(float), default=1.0, help="in (0, 1]; 1 = off (default)")
    s.add_argument("--seed", type=_positive(int), default=None,
                   help="random seed for sampling: the same seed gives the same tokens with or without "
                        "speculation, whatever the drafter")
    s.add_argument("--max-tokens", "-n", type=_positive(int), default=256,
                   help="most tokens to generate (default: %(default)s)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--system", help="system message for chat-formatted prompts")

    g = p.add_argument_group("structured output (at most one; lossless under speculation)")
    which = g.add_mutually_exclusive_group()
    which.add_argument("--json-schema", metavar="FILE",
                       help="the output is JSON valid under the JSON schema in FILE (written "
                            "compactly, ', ' and ': ' between items; properties in schema order)")
    which.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    which.add_argument("--regex", metavar="RE",
                       help="the whole output matches the regular expression RE (Rust syntax)")
    which.add_argument("--grammar", metavar="FILE",
                       help="the output follows the grammar in FILE: Lark-style (llguidance's "
                            "dialect, start rule 'start') or llama.cpp GBNF (start rule 'root')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="speclm",
        description="Lossless speculative decoding for Hugging Face causal LMs. The output is the "
                    "target model's own (token-identical when greedy or seeded); a drafter only makes it "
                    "come faster.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate from one prompt, streaming, then print stats",
                         description="Generate from a prompt given as argument, --file or stdin.",
                         epilog=_DRAFTERS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt", nargs="?", help="the prompt ('-' or absent: read stdin)")
    gen.add_argument("--file", "-f", help="read the prompt from this file")
    gen.add_argument("--raw", action="store_true",
                     help="feed the prompt as is, without the model's chat template")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding on the same prompt; print the measured speedup "
                          "and whether the outputs are identical (greedy, or sampled with --seed)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text and stats) instead of streaming")
    gen.add_argument("--quiet", "-q", action="store_true", help="do not print stats")
    _add_model_flags(gen)
    bench_command.add_parser(sub, _positive)
    distill_command.add_parser(sub, _positive)
    train_command.add_parser(sub, _positive)
    chat = sub.add_parser("chat", help="interactive multi-turn chat, streaming",
                          description="Chat with the model. Commands: /reset, /stats, /exit.",
                          epilog=_DRAFTERS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--stats", action="store_true", help="print stats after every answer")
    _add_model_flags(chat)
    from .serve.launch import add_arguments as add_serve_arguments

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with batched speculation",
                           description="Serve /v1/chat/completions, /v1/completions, /v1/models, "
                                       "/health and /metrics; see docs/serving.md.")
    add_serve_arguments(serve)
    return parser


def _sampling(args: argparse.Namespace) -> SamplingParams:
    schema = _read_text(args.json_schema, "JSON schema") if args.json_schema else None
    grammar = _read_text(args.grammar, "grammar") if args.grammar else None
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, stop=args.stop, seed=args.seed,
                          json_schema=schema, json_object=args.json_object, regex=args.regex,
                          grammar=grammar)


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise SpeclmError(f"cannot read {what} file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpeclmError(f"{what} file {path!r} is not UTF-8 text") from None


def _make_llm(args: argparse.Namespace):
    from .api import LLM  # heavy imports only after the flags are known to be valid
    from .models.llamacpp import set_native_logging

    set_native_logging(args.verbose)

    from .draft_length import DraftLengthConfig
    from .drafters.registry import KINDS, parse_drafter

    if args.no_spec:
        spec, default_k = None, 5
    elif args.draft_model:
        spec, default_k = args.draft_model, KINDS["draft"].default_k
    else:  # without a draft model: auto, the measured choice among the training-free
        spec = "ngram" if args.ngram else (args.drafter or "auto")  # drafters and plain decoding
        default_k = KINDS[parse_drafter(spec).name].default_k
    k = default_k if args.draft_max is None else args.draft_max
    # check every value before spending time on loading models
    DraftLengthConfig(k, args.draft_min, args.adaptive)
    parse_drafter(f"ngram:min={args.ngram_min},max={args.ngram_max}")
    if not 0.0 <= args.draft_p_min < 1.0:
        raise SpeclmError(f"--draft-p-min must be in [0, 1), got {args.draft_p_min}")
    if args.async_draft and (spec is None or (not args.draft_model and
                                              "async" not in KINDS[parse_drafter(spec).name].options)):
        raise SpeclmError("--async needs a draft model: --draft-model PATH or --drafter draft:...|distilled|quant")
    if args.fanout < 1:
        raise SpeclmError(f"--fanout must be >= 1, got {args.fanout}")
    return LLM(args.model, spec, k, draft_min=args.draft_min, draft_p_min=args.draft_p_min,
               adaptive_draft=args.adaptive, async_draft=args.async_draft, async_fanout=args.fanout,
               ngram_min=args.ngram_min, ngram_max=args.ngram_max,
               device=args.device, dtype=args.dtype, gguf_file=args.gguf_file,
               backend=args.backend, compile=args.compile, quantize=args.quantize)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.file and args.prompt:
        raise SpeclmError("give the prompt as an argument or with --file, not both")
    if args.file:
        text = _read_text(args.file, "prompt")
    elif args.prompt is None or args.prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise SpeclmError("no prompt: give one as an argument, with --file, or on stdin")
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            raise SpeclmError("the prompt on stdin is not UTF-8 text") from None
    else:
        text = args.prompt
    if not text.strip():
        raise SpeclmError("the prompt is empty")
    return text


def _as_prompt(llm, text: str, args: argparse.Namespace):
    if args.raw or not getattr(llm.tokenizer, "chat_template", None):
        return text
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return messages + [{"role": "user", "content": text}]


def _cmd_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    params = _sampling(args)
    llm = _make_llm(args)
    prompt = _as_prompt(llm, text, args)
    if args.compare:  # warm-up so neither run pays one-time costs
        for _ in llm.stream(prompt, SamplingParams(max_tokens=2), speculative=False):
            pass
    out_text, ids, chunk = [], [], None
    for chunk in llm.stream(prompt, params):
        out_text.append(chunk.text)
        ids.extend(chunk.token_ids)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    stats = chunk.stats
    if args.json:
        result = {"text": "".join(out_text), "token_ids": ids,
                  "finish_reason": chunk.finish_reason, "stats": stats.to_dict()}
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not args.quiet:
            print(stats.summary(args.verbose), file=sys.stderr)
    if args.compare:
        plain_ids, plain = [], None
        for plain in llm.stream(prompt, params, speculative=False):
            plain_ids.extend(plain.token_ids)
        speedup = stats.tokens_per_s / plain.stats.tokens_per_s if plain.stats.tokens_per_s else 0.0
        identical = plain_ids == ids
        if args.json:
            result["compare"] = {"plain_stats": plain.stats.to_dict(), "speedup": speedup,
                                 "identical": identical}
        else:
            if not params.greedy and params.seed is None:
                verdict = "differ by design when sampling without --seed (same distribution, other draws)"
            elif identical:
                verdict = "identical"
            else:
                at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b),
                          min(len(ids), len(plain_ids)))
                verdict = f"DIFFERENT from generated token {at} ({_mismatch_advice(llm)})"
            print(f"plain decoding: {plain.stats.generated_tokens} tokens, "
                  f"{plain.stats.tokens_per_s:.1f} tok/s\nspeedup: {speedup:.2f}x; outputs {verdict}",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0


def _mismatch_advice(llm) -> str:
    """What a greedy mismatch may mean and how to check it, for the backend that ran."""
    import torch

    backend = llm.backend_name
    if backend == "llamacpp":
        return ("a bug, or a near-tie between the top two tokens: llama.cpp's quantized kernels "
                "round a one-token step and a multi-token verify differently; for an exact check "
                "run the same prompt with --backend torch --dtype float64")
    if llm.target.dtype == torch.float64:
        return "float64 leaves no room for rounding: a bug, please report it"
    extra = " without --compile/--quantize" if backend != "torch" else ""
    return ("a bug, or a float rounding near-tie between the top two tokens; "
            f"try --backend torch --dtype float64{extra}")


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _make_llm(args)
    if not getattr(llm.tokenizer, "chat_template", None):
        raise SpeclmError(f"model {args.model!r} has no chat template; use 'speclm generate --raw'")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    last = None
    print("speclm chat: /reset clears the conversation, /stats shows the last answer's stats, "
          "/exit quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history.clear()
            continue
        if command == "/stats":
            print(last.summary(args.verbose) if last else "no answer yet", file=sys.stderr)
            continue
        answer, chunk = [], None
        try:
            for chunk in llm.stream(system + history + [{"role": "user", "content": line}], params):
                answer.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except SpeclmError as exc:  # e.g. the conversation outgrew the context: keep the session
            print(f"\nspeclm: error: {exc} (/reset starts over)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the session
            print("\n[answer interrupted]", file=sys.stderr)
        sys.stdout.write("\n")
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": "".join(answer)}]
        last = chunk.stats if chunk is not None else last
        if args.stats:
            print(last.summary(args.verbose), file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .serve.launch import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    start = time.perf_counter()
    try:
        command = {"generate": _cmd_generate, "chat": _cmd_chat, "bench": bench_command.run,
                   "distill": distill_command.run, "train-drafter": train_command.run,
                   "serve": _cmd_serve}[args.command]
        return command(args)
    except SpeclmError as exc:
        print(f"speclm: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.perf_counter() - start:.1f} s", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
