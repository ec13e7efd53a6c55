"""Decoder building blocks of the drafter backbone: RMSNorm, RoPE, KV-injection attention, MLP.

Pure PyTorch. Shapes use B (batch), Q (block queries), C (context keys), H (hidden size),
nh / nkv (query / key-value heads), hd (head dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (computed in fp32, cast back to the input dtype)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables for arbitrary integer positions (half-split layout,
    as in Llama / Qwen in transformers)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: int64 [B, N] -> (cos, sin), each [B, 1, N, hd] in ``dtype``."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, N, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, N, hd]; cos/sin: [B, 1, N, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVInjectionAttention(nn.Module):
    """Attention whose queries come from the block only and whose keys/values are
    [proj(H_ctx); proj(h_block)] with the same k/v projections for both parts (DFlash KV injection,
    DSpark paper Eq. 3)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, N, H] -> (k, v) each [B, nkv, N, hd], RoPE applied to k."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward_packed(self, block: torch.Tensor, block_rope, context_kv, packed,
                       block_visibility: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
        """Training attention over anchor-bounded packed blocks (see ``drafters/packing.py``).

        Args:
            block: [N, S, H] normed block hidden states.
            block_rope: (cos, sin) of the block positions, [N, 1, S, hd].
            context_kv: (k, v) of the packed context rows, each [Nc, nkv, hd] (RoPE applied).
            packed: the :class:`~drafters.packing.PackedBlocks` giving the visibility indices.
            block_visibility: bool [S, S] or None (bidirectional block).
            window: sliding window in tokens (a query at position q sees context positions
                > q - window), or None (full attention).
        Returns:
            [N, S, H].
        """
        # lazy: import cycle: dspark (via the package) -> layers
        from .packing import packed_attention

        n, s, _ = block.shape
        cos, sin = block_rope
        q = self.q_norm(self.q_proj(block).view(n, s, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k_blk, v_blk = self.project_kv(block, cos, sin)
        out = packed_attention(q, k_blk, v_blk, context_kv[0], context_kv[1], packed,
                               block_visibility, window=window)
        return self.o_proj(out.transpose(1, 2).reshape(n, s, -1))

    def project_packed_context(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Packed context rows [Nc, H] with RoPE tables [1, 1, Nc, hd] -> (k, v) [Nc, nkv, hd]."""
        k, v = self.project_kv(context[None], cos, sin)
        return k[0].transpose(0, 1), v[0].transpose(0, 1)

    def forward(self, block: torch.Tensor, block_rope, context_kv, mask: torch.Tensor | None):
        """Attend from the block to [context; block].

        Args:
            block: [B, Q, H] normed block hidden states.
            block_rope: (cos, sin) of the block positions, [B, 1, Q, hd].
            context_kv: (k, v) of the context, each [B, nkv, C, hd] (RoPE already applied).
            mask: bool [B, 1, Q, C + Q], True = may attend; None = attend to everything.
        Returns:
            [B, Q, H].
        """
        b, q_len, _ = block.shape
        cos, sin = block_rope
        q = self.q_norm(self.q_proj(block).view(b, q_len, self.num_heads, self.head_dim))
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k_blk, v_blk = self.project_kv(block, cos, sin)
        k = torch.cat((context_kv[0], k_blk), dim=2)
        v = torch.cat((context_kv[1], v_blk), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class SwiGLU(nn.Module):
    """Gated MLP of Llama/Qwen decoder layers."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer: block queries attend to injected context K/V and the block.

    Args:
        cfg: the drafter's :class:`~drafters.config.BoundDrafterConfig` (the layer's shapes).
        window: this layer's sliding attention window in tokens (``cfg.layer_windows``), or None
            for full attention. Training applies it here; at inference the caller's mask carries
            it (:meth:`drafters.dspark.DSparkDrafter.block_hidden`).
    """

    def __init__(self, cfg, window: int | None = None):
        super().__init__()
        self.window = window
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = KVInjectionAttention(cfg.hidden_size, cfg.num_attention_heads,
                                              cfg.num_key_value_heads, cfg.head_dim, cfg.qk_norm,
                                              cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, hidden, block_rope, context_kv, mask=None, packed=None):
        """``packed`` given: training over packed blocks (context_kv are packed rows, ``mask``
        unused); otherwise one block per sequence over a context cache with an optional mask."""
        normed = self.input_layernorm(hidden)
        if packed is not None:
            attn = self.self_attn.forward_packed(normed, block_rope, context_kv, packed,
                                                 window=self.window)
        else:
            attn = self.self_attn(normed, block_rope, context_kv, mask)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
