"""Structured outputs in the engine: JSON schema, regex and grammars (Lark and GBNF), lossless.

- every drafter, in a batch of constrained and unconstrained rows: each constrained output parses
  and validates (the ``jsonschema`` package and Python's ``re``, independent of llguidance), and
  greedy rows are token-identical to constrained plain decoding;
- sampling: the speculative output distribution equals the masked, renormalised target
  distribution (chi-square, a 5-token vocabulary, a grammar with a forced token, an adversarial
  draft model whose q often falls outside the grammar);
- the matcher follows the verifier: after rejections (chains) and tree verification its state is
  that of a fresh matcher over the committed output;
- bad schemas and grammars are one-line :class:`SpeclmError` s.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter, NgramDrafter
from speclm.drafters.auto import AutoDrafter, NoDrafter
from speclm.drafters.eagle import EagleDrafter
from speclm.drafters.layer_skip import early_exit_drafter, layer_skip_drafter
from speclm.drafters.medusa import MedusaDrafter, best_static_tree
from speclm.drafters.recycle import RecycleDrafter
from speclm.drafters.suffix import SuffixDrafter
from speclm.drafters.tree_search import TreeShape
from speclm.engine import Engine, generate_tokens
from speclm.errors import SpeclmError
from speclm.learned.modules import EagleHead, MedusaHeads
from speclm.models.rows import make_rows
from speclm.sampling import SamplingParams, warp_probs
from speclm.stats import RequestStats
from speclm.structured.compiler import GrammarCompiler
from speclm.structured.spec import grammar_spec
from speclm.verifier import verify
from speclm.drafters.base import Draft, DraftContext

from .conftest import backend, noisy_copy, tiny_model
from .test_batch import drive
from .test_lossless import assert_matches_distribution

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["fox", "dog", "cat"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"(yes|no): [0-9]{1,3}!"
LARK = 'start: "the " COLOR " " ANIMAL "."\nCOLOR: "red" | "brown" | "lazy"\nANIMAL: "fox" | "dog"'
GBNF = 'root ::= "def " name "(" name ")"\nname ::= [a-z] [a-z]? [a-z]?'
GRAMMAR_RE = {LARK: r"the (red|brown|lazy) (fox|dog)\.", GBNF: r"def [a-z]{1,3}\([a-z]{1,3}\)"}
CONSTRAINTS = [{"json_schema": SCHEMA}, {"regex": REGEX}, {"grammar": LARK}, {"grammar": GBNF}]


def valid(text: str, constraint: dict) -> bool:
    """Checked without llguidance: jsonschema for schemas, Python's re for the rest."""
    if "json_schema" in constraint:
        try:
            jsonschema.validate(json.loads(text), constraint["json_schema"])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    pattern = constraint["regex"] if "regex" in constraint else GRAMMAR_RE[constraint["grammar"]]
    return re.fullmatch(pattern, text) is not None


@pytest.fixture(scope="module")
def setup(tiny_tokenizer):
    vocab = len(tiny_tokenizer)
    target = tiny_model(vocab, seed=10, seed_layers=4)
    lm = backend(target)
    return target, lm, GrammarCompiler(tiny_tokenizer, vocab, lm.eos_token_ids)


def row_drafters(target, vocab: int) -> dict:
    """Every drafter of the registry (distilled = a draft model), chains and trees."""
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    gen = torch.Generator().manual_seed(0)
    eagle = EagleHead.create(target, [1, 2], torch.arange(vocab)).double()
    heads = MedusaHeads.create(target, 3, torch.arange(vocab)).double()
    with torch.no_grad():
        for p in list(eagle.parameters()) + list(heads.blocks.parameters()):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    paths = best_static_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]], 10)
    embed = target.get_input_embeddings()
    return {
        "ngram": lambda h: NgramDrafter(1, 3),
        "suffix": lambda h: SuffixDrafter(capacity=256),
        "recycle": lambda h: RecycleDrafter(vocab, 4),
        "draft-model": lambda h: DraftModelDrafter(draft_lm.fork(), vocab),
        "draft-model-tree": lambda h: DraftModelDrafter(draft_lm.fork(), vocab, tree=TreeShape(top_k=3, budget=10)),
        "layerskip": lambda h: layer_skip_drafter(h, [1, 2]),
        "early-exit": lambda h: early_exit_drafter(h, 2),
        "eagle-tree": lambda h: EagleDrafter(eagle, embed, [1, 2], vocab, TreeShape(3, 10)),
        "medusa": lambda h: MedusaDrafter(heads, paths),
        "auto": lambda h: AutoDrafter({"none": (NoDrafter(), 1), "ngram": (NgramDrafter(1, 3), 6),
                                       "recycle": (RecycleDrafter(vocab, 4), 3)},
                                      probe_rounds=2, reprobe_every=12),
    }


