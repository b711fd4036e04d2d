"""EAGLE-style drafting: a one-layer head over the target's features drafts a chain or a tree.

The head keeps its own KV cache over committed positions t, each fed the pair (target features
at t, embedding of token t + 1); its output at t predicts token t + 2. Features arrive from the
engine for every position the target commits, so at the start of a round the head runs the new
pairs in one pass and its last output gives the distribution of the first draft token. Further
tokens are drafted at the feature level: a drafted position's input is the head's own output at
its parent instead of the target's features; a head trained to draft in parallel instead runs
mask pairs for the positions after the first in the same forward as the new pairs, so a round
costs one head forward. Trees grow with EAGLE-2's dynamic search
(:mod:`.tree_search`); tree and draft entries are cropped from the head's cache after the round.
"""

from __future__ import annotations

import torch

from ..models.dtypes import at_least_float32
from ..tree import TreeMeta
from .base import Draft, DraftContext
from .draft_model import draft_chain
from .tree_search import TreeShape, TreeSizer, grow_tree


class EagleDrafter:
    def __init__(self, head, embedding: torch.nn.Module, feature_layers: list[int],
                 vocab_size: int, tree: TreeShape | None = None) -> None:
        from transformers import DynamicCache

        self.head = head.eval()
        self.embedding = embedding  # the target's input embedding, shared
        self.feature_layers = tuple(feature_layers)
        self.vocab_size = vocab_size
        self.tree = tree
        self.sizer = TreeSizer()  # how many tree nodes pay, calibrated over the requests it drafts
        self._new_cache = lambda: DynamicCache(config=head.config)
        self._param = next(head.parameters())
        self._columns = head.draft_to_target.cpu().numpy()  # [N] target id of each draft column, on the host
        self.reset(torch.empty(0, dtype=torch.long))

    @property
    def parallel_tokens(self) -> int:
        """Tokens one head forward proposes (0: one per forward): see speclm.drafters.base."""
        return self.head.parallel if self.tree is None else 0

    @property
    def max_draft_tokens(self) -> int:
        """A tree's node budget (0 for a chain: K bounds it): see speclm.drafters.base."""
        return self.tree.budget if self.tree is not None else 0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.cache = self._new_cache()
        self.processed = 0  # pairs (features at t, token t + 1) in the head's cache
        self.features: list[torch.Tensor] = []  # [T, L * H] chunks not yet run through the head
        self.root_hidden: torch.Tensor | None = None  # [H] the head's output at the last pair
        self._fed_hidden = torch.empty(0)  # [F, H] outputs of the tree nodes expanded this round

    def on_target_features(self, features: torch.Tensor) -> None:
        self.features.append(features)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        self.sizer.observe(num_accepted)
        extra = self.cache.get_seq_length() - self.processed
        if extra > 0:  # drop what was drafted; committed pairs stay
            self.cache.crop(-extra)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids.to(self.embedding.weight.device)).to(self._param.dtype)

    def _draft_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, N] log-probabilities over the draft vocabulary (its columns)."""
        return torch.log_softmax(at_least_float32(self.head.logits(hidden)), -1)

    def _full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, V] over the target's vocabulary (-inf outside the draft vocabulary)."""
        draft = at_least_float32(self.head.logits(hidden))  # [T, N]
        full = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head.draft_to_target, draft)

    def _run(self, feature, embedded, start: int, tree: TreeMeta | None, past: int) -> torch.Tensor:
        """Run T pairs [T, H] at positions from ``start`` (chain) or as the last rows of ``tree``."""
        t = embedded.shape[0]
        if tree is None:  # a causal block after ``past`` cached pairs
            tree, past = TreeMeta.chain(t - 1), start
        positions = tree.positions(past, t).to(self._param.device).view(1, t)
        mask = tree.attention_bias(past, self._param.dtype, self._param.device, t)
        out = self.head(feature.view(1, t, -1), embedded.view(1, t, -1), positions, mask, self.cache)
        return out[0]  # [T, H]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]; features have arrived for positions < n - 1
        # a head that drafts in parallel runs its mask pairs in the same forward as the new pairs
        masks = max(0, min(ctx.max_tokens, self.head.parallel) - 1) if self.tree is None else 0
        mask_out = None
        if self.features or (masks and self.root_hidden is not None):
            start = self.processed
            feats = (torch.cat(self.features).to(self._param.device, self._param.dtype) if self.features
                     else self._param.new_empty(0, self.head.fuse.in_features))  # [m, L * H]
            self.features = []
            m = feats.shape[0]
            feature, embedded = self.head.fuse(feats), self._embed(ids[start + 1 : start + 1 + m])  # [m, H]
            if masks:
                mask_feature, mask_embedded = self.head.mask_pairs((masks,))  # [masks, H] each
                feature, embedded = torch.cat([feature, mask_feature]), torch.cat([embedded, mask_embedded])
            out = self._run(feature, embedded, start, None, start)  # [m + masks, H]
            self.processed += m
            if m:
                self.root_hidden = out[m - 1]
            mask_out = out[m:]
        if self.root_hidden is None or ctx.max_tokens <= 0:
            return Draft.empty(ids.device)
        if masks:  # each mask pair's output predicts the token after the one before it
            logits = self._full_logits(torch.cat([self.root_hidden.view(1, -1), mask_out]))  # [1 + masks, V]
            draft = draft_chain(logits[:1], masks + 1, ctx, lambda token, i: logits[i + 1 : i + 2])
            return Draft(draft.tokens.to(ids.device), draft.q_draft)
        if self.tree is not None:  # grown over the draft vocabulary's columns
            self._fed_hidden = self.root_hidden.new_empty(0, self.root_hidden.shape[0])
            return grow_tree(self._draft_logprobs(self.root_hidden.view(1, -1))[0], self, ctx.max_tokens,
                             self.tree, ctx.verify_s, self.sizer, vocab=self._columns)
        return self._chain(self._full_logits(self.root_hidden.view(1, -1)), ctx)  # [1, V]

    def _chain(self, logits: torch.Tensor, ctx: DraftContext) -> Draft:
        hidden = self.root_hidden

        def step(token: torch.Tensor, i: int) -> torch.Tensor:  # the drafted pair: (own output, token)
            nonlocal hidden
            hidden = self._run(hidden.view(1, -1), self._embed(token), self.processed + i, None,
                               self.processed + i)[0]
            return self._full_logits(hidden.view(1, -1))  # [1, V]

        draft = draft_chain(logits, ctx.max_tokens, ctx, step)
        return Draft(draft.tokens.to(ctx.token_ids.device), draft.q_draft)

    def expand(self, tokens: torch.Tensor, fed: TreeMeta) -> torch.Tensor:
        """Tree search step: the newest T nodes of ``fed``, each paired with its parent's output."""
        t = tokens.shape[0]
        parents = fed.parents[-t:]  # [T] expanded-node index of each parent, -1 = the root
        known = torch.cat([self.root_hidden.view(1, -1), self._fed_hidden])  # [1 + F_old, H]
        feature = known[(parents + 1).to(known.device)]  # [T, H]
        out = self._run(feature, self._embed(tokens), 0, fed, self.processed - 1)  # root = the last pair
        self._fed_hidden = torch.cat([self._fed_hidden, out])
        return self._draft_logprobs(out)  # [T, N]
