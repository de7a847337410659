"""A feature-level draft head (EAGLE): draft from the target's own last hidden states.

A separate draft model (``draft_model.py``) has to rebuild, from tokens alone, what the target
already knows about the text, and its LM head over the whole vocabulary costs a quarter of a
SmolLM2 pass by itself. EAGLE (Li et al., 2024, arXiv:2401.15077) drafts from the target's
**features** instead — the last decoder layer's output, before the final norm, which the
target's verify pass computes anyway (the runner hands them over: ``StepInputs.want_hidden``).

One draft step at position ``t`` takes the target's feature ``f_t`` and the embedding of the
next token ``x_{t+1}`` (the target's own embedding table), mixes them (``fc``: 2·hidden →
hidden), runs **one decoder layer** — attending, through its own small KV cache, over the draft
positions before it — and predicts the feature ``f̂_{t+1}``. The target's final norm and LM head
rows turn ``f̂_{t+1}`` into a guess for ``x_{t+2}``; to run ahead, ``f̂_{t+1}`` stands in for the
feature the target has not computed yet.

**A reduced vocabulary.** The head scores only ``draft_vocab_size`` tokens — those the target
produced most often in the training text (``vocab_ids``), rows of the target's own tied head,
so nothing is trained or stored for it. A proposal outside that set is impossible, which only
lowers acceptance; the verifier always scores the full vocabulary, so the output is the target's.

What is stored (``config.json`` + ``model.safetensors``): ``fc`` and the decoder layer, and the
vocabulary subset — a few MB. Trained by ``data/recipes/train_eagle_smollm2.py``.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from minillm.layers import cpu_bf16_rows
from minillm.layers.cpu_prepack import prepack_available
from minillm.models.rope import apply_rope
from minillm.sampling import filtered_logits
from minillm.sequence import Sequence


@dataclass
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    draft_vocab_size: int
    target: str  # the model whose features it reads (a registry name or folder name)

    @classmethod
    def from_folder(cls, folder: str | Path) -> EagleConfig:
        raw = json.loads((Path(folder) / "config.json").read_text())
        if raw.get("architecture") != "eagle":
            raise ValueError(f"{folder} is not an EAGLE draft head (config.json architecture={raw.get('architecture')!r})")
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})

    def save(self, folder: str | Path) -> None:
        (Path(folder) / "config.json").write_text(json.dumps({"architecture": "eagle", **asdict(self)}, indent=1) + "\n")


class EagleHead(nn.Module):
    """``fc`` + one decoder layer; the target's embedding, final norm and head rows are borrowed."""

    def __init__(self, cfg: EagleConfig, target, vocab_ids: torch.Tensor):
        super().__init__()
        h, dtype = cfg.hidden_size, target.dtype
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.input_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False, dtype=dtype)
        self.post_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False, dtype=dtype)
        # Borrowed from the target, not parameters of the head (not trained, not stored).
        self.target = [target]  # a list: not registered as a submodule
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=False)
        self.head_weight = head_rows(target, self.vocab_ids)  # [draft_vocab, hidden]
        self.packed: dict[str, torch.Tensor] = {}  # oneDNN-prepacked weights (prepack_for_cpu)
        self.rows_packed: dict[str, torch.Tensor] = {}  # the same, packed for our few-row bf16 kernel

    def prepack_for_cpu(self) -> bool:
        """Inference on CPU: hold every matrix in oneDNN's prepacked layout, as the target's own
        linear layers are (``layers/cpu_prepack.py``) — q/k/v and gate/up fused into one matrix
        each. A proposal runs the head on one or two rows at a time, where PyTorch's plain bf16
        matmul streams weights far below the machine's bandwidth: a run-ahead step took 0.97 ms
        packed against 1.39 ms plain (``benchmarks/eval_eagle_head.py``, Intel Xeon, 2 threads).

        Where the compiled step multiplies its few rows through our bf16 kernel
        (``layers/cpu_bf16_rows.py``: a CPU with AVX-512 BF16 and no AMX), the matrices are also
        packed for it (13 MB more for SmolLM2's head), and calls of up to ``FEW_ROWS`` rows use it
        once it is built: the head's six products took 0.14-0.32 ms a pass at 1-8 rows against
        oneDNN's 0.35-0.62 ms (AMD EPYC Zen 4, 2 threads; ``benchmarks/bench_bf16_rows.py``).
        Returns whether it packed."""
        dtype = self.fc.weight.dtype
        if self.fc.weight.device.type != "cpu" or dtype == torch.float32 or not prepack_available(dtype):
            return False
        mats = {
            "fc": self.fc.weight,
            "qkv": torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
            "o": self.o_proj.weight,
            "gate_up": torch.cat([self.gate_proj.weight, self.up_proj.weight]),
            "down": self.down_proj.weight,
            "head": self.head_weight,
        }
        self.packed = {k: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1) for k, w in mats.items()}
        if dtype == torch.bfloat16 and cpu_bf16_rows.cpu_supports():
            self.rows_packed = {k: cpu_bf16_rows.pack(w.detach().contiguous()) for k, w in mats.items() if cpu_bf16_rows.packs(w)}
        return True

    def _mm(self, name: str, x: torch.Tensor, plain: torch.Tensor) -> torch.Tensor:
        rows = self.rows_packed.get(name)
        if rows is not None and x.dim() == 2 and x.shape[0] <= cpu_bf16_rows.FEW_ROWS and cpu_bf16_rows.ready():
            return cpu_bf16_rows.linear_bf16_rows(x, rows)  # by name: not through a dispatcher entry that may be changing
        packed = self.packed.get(name)
        if packed is None:
            return x @ plain.T
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target[0].embed_tokens(tokens).to(self.fc.weight.dtype)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Scores over the draft vocabulary (``vocab_ids``) for predicted features."""
        return self._mm("head", self.target[0].norm(feats), self.head_weight)

    def forward(self, feats, tokens, positions, past_k=None, past_v=None, mask=None):
        """``feats[T, hidden]`` (target features at positions ``positions[T]``), ``tokens[T]``
        (the token after each) → predicted next features ``[T, hidden]`` and this call's keys and
        values ``[T, kv_heads, head_dim]``. ``past_k, past_v[P, kv_heads, head_dim]``: the draft
        positions before these (causal over them and within the call).

        Training passes a batch of windows instead: ``feats[B, T, hidden]``, ``tokens[B, T]``,
        shared ``positions[T]`` and no past — each window causal over itself, in one call.

        ``mask[T, P + T]`` (bool): which past and new keys each row sees, in place of the causal
        rule — a draft tree's nodes, expanded side by side, each over its own ancestors."""
        cfg = self.cfg
        B, T = (1, feats.shape[0]) if feats.dim() == 2 else feats.shape[:2]
        if B > 1 and past_k is not None:
            raise ValueError("a batch of windows has no past draft keys")
        if self.packed and not torch.is_grad_enabled() and feats.dim() == 2:
            return self._packed_forward(feats, tokens, positions, past_k, past_v, mask)
        x = self.fc(torch.cat([feats.to(self.fc.weight.dtype), self.embed(tokens)], dim=-1))
        a = self.input_norm(x)
        q = self.q_proj(a).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(a).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(a).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        o, k, v = self._attend(q, k, v, positions, past_k, past_v, mask)
        o = o.view(*x.shape[:-1], -1)
        x = x + self.o_proj(o)
        m = self.post_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return x, k, v

    def _packed_forward(self, feats, tokens, positions, past_k, past_v, mask=None):
        """``forward`` through the prepacked matrices (same arithmetic, other kernels)."""
        cfg = self.cfg
        T = feats.shape[0]
        x = self._mm("fc", torch.cat([feats.to(self.fc.weight.dtype), self.embed(tokens)], dim=-1), self.fc.weight)
        qkv = self._mm("qkv", self.input_norm(x), None)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[:, :nq].reshape(1, T, cfg.num_heads, cfg.head_dim)
        k = qkv[:, nq : nq + nkv].reshape(1, T, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, nq + nkv :].reshape(1, T, cfg.num_kv_heads, cfg.head_dim)
        o, k, v = self._attend(q, k, v, positions, past_k, past_v, mask)
        x = x + self._mm("o", o, None)
        gate, up = self._mm("gate_up", self.post_norm(x), None).split(cfg.intermediate_size, dim=-1)
        x = x + self._mm("down", F.silu(gate) * up, None)
        return x, k, v

    def _attend(self, q, k, v, positions, past_k, past_v, mask=None):
        """RoPE, then causal attention over the past draft keys and this call's: ``[T, H*D]``
        and this call's keys and values ``[T, kv_heads, head_dim]`` (``[B*T, ...]`` and
        ``[B, T, ...]`` for a batch of windows)."""
        cfg = self.cfg
        B, T = q.shape[:2]
        cos, sin = self.target[0].rope.lookup(positions[None], q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = cfg.num_heads // cfg.num_kv_heads
        if B > 1:  # training windows: each causal over itself
            kh, vh = (t.transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, is_causal=True)
            return o.transpose(1, 2).reshape(B * T, -1), k, v
        k, v = k[0], v[0]
        keys = k if past_k is None else torch.cat([past_k, k])
        values = v if past_v is None else torch.cat([past_v, v])
        P = keys.shape[0] - T
        kh = keys.transpose(0, 1).repeat_interleave(groups, 0)[None]  # [1, H, P+T, D]
        vh = values.transpose(0, 1).repeat_interleave(groups, 0)[None]
        if mask is None and T > 1:  # causal within the call; every past key visible
            mask = torch.ones(T, P + T, dtype=torch.bool, device=q.device).tril(P)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask)
        return o.transpose(1, 2).reshape(T, -1), k, v


