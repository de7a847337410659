"""The token embedding, whose rows come from its own table or through a tied LM head's seam.

A tied checkpoint uses one ``[vocab, hidden]`` matrix twice: as the embedding (a token's row)
and as the LM head (every row against the hidden state). While the head keeps the plain matrix
the two simply share the tensor (``LlamaForCausalLM.tie_weights``). Once a weight method gives
the head other storage (int8: ``qweight`` and ``scales``), a float table kept only for the
embedding would hold the same numbers twice — 28% of SmolLM2-135M's parameters. So a tied
embedding can ``read_rows_from(head)``: it drops its table and asks the head for each token's
row (``Linear.embedding_rows``, which its method answers). No module is swapped; the storage
varies in one place, the head's method, and the embedding reads through the same seam.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """Token ids → rows of the embedding table, held here or read from a tied head.

    ``rows``: the vocabulary rows this module holds (all of them, unless a subclass splits the
    vocabulary across ranks); ``rows_of(local_ids)`` looks up ids counted from ``rows.start``.
    """

    def __init__(self, vocab_size: int, hidden: int, rows: range | None = None, requires_grad: bool = True):
        super().__init__()
        self.vocab_size, self.embedding_dim = vocab_size, hidden
        self.vocab_range = range(vocab_size) if rows is None else rows
        self.weight = nn.Parameter(torch.empty(len(self.vocab_range), hidden), requires_grad=requires_grad)
        self._head: list = []  # the tied head read from: a reference, not a submodule (its tensors counted once)

    @property
    def reads_from_head(self) -> bool:
        return bool(self._head)

    def read_rows_from(self, head) -> None:
        """Drop this table and read every row through ``head`` (a ``Linear`` holding the same
        vocabulary rows, tied to this embedding). Raises ``ValueError`` when the head holds other
        rows or its method cannot give rows."""
        held = head.tp_slices[None] if head.tp_dim == 0 else range(head.out_features)
        if (held.start, held.stop) != (self.vocab_range.start, self.vocab_range.stop):
            raise ValueError(f"the head holds vocabulary rows {held}, this embedding {self.vocab_range}: not tied")
        if head.in_features != self.embedding_dim:
            raise ValueError(f"the head takes {head.in_features} features, this embedding has {self.embedding_dim}")
        if not head.gives_rows:
            raise ValueError(f"the head's {head.method.name!r} storage cannot give embedding rows")
        self._head = [head]
        self.weight = None

    def rows_of(self, local_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``local_ids`` (each in ``[0, len(vocab_range))``)."""
        if self._head:
            return self._head[0].embedding_rows(local_ids)
        return F.embedding(local_ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows_of(ids)

    def extra_repr(self) -> str:
        source = "rows of the tied LM head" if self._head else "its own table"
        return f"{len(self.vocab_range)}, {self.embedding_dim}, {source}"
