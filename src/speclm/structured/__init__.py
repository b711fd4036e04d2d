"""Structured outputs: decoding constrained by a JSON schema, any JSON object, a regex or a grammar.

- :mod:`.spec`: what the user asked for (:class:`GrammarSpec`), checked into one-line errors;
- :mod:`.compiler`: a spec compiled for a tokenizer by llguidance, cached;
- :mod:`.matcher`: one request's grammar state (token masks, advance, rollback, forced tokens);
- :mod:`.drafts`: the grammar's part of a speculative round (pruning drafts, drafting forced
  tokens, the verifier's per-position masks, committing).

Only :mod:`.spec` is imported here: :mod:`speclm.sampling` needs it, and the others import the
drafter interface, which imports :mod:`speclm.sampling`.
"""

from .spec import GrammarSpec, grammar_spec

__all__ = ["GrammarSpec", "grammar_spec"]