def head_rows(target, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The target's LM-head rows of ``vocab_ids``, as a plain tensor (a tied head reads the
    embedding table; a head whose weight was packed for the CPU keeps it only there)."""
    weight = getattr(target.lm_head, "weight", None)
    if (weight is None or weight.is_mkldnn) and target.config.tie_word_embeddings:
        weight = target.embed_tokens.weight
    if weight is None or weight.is_mkldnn or not weight.is_floating_point():
        raise ValueError("an EAGLE head needs the target's LM head as a plain floating-point matrix "
                         "(not a quantized or packed one)")  # fmt: skip
    return weight.detach()[vocab_ids.to(weight.device)]


def save_eagle_head(head: EagleHead, folder: str | Path) -> None:
    """``config.json`` and ``model.safetensors`` (the head's own weights in bf16, and its
    vocabulary subset): what ``load_eagle_head`` reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head.cfg.save(folder)
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    weights["vocab_ids"] = head.vocab_ids.cpu().contiguous()
    save_file(weights, str(folder / "model.safetensors"))


def load_eagle_head(folder: str | Path, target) -> EagleHead:
    """The head stored in ``folder`` (``config.json``, ``model.safetensors``) over ``target``."""
    folder = Path(folder)
    cfg = EagleConfig.from_folder(folder)
    tcfg = target.config
    if (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) != (
        tcfg.hidden_size,
        tcfg.num_heads,
        tcfg.num_kv_heads,
    ):
        raise ValueError(
            f"speculative_config model={str(folder)!r}: an EAGLE head for hidden {cfg.hidden_size} / "
            f"{cfg.num_heads} heads, not this target's {tcfg.hidden_size} / {tcfg.num_heads}"
        )
    weights = load_file(str(folder / "model.safetensors"))
    vocab_ids = weights.pop("vocab_ids")
    if int(vocab_ids.max()) >= tcfg.vocab_size:
        raise ValueError(f"speculative_config model={str(folder)!r}: its vocabulary ids exceed the target's")
    head = EagleHead(cfg, target, vocab_ids.to(target.device))
    head.load_state_dict({k: v.to(target.dtype) for k, v in weights.items()})
    head = head.to(target.device).eval()
    head.prepack_for_cpu()
    return head