def plain(lm, compiler, prompt, params) -> list[int]:
    return [t for step in generate_tokens(lm, prompt, params, grammars=compiler) for t in step.tokens]


def requests(tokenizer) -> list[tuple[str, torch.Tensor, SamplingParams, dict | None]]:
    """Greedy and seeded sampled rows under every constraint, and one unconstrained row."""
    texts = ["the quick brown fox", "def add(a, b):", "Speculative decoding drafts", "the lazy dog."]
    out = []
    for i, constraint in enumerate(CONSTRAINTS):
        prompt = torch.tensor(tokenizer(texts[i % len(texts)])["input_ids"])
        out.append((f"greedy{i}", prompt, SamplingParams(max_tokens=80, **constraint), constraint))
        out.append((f"sampled{i}", prompt, SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=80,
                                                          **constraint), constraint))
    prompt = torch.tensor(tokenizer(texts[0])["input_ids"])
    out.append(("free", prompt, SamplingParams(max_tokens=12, ignore_eos=True), None))
    return out


@pytest.mark.parametrize("name", list(row_drafters(tiny_model(8, seed=0, seed_layers=4), 8)))
def test_every_drafter_gives_valid_outputs_identical_to_constrained_plain_decoding(setup, tiny_tokenizer, name):
    target, lm, compiler = setup
    factory = row_drafters(target, len(tiny_tokenizer))[name]
    engine = Engine(make_rows(backend(target), 4), drafter_factory=factory,
                    draft_length=DraftLengthConfig(4, 0, adaptive=False), grammars=compiler)
    reqs = requests(tiny_tokenizer)
    out = drive(engine, {0: [(rid, p, sp) for rid, p, sp, _ in reqs]})
    forced = 0
    for rid, prompt, params, constraint in reqs:
        tokens, finish, stats = out[rid]
        if params.greedy:
            assert tokens == plain(lm, compiler, prompt, params), f"{name}: {rid} differs from plain"
        if constraint is None:
            assert not stats.constrained and len(tokens) == 12
            continue
        text = tiny_tokenizer.decode(tokens, skip_special_tokens=True)
        assert finish == "stop" and valid(text, constraint), f"{name}: {rid} gave {text!r}"
        assert stats.constrained
        forced += stats.forced_tokens
        assert 0 <= stats.forced_accepted <= stats.forced_tokens
    assert forced > 0  # JSON keys and grammar literals were drafted without the drafter


