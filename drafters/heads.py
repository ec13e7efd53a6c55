"""Sequential heads and the confidence head of DSpark (paper section 3.1, Eqs. 4-7).

The parallel backbone gives block logits U_k that do not depend on the tokens drafted inside the
block; a sequential head adds a prefix-dependent bias B_k so that the block distribution factorises
left to right: p_k(v) = softmax(U_k + B_k(x_0, x_<k))(v) (Eq. 4).

Shapes: N blocks, K prediction slots (gamma), H hidden size, V vocabulary, r head rank.
With a draft vocabulary of N_d tokens (``drafters/draft_vocab.py``) the heads work in draft ids:
W1 has N_d + 1 rows (the last one for a previous token outside the subset, e.g. an anchor) and
W2 maps to the N_d subset logits.
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """First-order low-rank transition bias B(x_{k-1}, .) = W1[x_{k-1}] W2 (Eq. 5).

    W2 starts at zero so an untrained head leaves the backbone's distribution unchanged.

    Args:
        num_inputs: rows of W1 (ids the previous token can take); num_outputs: columns of the bias
            (the drafter's vocabulary); rank: r.
    """

    def __init__(self, num_inputs: int, rank: int, num_outputs: int | None = None):
        super().__init__()
        self.w1 = nn.Embedding(num_inputs, rank)
        nn.init.normal_(self.w1.weight, std=1.0 / rank**0.5)
        self.w2 = nn.Linear(rank, num_outputs or num_inputs, bias=False)
        nn.init.zeros_(self.w2.weight)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """int64 [...] -> W1[x_{k-1}] [..., r]."""
        return self.w1(prev_tokens)

    def features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced rank-r features of all slots; the bias is ``w2(features)``.

        Args:
            hidden: [N, K, H] backbone outputs (unused by the Markov head, kept for one interface).
            prev_tokens: int64 [N, K], x_{k-1} for every slot (x_0 = anchor).
        Returns:
            (features [N, K, r], prev_embedding [N, K, r]); both are W1[x_{k-1}] here.
        """
        e = self.embed(prev_tokens)
        return e, e

    def forward(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced biases: (bias [N, K, V], prev_embedding [N, K, r])."""
        feat, e = self.features(hidden, prev_tokens)
        return self.w2(feat), e

    def init_state(self, batch: int, device, dtype):
        return None

    def step(self, state, hidden_k: torch.Tensor, prev_token: torch.Tensor):
        """One left-to-right step at inference: hidden_k [B, H], prev_token [B] ->
        (bias [B, V], prev_embedding [B, r], state)."""
        e = self.embed(prev_token)
        return self.w2(e), e, state


class RNNHead(nn.Module):
    """Gated recurrent bias (Eq. 6): z_k = [s_{k-1}; W1[x_{k-1}]; h_k]; one linear map gives gate g,
    candidate c and output o; s_k = sigma(g) s_{k-1} + (1 - sigma(g)) tanh(c); B_k = W2^T tanh(o);
    s_0 = 0."""

    def __init__(self, num_inputs: int, rank: int, hidden_size: int,
                 num_outputs: int | None = None):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(num_inputs, rank)
        nn.init.normal_(self.w1.weight, std=1.0 / rank**0.5)
        self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self.w2 = nn.Linear(rank, num_outputs or num_inputs, bias=False)
        nn.init.zeros_(self.w2.weight)

    def embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        return self.w1(prev_tokens)

    def init_state(self, batch: int, device, dtype):
        return torch.zeros(batch, self.rank, device=device, dtype=dtype)

    def _cell(self, state, hidden_k: torch.Tensor, prev_token: torch.Tensor):
        """One recurrence: (features tanh(o) [B, r], W1[x_{k-1}] [B, r], new state [B, r])."""
        e = self.embed(prev_token)
        g, c, o = self.cell(torch.cat((state, e, hidden_k), dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        state = gate * state + (1 - gate) * torch.tanh(c)
        return torch.tanh(o), e, state

    def step(self, state, hidden_k: torch.Tensor, prev_token: torch.Tensor):
        feat, e, state = self._cell(state, hidden_k, prev_token)
        return self.w2(feat), e, state

    def features(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced: hidden [N, K, H], prev_tokens [N, K] -> (features tanh(o) [N, K, r],
        W1[x_{k-1}] [N, K, r]); the bias is ``w2(features)``."""
        state = self.init_state(hidden.shape[0], hidden.device, hidden.dtype)
        feats, embs = [], []
        for k in range(hidden.shape[1]):
            feat, e, state = self._cell(state, hidden[:, k], prev_tokens[:, k])
            feats.append(feat)
            embs.append(e)
        return torch.stack(feats, 1), torch.stack(embs, 1)

    def forward(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        """Teacher-forced: (bias [N, K, V], emb [N, K, r])."""
        feat, e = self.features(hidden, prev_tokens)
        return self.w2(feat), e


class ConfidenceHead(nn.Module):
    """c_k = sigma(w^T [h_k; W1[x_{k-1}]]) (Eq. 7): the probability that draft token k survives
    verification given that tokens < k were accepted. Returns the raw logit z_k; calibration
    divides it by the position's STS temperature (SPEC 4)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_embedding [..., r] -> logits [...] (fp32)."""
        return self.proj(torch.cat((hidden, prev_embedding), dim=-1)).squeeze(-1).float()