class _State:
    """One request's draft state: the target's features by position, and the draft layer's cache."""

    def __init__(self, seq: Sequence, head: EagleHead):
        cfg, dev = head.cfg, head.fc.weight.device
        self.seq = seq
        self.feats = torch.empty(64, cfg.hidden_size, dtype=head.fc.weight.dtype, device=dev)
        self.lo = self.hi = 0  # target features held for positions lo .. hi-1
        self.k = torch.empty(64, cfg.num_kv_heads, cfg.head_dim, dtype=head.fc.weight.dtype, device=dev)
        self.v = torch.empty_like(self.k)
        self.kv_lo = self.filled = 0  # draft keys from true inputs at positions kv_lo .. filled-1
        self.tree_hidden: torch.Tensor | None = None  # a verified tree's node features, until its branch is known
        self.caught_up: tuple[int, torch.Tensor] | None = None  # (sequence length, feature) a batched catch-up left

    def store(self, start: int, hidden: torch.Tensor) -> None:
        if start > self.hi or start < self.lo:  # a gap (prefix-cache hit) or a recomputed prefix: start over
            self.lo = self.hi = self.kv_lo = self.filled = start
        end = start + hidden.shape[0]
        self.feats = _fit(self.feats, end - self.lo)
        self.feats[start - self.lo : end - self.lo] = hidden
        self.hi = end
        self.filled = min(self.filled, start)  # draft keys built on overwritten features go

    def put_kv(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = at + k.shape[0] - self.kv_lo
        self.k, self.v = _fit(self.k, end), _fit(self.v, end)
        self.k[at - self.kv_lo : end], self.v[at - self.kv_lo : end] = k, v


def _fit(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows <= t.shape[0]:
        return t
    grown = torch.empty(max(rows, 2 * t.shape[0]), *t.shape[1:], dtype=t.dtype, device=t.device)
    grown[: t.shape[0]] = t
    return grown


class EagleProposer:
    """Proposes with an ``EagleHead`` from the features the target's passes leave behind.

    Per request and step: **catch up** — run the draft layer over the positions whose target
    features arrived since its last step (their keys and values are true: built from the target's
    features and the sequence's tokens), the last of them proposing ``d1``; then **run ahead**
    ``k − 1`` steps, each feeding its own predicted feature and the previous proposal. Run-ahead
    keys are never kept: the next catch-up rebuilds those positions from the target's features.
    """

    wants_hidden = True

    def __init__(self, head: EagleHead):
        self.head = head
        self.states: dict[Hashable, _State] = {}

    def observe(self, request_ids: list[Hashable], starts: list[int], hidden: list[torch.Tensor], seqs,
                trees: list[bool] | None = None) -> None:  # fmt: skip
        """The target's step computed ``hidden[i]`` for positions ``starts[i]..`` of request ``i``
        — or, where ``trees[i]``, for a tree: the first row at ``starts[i]``, then one row per node,
        held back until verification says which branch holds (``accept_branch``)."""
        for i, (rid, start, h, seq) in enumerate(zip(request_ids, starts, hidden, seqs)):
            state = self.states.get(rid)
            if state is None or state.seq is not seq:
                state = self.states[rid] = _State(seq, self.head)
            h = h.to(state.feats.dtype)
            if trees is not None and trees[i]:
                state.store(start, h[:1])
                state.tree_hidden = h[1:]
            else:
                state.store(start, h)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> dict[Hashable, tuple[list[int], torch.Tensor | None]]:
        ready = [(seq, state, k) for seq, k in zip(seqs, ks) if (state := self._ready(seq)) is not None]
        self._catch_up_together([(seq, state) for seq, state, _ in ready if self._may_share_a_call(seq, state)])
        return {seq.request_id: self._propose_one(seq, state, k) for seq, state, k in ready}

    @torch.inference_mode()
    def propose_trees(self, seqs: list[Sequence], ks: list[int], topk: int, depth: int) -> dict[Hashable, tuple[list[int], list[int]]]:
        """Per sequence, a tree of ``ks[i]`` nodes grown by the head's confidence (EAGLE-2):
        ``(tokens, parents)``, parents before children, best nodes first (``_grow_tree``)."""
        ready = [(seq, state, k) for seq, k in zip(seqs, ks) if (state := self._ready(seq)) is not None]
        self._catch_up_together([(seq, state) for seq, state, _ in ready if self._may_share_a_call(seq, state)])
        return {seq.request_id: self._grow_tree(seq, state, k, topk, depth) for seq, state, k in ready}

    def _ready(self, seq: Sequence) -> _State | None:
        """``seq``'s state, if the target has computed the features a proposal starts from."""
        state = self.states.get(seq.request_id)
        if state is None or state.seq is not seq:
            return None
        n = len(seq)
        state.hi = min(state.hi, n - 1)  # features of rejected positions are not the sequence's
        if state.hi < n - 1 or n - 2 < state.lo:  # the target has not computed position n-2 yet
            return None
        return state

    def _catch_up(self, seq: Sequence, state: _State) -> torch.Tensor:
        """Run the draft layer over the positions whose target features arrived since its last
        step (their keys are true ones, kept); returns its predicted feature at position ``n-1``,
        whose scores propose the token after the sequence (or the one ``_catch_up_together``
        left, if the sequence has not moved since)."""
        n, ready = len(seq), state.caught_up
        state.caught_up = None
        if ready is not None and ready[0] == n and state.filled == n - 1:
            return ready[1]
        feats, toks, positions, past_k, past_v, first = self._catch_up_inputs(seq, state)
        pred, k_new, v_new = self.head(feats, toks, positions, past_k, past_v)
        state.put_kv(first, k_new, v_new)
        state.filled = n - 1
        return pred[-1:]

    def _catch_up_inputs(self, seq: Sequence, state: _State):
        """What ``seq``'s catch-up feeds the head: features, tokens and positions from the first
        position without a true draft key (at least ``n-2``, which proposes ``d1``) to ``n-2``,
        the draft keys and values before it, and that first position."""
        tokens, n, device = seq.token_ids, len(seq), state.feats.device
        first = min(max(state.filled, state.kv_lo), n - 2)
        past = slice(0, first - state.kv_lo)
        return (state.feats[first - state.lo : n - 1 - state.lo], torch.tensor(tokens[first + 1 : n], device=device),
                torch.arange(first, n - 1, device=device), state.k[past], state.v[past], first)  # fmt: skip

    SHARED_CATCH_UP_MAX = 64  # positions: a longer catch-up (a whole prompt, after its prefill) runs alone

    def _may_share_a_call(self, seq: Sequence, state: _State) -> bool:
        """Whether ``seq``'s catch-up may run in the call ``_catch_up_together`` makes: a short one
        (a shared call's attention grows with the square of all its rows: two prompts of 2k
        tokens together would cost twice what they cost apart), and not a seeded sampled
        request's, whose draws must not depend on which others propose this step (bf16 products
        over more rows may round differently)."""
        seeded = seq.params.seed is not None and not seq.params.greedy
        return not seeded and len(seq) - 1 - max(state.filled, state.kv_lo) <= self.SHARED_CATCH_UP_MAX

    def _catch_up_together(self, pairs: list[tuple[Sequence, _State]]) -> None:
        """Every sequence's catch-up in one call of the head: each row sees its own sequence's
        past draft keys and, causally, its own new ones (``mask``). One call of ``T`` rows
        costs less than a call per sequence, each reading the head's weights again: proposing 8
        trees took 24 ms against 33 ms one by one in steady speculation, 40 against 45 ms with
        every sequence 64 positions behind (the governor's try after plain steps;
        ``benchmarks/probe_eagle_catchup.py``, Intel Xeon, 2026-12-07). What each sequence's
        ``_catch_up`` would return is left in its state."""
        if len(pairs) < 2:
            return
        parts = [self._catch_up_inputs(seq, state) for seq, state in pairs]
        rows = [len(p[2]) for p in parts]
        pasts = [len(p[3]) for p in parts]
        P, T = sum(pasts), sum(rows)
        mask = torch.zeros(T, P + T, dtype=torch.bool, device=parts[0][0].device)
        r = q = 0
        for n_rows, n_past in zip(rows, pasts):
            mask[r : r + n_rows, q : q + n_past] = True
            mask[r : r + n_rows, P + r : P + r + n_rows] = torch.ones(n_rows, n_rows, dtype=torch.bool, device=mask.device).tril()
            r, q = r + n_rows, q + n_past
        feats, toks, positions, past_k, past_v = (torch.cat([p[i] for p in parts]) for i in range(5))
        pred, k_new, v_new = self.head(feats, toks, positions, past_k, past_v, mask=mask)
        r = 0
        for (seq, state), part, n_rows in zip(pairs, parts, rows):
            state.put_kv(part[5], k_new[r : r + n_rows], v_new[r : r + n_rows])
            state.filled = len(seq) - 1
            state.caught_up = (len(seq), pred[r + n_rows - 1 : r + n_rows])
            r += n_rows

    def _propose_one(self, seq: Sequence, state: _State, k: int):
        head, n = self.head, len(seq)
        device = state.feats.device
        feat = self._catch_up(seq, state)
        proposals, dists = [], []
        for step in range(k):
            token, dist = self._pick(seq, head.logits(feat)[0])
            proposals.append(token)
            if dist is not None:
                dists.append(dist)
            if step + 1 == k:
                break
            at = n - 1 + step  # the position whose token is the proposal just made
            keys = slice(0, at - state.kv_lo)
            pos = torch.tensor([at], device=device)
            feat, k_new, v_new = head(feat, torch.tensor([token], device=device), pos, state.k[keys], state.v[keys])
            state.put_kv(at, k_new, v_new)  # beyond `filled`: overwritten by the next catch-up
        return proposals, (torch.stack(dists) if dists else None)

    def _grow_tree(self, seq: Sequence, state: _State, k: int, topk: int, depth: int,
                   prune: bool = True) -> tuple[list[int], list[int]]:  # fmt: skip
        """EAGLE-2's dynamic draft tree (Li et al., 2024, arXiv:2406.16858): a node's score is
        the sum of the head's log-probabilities along its branch — its chance of being accepted,
        as far as the head knows. Level by level, the ``topk`` best nodes of the newest level are
        expanded, side by side in one call of the head (each seeing its own ancestors' keys:
        ``mask``), each into its ``topk`` best children; after ``depth`` levels the ``k`` best
        nodes of all are kept. A child never scores above its parent, so the ``k`` best are a
        tree, and sorted best first (ties: the older node first) parents come before children —
        a prefix of the list, as the governor and the scheduler may cut it, is the best smaller tree.

        The tree is built from the head's scores whatever the request samples with: a sampled
        request verifies it as deterministic guesses (``tree.accept_tree_sampled``), exactly.

        ``prune``: a level is not expanded where it cannot matter — a child never scores above
        its parent, and a newer node loses a tie, so a node that scores no better than the
        ``k``-th best node so far has no descendant among the ``k`` kept. The tree is the same;
        the head's calls are fewer where its guesses are unsure (where a tree cannot win much).
        (``prune=False``: every level expanded, for the test that the two agree.)"""
        head, n, ids = self.head, len(seq), self.head.vocab_ids
        device = state.feats.device
        feat = self._catch_up(seq, state)
        past = n - 1 - state.kv_lo  # true draft keys: positions kv_lo .. n-2
        past_k, past_v = state.k[:past], state.v[:past]
        tokens, parents, scores, depths = [], [], [], []
        source: list[torch.Tensor] = []  # per node: the feature whose scores proposed it
        key_of: dict[int, int] = {}  # expanded node -> its run-ahead key's index
        run_k, run_v = [], []

        def add_children(parent: int, feature: torch.Tensor, logp: torch.Tensor) -> list[int]:
            base = scores[parent] if parent >= 0 else 0.0
            top = logp.topk(min(topk, logp.shape[-1]))
            made = []
            for lp, index in zip(top.values.tolist(), top.indices.tolist()):
                made.append(len(tokens))
                tokens.append(int(ids[index]))
                parents.append(parent)
                scores.append(base + lp)
                depths.append(0 if parent < 0 else depths[parent] + 1)
                source.append(feature)
            return made

        level = add_children(-1, feat, torch.log_softmax(head.logits(feat)[0].float(), -1))
        for _ in range(depth - 1):
            expand = sorted(level, key=lambda i: (-scores[i], i))[:topk]
            if prune and len(scores) >= k:  # a node no better than the k-th best so far has no child among the k best
                kth = sorted(scores, reverse=True)[k - 1]
                expand = [i for i in expand if scores[i] > kth]
            if not expand:
                break
            T, R = len(expand), sum(len(t) for t in run_k)  # R: run-ahead keys so far
            mask = torch.zeros(T, past + R + T, dtype=torch.bool, device=device)
            mask[:, :past] = True
            for row, node in enumerate(expand):
                mask[row, past + R + row] = True
                at = parents[node]
                while at >= 0:  # its ancestors' run-ahead keys
                    mask[row, past + key_of[at]] = True
                    at = parents[at]
            keys = torch.cat([past_k, *run_k]) if run_k else past_k
            values = torch.cat([past_v, *run_v]) if run_v else past_v
            feats_in = torch.cat([source[i] for i in expand])
            toks = torch.tensor([tokens[i] for i in expand], device=device)
            pos = torch.tensor([n - 1 + depths[i] for i in expand], device=device)
            out, k_new, v_new = head(feats_in, toks, pos, keys, values, mask=mask)
            for row, node in enumerate(expand):
                key_of[node] = R + row
            run_k.append(k_new)
            run_v.append(v_new)
            logp = torch.log_softmax(head.logits(out).float(), -1)
            level = [c for row, node in enumerate(expand) for c in add_children(node, out[row : row + 1], logp[row])]
        best = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:k]
        index = {node: i for i, node in enumerate(best)}
        return [tokens[i] for i in best], [index[parents[i]] if parents[i] >= 0 else -1 for i in best]

    def _pick(self, seq: Sequence, scores: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        ids = self.head.vocab_ids
        if seq.params.greedy:
            return int(ids[scores.argmax()]), None
        full = torch.full((self.head.target[0].config.vocab_size,), float("-inf"), device=scores.device)
        full[ids] = scores.float()
        q = filtered_logits(full[None], [seq.params]).softmax(-1)[0]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q

    def accept_branch(self, seq: Sequence, start: int, path: list[int]) -> None:
        """A verified tree kept ``path`` (node indices): the target's features at positions
        ``start + 1 ..`` are those of the path's nodes, held back by ``observe``."""
        state = self.states.get(seq.request_id)
        tree = getattr(state, "tree_hidden", None)
        if state is None or tree is None:
            return
        state.tree_hidden = None
        if path and state.hi == start + 1:
            state.store(start + 1, tree[path])

    def rollback(self, seq: Sequence) -> None:
        """Nothing to undo: positions past the sequence are clipped at the next proposal."""

    def release(self, request_id: Hashable) -> None:
        self.states.pop(request_id, None)