def letters():
    """A byte-level tokenizer of 5 tokens: <eos>, a, b, c, d."""
    raw = Tokenizer(models.BPE(vocab={"<eos>": 0, "a": 1, "b": 2, "c": 3, "d": 4}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")


# x1 in {a, b}, then c (forced), x3 in {a, b, d}, then d or the end (EOS)
TINY_GRAMMAR = 'start: ("a" | "b") "c" ("a" | "b" | "d") "d"?'


def exact_constrained_distribution(model, prompt, params) -> dict[tuple[int, ...], float]:
    """P(output) for every output the grammar allows, from the masked, warped target p."""
    lm = backend(model)
    allowed = [[1, 2], [3], [1, 2, 4], [0, 4]]
    out = {}
    for x1 in allowed[0]:
        for x3 in allowed[2]:
            for x4 in allowed[3]:
                seq = (x1, 3, x3, x4)
                lm.reset()
                logits = lm.forward(torch.cat([prompt, torch.tensor(seq[:-1])]), 0, num_logits=4).logits
                mask = torch.zeros(4, 5, dtype=torch.bool)
                for i, a in enumerate(allowed):
                    mask[i, a] = True
                p = warp_probs(logits.masked_fill(~mask, float("-inf")), params)  # [4, 5]
                out[seq] = float(torch.prod(p[torch.arange(4), torch.tensor(seq)]))
    return out


class FixedQDrafter:
    """Drafts i.i.d. tokens from one fixed q whatever the context: an adversarial draft with
    half its mass on "c", which the grammar forbids at three positions of four."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q  # [V]

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        tokens = torch.multinomial(self.q, ctx.max_tokens, replacement=True, generator=ctx.generator)
        return Draft(tokens, self.q.expand(ctx.max_tokens, -1).clone())  # [k], [k, V]

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass


@pytest.mark.parametrize("kind", ["fixed-q", "draft-model-tree", "ngram"])
def test_constrained_sampling_matches_the_masked_target_distribution(kind):
    vocab, n = 5, 1500
    tokenizer = letters()
    target = tiny_model(vocab, seed=20)
    lm = backend(target)
    compiler = GrammarCompiler(tokenizer, vocab, lm.eos_token_ids)
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=6, grammar=TINY_GRAMMAR)
    prompt = torch.tensor([1, 3, 2, 1, 3, 4, 1, 3])  # "acbacdac": prompt lookup finds matches
    expected = exact_constrained_distribution(target, prompt, params)
    if kind == "fixed-q":
        drafter = FixedQDrafter(torch.tensor([0.1, 0.2, 0.1, 0.5, 0.1], dtype=torch.float64))
    elif kind == "draft-model-tree":  # a sharp, biased draft model's token tree
        draft = noisy_copy(target, 0.3, seed=21)
        with torch.no_grad():
            draft.lm_head.weight.mul_(3.0)
        drafter = DraftModelDrafter(backend(draft), vocab, tree=TreeShape(top_k=2, budget=5))
    else:
        drafter = NgramDrafter(1, 2)
    config = DraftLengthConfig(draft_max=3, adaptive=False)
    gen = torch.Generator().manual_seed(1234)
    keys = sorted(expected)
    counts = torch.zeros(len(keys), dtype=torch.float64)
    accepted = rejected = 0
    for _ in range(n):
        stats = RequestStats()
        tokens = [t for step in generate_tokens(lm, prompt, params, drafter=drafter, draft_length=config,
                                                stats=stats, generator=gen, grammars=compiler)
                  for t in step.tokens]
        counts[keys.index(tuple(tokens))] += 1  # x1 c x3, then EOS or "d" (which completes it)
        accepted += stats.accepted_tokens
        rejected += stats.grammar_rejected_tokens
    assert accepted > n // 10  # speculation really happened
    if kind == "fixed-q":
        assert rejected > n // 2  # the grammar cut drafts before verification
    assert_matches_distribution(counts, torch.tensor([expected[k] for k in keys], dtype=torch.float64))


@pytest.mark.parametrize("name", ["draft-model", "draft-model-tree", "eagle-tree"])
def test_matcher_follows_the_verifier_after_rejections_and_trees(setup, tiny_tokenizer, name):
    """After every round the row's matcher is where a fresh one is after the committed output."""
    target, lm, compiler = setup
    vocab = len(tiny_tokenizer)
    drafter = row_drafters(target, vocab)[name](lm)
    if name == "draft-model":  # an unrelated draft: many rejections
        drafter = DraftModelDrafter(backend(tiny_model(vocab, seed=99)), vocab)
    engine = Engine(make_rows(lm, 1), draft_length=DraftLengthConfig(4, 0, adaptive=False), grammars=compiler)
    params = SamplingParams(max_tokens=60, json_schema=SCHEMA)
    prompt = torch.tensor(tiny_tokenizer("the quick brown fox")["input_ids"])
    seq = engine.add("r", prompt, params, drafter=drafter)
    committed: list[int] = []
    while engine.has_work:
        outputs, _ = engine.step()
        for o in outputs:
            committed += o.step.tokens
        if seq.finish_reason is None and seq.decoding:
            fresh = compiler.matcher(params.structured)
            assert fresh.advance(committed) == len(committed)
            assert torch.equal(seq.grammar.allowed(), fresh.allowed())
            assert seq.grammar.round is None  # the speculative walk was rolled back
    assert seq.stats.drafted_tokens > seq.stats.accepted_tokens  # there were rejections
    assert valid(tiny_tokenizer.decode(committed, skip_special_tokens=True), {"json_schema": SCHEMA})


def test_matcher_rollback_restores_masks(setup, tiny_tokenizer):
    _, _, compiler = setup
    spec = grammar_spec(json_schema=SCHEMA)
    text = '{"name": "fox", "age": 12, "tags": ["dog"], "ok": true}'
    ids = tiny_tokenizer(text)["input_ids"]
    m = compiler.matcher(spec)
    assert m.advance(ids) == len(ids) and m.stopped
    masks = m.masks_along([])
    assert masks.shape == (1, len(tiny_tokenizer)) and masks[0].nonzero().flatten().tolist() == [0]  # EOS
    assert m.advance([0, 0]) == 2 and m.stopped  # EOS after the end: taken, and undone by rollback
    m.rollback(2)
    assert m.stopped and m.masks_along([0])[0].nonzero().flatten().tolist() == [0]
    for back in (1, 5, len(ids)):
        m.rollback(back)
        fresh = compiler.matcher(spec)
        fresh.advance(ids[: len(ids) - back])
        assert torch.equal(m.allowed(), fresh.allowed())
        m.advance(ids[len(ids) - back:])
    walked = compiler.matcher(spec).masks_along(ids)  # [n + 1, V]: each token allowed where it is
    assert walked.shape == (len(ids) + 1, len(tiny_tokenizer))
    assert bool(walked[torch.arange(len(ids)), torch.tensor(ids)].all())


def test_verifier_mask_is_applied_to_p_and_q():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0], [0.0, 4.0, 3.0, 0.0], [1.0, 1.0, 1.0, 9.0]])
    allowed = torch.tensor([[False, True, True, False], [False, False, True, True], [True] * 4])
    gen = torch.Generator().manual_seed(0)
    verdict = verify(logits, Draft(torch.tensor([1, 2])), SamplingParams(), gen, allowed)
    assert verdict.num_accepted.item() == 2 and verdict.tokens.tolist() == [1, 2, 3]
    verdict = verify(logits, Draft(torch.tensor([0, 2])), SamplingParams(), gen)  # unmasked: argmax 0
    assert verdict.tokens[0].item() == 0
    # sampled q: the masked q is renormalised over the allowed tokens; p outside the mask is 0
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.1, 0.1, 0.4, 0.4]])
    hits = torch.zeros(4)
    params = SamplingParams(temperature=1.0)
    for _ in range(400):
        verdict = verify(logits, Draft(torch.tensor([1, 3]), q), params, gen, allowed)
        hits[verdict.tokens[0]] += 1
    assert hits[0] == 0 and hits[3] == 0


