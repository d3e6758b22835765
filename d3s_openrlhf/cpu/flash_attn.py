"""CPU stand-in for flash-attn 2's attention kernels, in plain torch (forward and, through autograd, backward).

Transformers' ``flash_attention_2`` path and OpenRLHF's sample packing call ``flash_attn_varlen_func`` (packed
sequences delimited by ``cu_seqlens``) and ``flash_attn_func`` (a dense batch). The CUDA extension is absent on
CPU; these two functions take its place with flash-attn's signature and semantics:

* causal masks are aligned to the bottom-right corner of each sequence's (L_q, L_k) block, as in flash-attn;
* a query row with no key to attend to (L_q > L_k, causal) yields zeros, not NaN;
* grouped-query attention: query head h reads key/value head h // (H / H_kv);
* ``softmax_scale`` defaults to 1 / sqrt(head_dim); ``deterministic`` is accepted (this kernel always is);
* scores, softmax and the weighted sum run in float32 and the output is cast back to q's dtype (flash-attn
  accumulates in float32 too).

Features the kernels offer but nothing on the CPU path uses (dropout, sliding windows, softcap, ALiBi, paged KV
blocks, returned probabilities) are refused with a ValueError instead of being ignored.

The packed sequences are scattered into a padded (B, L_max, H, D) batch and attended in one batched matmul,
O(B * L_max^2) memory per head like the padded path it replaces.
"""

import math

import torch


def _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs, block_table=None):
    problems = []
    if dropout_p:
        problems.append(f"dropout_p={dropout_p} (set the model's attention_dropout to 0)")
    if tuple(window_size) != (-1, -1):
        problems.append(f"window_size={tuple(window_size)} (sliding-window attention)")
    if softcap:
        problems.append(f"softcap={softcap}")
    if alibi_slopes is not None:
        problems.append("alibi_slopes")
    if return_attn_probs:
        problems.append("return_attn_probs=True")
    if block_table is not None:
        problems.append("block_table (paged KV cache)")
    if problems:
        raise ValueError(
            "the CPU flash-attention stand-in (d3s_openrlhf.cpu.flash_attn) supports causal or full attention "
            "with softmax_scale only, not " + ", ".join(problems) + "; use --ds.attn_implementation sdpa or eager"
        )


def _padded_attention(q, k, v, q_lens, k_lens, softmax_scale, causal):
    """Attention over a padded batch.

    q: (B, Lq, H, D); k, v: (B, Lk, H_kv, D); q_lens, k_lens: (B,) valid lengths (rows/keys beyond are padding).
    Returns (B, Lq, H, D) in q's dtype; padded query rows are zero.
    """
    batch, len_q, heads, head_dim = q.shape
    heads_kv = k.shape[2]
    if heads % heads_kv:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({heads_kv})")
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    groups = heads // heads_kv
    qf = q.float().transpose(1, 2)  # (B, H, Lq, D)
    kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)  # (B, H, Lk, D)
    vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)

    rows = torch.arange(len_q, device=q.device)
    cols = torch.arange(k.shape[1], device=q.device)
    allowed = cols.view(1, 1, -1) < k_lens.view(-1, 1, 1)  # (B, 1, Lk) -> broadcast over rows
    allowed = allowed & (rows.view(1, -1, 1) < q_lens.view(-1, 1, 1))  # (B, Lq, Lk)
    if causal:
        # bottom-right alignment: row i of a sequence sees keys j <= i + (L_k - L_q)
        offset = (k_lens - q_lens).view(-1, 1, 1)
        allowed = allowed & (cols.view(1, 1, -1) <= rows.view(1, -1, 1) + offset)
    has_key = allowed.any(dim=-1, keepdim=True)  # (B, Lq, 1)
    # Rows without any key get an all-True mask (finite softmax, clean gradients) and are zeroed afterwards.
    allowed = allowed | ~has_key
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1) * has_key.unsqueeze(1)
    out = torch.matmul(probs, vf)  # (B, H, Lq, D)
    return out.transpose(1, 2).to(q.dtype)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_func`` on CPU. q: (B, L_q, H, D); k, v: (B, L_k, H_kv, D) -> (B, L_q, H, D)."""
    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    batch = q.shape[0]
    q_lens = torch.full((batch,), q.shape[1], device=q.device)
    k_lens = torch.full((batch,), k.shape[1], device=q.device)
    return _padded_attention(q, k, v, q_lens, k_lens, softmax_scale, causal)


def _segments(cu_seqlens, total):
    """(segment index, position in segment) of each of ``total`` packed tokens, and the segment lengths.

    Tokens past ``cu_seqlens[-1]`` (padding some callers append) get segment index B and are dropped.
    """
    cu_seqlens = cu_seqlens.long()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if (lengths < 0).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    if int(cu_seqlens[-1]) > total:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the packed tensor has {total} tokens")
    tokens = torch.arange(total, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens[1:], tokens, right=True)  # (T,)
    position = tokens - cu_seqlens[segment.clamp(max=len(lengths) - 1)]
    return segment, position, lengths


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``flash_attn.flash_attn_varlen_func`` on CPU.

    q: (T_q, H, D), k, v: (T_k, H_kv, D) -- sequences packed back to back; cu_seqlens_q/_k: (B + 1,) offsets of
    each sequence. Returns (T_q, H, D); rows past ``cu_seqlens_q[-1]`` are zero. ``max_seqlen_*`` are recomputed
    from ``cu_seqlens`` (they only size CUDA grids).
    """
    _refuse_unsupported(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs, block_table)
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(f"cu_seqlens_q has {len(cu_seqlens_q)} entries, cu_seqlens_k {len(cu_seqlens_k)}")
    seg_q, pos_q, q_lens = _segments(cu_seqlens_q, q.shape[0])
    seg_k, pos_k, k_lens = _segments(cu_seqlens_k, k.shape[0])
    batch = len(q_lens)
    len_q = int(q_lens.max()) if batch else 0
    len_k = int(k_lens.max()) if batch else 0
    keep_q = seg_q < batch
    keep_k = seg_k < batch

    def scatter(x, segment, position, keep, length):
        padded = x.new_zeros((batch, length, *x.shape[1:]))
        return padded.index_put((segment[keep], position[keep]), x[keep])

    out_padded = _padded_attention(
        scatter(q, seg_q, pos_q, keep_q, len_q),
        scatter(k, seg_k, pos_k, keep_k, len_k),
        scatter(v, seg_k, pos_k, keep_k, len_k),
        q_lens,
        k_lens,
        softmax_scale,
        causal,
    )
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    return out.index_put((keep_q.nonzero().squeeze(-1),), out_padded[seg_q[keep_q], pos_q[keep_q]])
