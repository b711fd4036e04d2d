"""Where a batch's rows live in the target's cache slots.

The engine keeps decoding rows in slots ``0 .. D-1`` (one forward over a contiguous range of
slots decodes them all) and prefilling rows after them; a prefill step feeds groups of adjacent
slots, each group one padded forward (models/rows.py ``padded_groups``).
"""

from __future__ import annotations

from .models.rows import TargetRows
from .sequence import Sequence


def arrange(running: list[Sequence], rows: TargetRows) -> list[Sequence]:
    """Decoding rows in slots 0 .. D-1, then prefilling rows in their order, moving as few
    rows as possible (a decoding row already below D stays; others fill the holes)."""
    slots = {s.slot: s for s in running}
    decoding = [s for s in running if s.decoding]
    num_dec = len(decoding)
    staying = {s.slot for s in decoding if s.slot < num_dec}
    holes = iter(sorted(set(range(num_dec)) - staying))
    target = {id(s): (s.slot if s.slot in staying else next(holes)) for s in decoding}
    prefilling = sorted((s for s in running if not s.decoding), key=lambda s: s.slot)
    target.update({id(s): num_dec + i for i, s in enumerate(prefilling)})
    order = sorted(running, key=lambda s: target[id(s)])
    for want, seq in enumerate(order):
        if seq.slot == want:
            continue
        other = slots.get(want)
        if other is not None and other is not seq:
            rows.swap(seq.slot, want)
            other.slot, slots[seq.slot] = seq.slot, other
        else:
            rows.move(seq.slot, want)
            del slots[seq.slot]
        seq.slot, slots[want] = want, seq
    return order