@pytest.mark.parametrize("fields, fragment", [
    ({"json_schema": {"type": "object"}, "regex": "a"}, "at most one"),
    ({"json_object": True, "grammar": "start: a"}, "at most one"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "must be an object"),
    ({"regex": ""}, "empty"),
    ({"grammar": 3}, "must be a string"),
])
def test_bad_fields_are_one_line_errors(fields, fragment):
    with pytest.raises(SpeclmError, match=fragment) as info:
        SamplingParams(**fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields, fragment", [
    ({"json_schema": {"type": "wat"}}, "JSON schema is invalid: Invalid type"),
    ({"json_schema": {"properties": {"a": {"$ref": "#/nope"}}}}, "does not exist"),
    ({"regex": "(unclosed"}, "regex is invalid"),
    ({"grammar": "start: foo"}, "unknown name"),
    ({"grammar": "root ::= [a-z"}, "grammar is invalid"),
])
def test_bad_schemas_and_grammars_are_one_line_errors(setup, fields, fragment):
    _, lm, compiler = setup
    params = SamplingParams(**fields)  # the shape is fine; compiling fails
    with pytest.raises(SpeclmError, match=re.escape(fragment)) as info:
        compiler.check(params.structured)
    assert "\n" not in str(info.value)
    engine = Engine(make_rows(lm, 1), grammars=compiler)
    with pytest.raises(SpeclmError):
        engine.add("r", torch.tensor([1, 2]), params)
    with pytest.raises(SpeclmError, match="tokenizer"):
        Engine(make_rows(lm, 1)).add("r", torch.tensor([1, 2]), SamplingParams(regex="a+"))


def test_a_drafter_hears_only_of_its_own_accepted_tokens():
    """A chain cut by the grammar and extended by forced tokens: acceptance past the cut is the
    grammar's tokens', not the drafter's, so a draft model keeps only its tokens before it."""
    from types import SimpleNamespace

    from speclm.structured.drafts import GrammarRound, drafter_accepted

    cut = SimpleNamespace(round=GrammarRound(forced_start=2, forced=3, rejected=1))
    assert drafter_accepted(cut, 4) == 2
    assert drafter_accepted(cut, 1) == 1
    whole = SimpleNamespace(round=GrammarRound(forced_start=0, forced=0, rejected=0))
    assert drafter_accepted(whole, 4) == 4
    assert drafter_accepted(None, 3) == 3
