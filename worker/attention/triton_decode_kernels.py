"""The Triton kernels behind `worker.attention.triton_decode` (imports triton).

Design notes: docs/worker.md.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_partition_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scales_ptr,
    value_scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    sinks_ptr,
    scale_log2,
    softcap_scale,
    softcap_log2,
    window,
    partition_tokens,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sb,
    stride_st,
    stride_sh,
    stride_wb,
    stride_wt,
    stride_wh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    CODES: tl.constexpr,
    KEY_GROUP_DIMS: tl.constexpr,
    VALUE_GROUP_DIMS: tl.constexpr,
):
    """One program: one sequence, one kv head, all query heads of its group,
    one partition of the context (the whole context when not SPLIT).

    DOT_IN_FP32 (interpreter only): the operands of the dots are rounded to
    the cache dtype as on the GPU, then widened to float32, because triton's
    interpreter multiplies bfloat16 operands wrongly (seen with triton 3.9).

    CODES (an 8-bit cache): 0 float blocks; 1 int8 codes, 2 float8 e4m3 bits, with a scale per
    token, kv head and KEY_GROUP_DIMS (VALUE_GROUP_DIMS) dims (``[num_blocks, block_size, KVH,
    groups]``, strides ``stride_s*`` for keys, ``stride_w*`` for values): each tile's codes are
    widened and scaled in registers, then go into the dots as float blocks would.

    HAS_WINDOW: only the last ``window`` tokens are read; HAS_SOFTCAP: scores
    (log2 units) are ``softcap_log2 * tanh(q.k * softcap_scale)``; HAS_SINKS
    (not SPLIT; the reduce adds them when SPLIT): each head's sink logit joins
    the denominator.

    Not SPLIT: writes the normalized output (zeros for an empty context).
    SPLIT: writes the partition's normalized output and its log2-sum-exp in
    float32 for the reduce kernel; a partition outside the context (past its
    end, or before its window) writes nothing.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = partition * partition_tokens
    end = tl.minimum(seq_len, start + partition_tokens)
    first = start
    if HAS_WINDOW:
        first = tl.maximum(start, seq_len - window)
    # Nested: `and` would mix a compile-time flag with a tensor.
    if SPLIT:  # noqa: SIM102
        if first >= end:
            return

    group_idx = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = group_idx < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + group_idx

    q = tl.load(
        query_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    table_row = block_tables_ptr + seq * stride_bt
    token_idx = tl.arange(0, TILE_TOKENS)
    for tile_start in range(first, end, TILE_TOKENS):
        tokens = tile_start + token_idx
        token_mask = tokens < end
        # Gather the pool blocks of this tile token by token, so a tile may
        # span several blocks (or part of one) whatever the block size.
        block_ids = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0)
        block_ids = block_ids.to(tl.int64)
        in_block = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            key_cache_ptr
            + block_ids[:, None] * stride_kb
            + in_block[:, None] * stride_kt
            + kv_head * stride_kh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            value_cache_ptr
            + block_ids[:, None] * stride_vb
            + in_block[:, None] * stride_vt
            + kv_head * stride_vh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if CODES != 0:
            key_offsets = (
                block_ids[:, None] * stride_sb
                + in_block[:, None] * stride_st
                + kv_head * stride_sh
                + (dims // KEY_GROUP_DIMS)[None, :]
            )
            value_offsets = (
                block_ids[:, None] * stride_wb
                + in_block[:, None] * stride_wt
                + kv_head * stride_wh
                + (dims // VALUE_GROUP_DIMS)[None, :]
            )
            k_scale = tl.load(key_scales_ptr + key_offsets, mask=kv_mask, other=0.0).to(tl.float32)
            v_scale = tl.load(value_scales_ptr + value_offsets, mask=kv_mask, other=0.0).to(tl.float32)
            k = (_widen(k, CODES) * k_scale).to(out_ptr.dtype.element_ty)
            v = (_widen(v, CODES) * v_scale).to(out_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:  # noqa: SIM108 (triton's compiler takes plain if blocks)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at the limits (exp overflows to inf).
            capped = scores * softcap_scale
            scores = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0))
        else:
            scores = scores * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        # The probabilities go into the second dot in the query's dtype (as
        # flash attention does): half the registers, the tensor cores' rate.
        p_dot = p.to(out_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            p_dot = p_dot.to(tl.float32)
        if IEEE_DOT:
            acc += tl.dot(p_dot, v, input_precision="ieee")
        else:
            acc += tl.dot(p_dot, v)
        m_i = m_new

    if not SPLIT:  # noqa: SIM102
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            acc = acc * alpha[:, None]
            m_i = m_new
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / safe_l[:, None]
    store_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        tl.store(
            partial_out_ptr
            + seq * stride_pb
            + heads[:, None] * stride_ph
            + partition * stride_pp
            + dims[None, :],
            result,
            mask=store_mask,
        )
        tl.store(
            partial_lse_ptr + seq * stride_lb + heads * stride_lh + partition,
            m_i + tl.log2(safe_l),
            mask=head_mask,
        )
    else:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _widen(codes, CODES: tl.constexpr):
    """An 8-bit cache's codes as float32: int8 as they are; float8 e4m3 from its bits (sign, 4
    exponent bits biased by 7, 3 mantissa bits), built as float32 bits, so exact on any device and
    in the interpreter alike."""
    if CODES == 1:
        return codes.to(tl.float32)
    bits = codes.to(tl.int32) & 0xFF
    exponent = (bits >> 3) & 0xF
    magnitude = (((exponent + 120) << 23) | ((bits & 0x7) << 20)).to(tl.float32, bitcast=True)
    subnormal = (bits & 0x7).to(tl.float32) * 0.001953125  # m * 2^-9
    magnitude = tl.where(exponent == 0, subnormal, magnitude)
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def decode_reduce_kernel(
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    sinks_ptr,
    window,
    partition_tokens,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program: one sequence, one query head. Combines the partitions
    that hold context (which follow from the sequence's length and window, so
    stale scratch outside them is never read), with the head's sink logit as
    one more term of the denominator; zeros for an empty context."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used_partitions = tl.cdiv(seq_len, partition_tokens)
    first_partition = 0
    if HAS_WINDOW:
        first_partition = tl.maximum(seq_len - window, 0) // partition_tokens

    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    m = float("-inf")
    total = 0.0
    if HAS_SINKS:
        # The sink as a partition whose output is zero: weight exp2(sink - m) with m = sink.
        m = tl.load(sinks_ptr + head) * 1.4426950408889634
        total = 1.0
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    lse_row = partial_lse_ptr + seq * stride_lb + head * stride_lh
    out_row = partial_out_ptr + seq * stride_pb + head * stride_ph
    for partition in range(first_partition, used_partitions):
        lse = tl.load(lse_row + partition)
        part = tl.load(out_row + partition * stride_pp + dims, mask=dim_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        total = total * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    safe_total = tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        (acc / safe_total).to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )
