"""The Triton kernels behind `worker.model.fused` (imports triton): RMSNorm, SiLU·mul and rotary,
each one kernel, rounding where the eager modules round.

Design notes: docs/worker.md ("Fused kernels").
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_out,
    columns,
    eps,
    BLOCK: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
):
    """One row per program. ``SCALE_IN_FP32`` False (Llama, Qwen, Mistral): the normalised row is
    rounded to the input's type and then multiplied by the weight; True (Gemma): scaled by
    ``1 + weight`` in float32 and rounded once."""
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < columns
    x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / columns
    normed = x * tl.math.rsqrt(variance + eps)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    if SCALE_IN_FP32:
        out = normed * (1.0 + weight.to(tl.float32))
    else:
        out = weight.to(tl.float32) * normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["count"])
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, count, BLOCK: tl.constexpr):
    """``silu(gate) * up`` over contiguous tensors, the SiLU rounded to their type first."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    activated = (gate / (1.0 + tl.exp(-gate))).to(kind).to(tl.float32)
    tl.store(out_ptr + offsets, (activated * up).to(kind), mask=mask)


# Arguments that change with a step's token count are not specialised on (divisibility by 16, 1),
# so a new prompt length never compiles another variant while serving.
@triton.jit(do_not_specialize=["tokens", "stride_xb", "stride_ob"])
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    tokens,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_cos,
    half,
    HALF_PAD: tl.constexpr,
):
    """``x * cos + rotate_half(x) * sin`` for one (batch, token) and head per program, ``x`` being
    ``[batch, heads, tokens, 2 * half]`` and ``cos``/``sin`` rows ``[batch * tokens, 2 * half]``.
    Each product and the sum are rounded to the type, as the eager expression rounds them."""
    index = tl.program_id(0)
    head = tl.program_id(1)
    batch = index // tokens
    token = index % tokens
    offsets = tl.arange(0, HALF_PAD)
    mask = offsets < half
    kind = out_ptr.dtype.element_ty
    angles = index * stride_cos + offsets
    cos_first = tl.load(cos_ptr + angles, mask=mask, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + angles + half, mask=mask, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + angles, mask=mask, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + angles + half, mask=mask, other=0.0).to(tl.float32)
    source = x_ptr + batch * stride_xb + head * stride_xh + token * stride_xt + offsets
    first = tl.load(source, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(source + half, mask=mask, other=0.0).to(tl.float32)
    out_first = (first * cos_first).to(kind).to(tl.float32) + (-second * sin_first).to(kind).to(tl.float32)
    out_second = (second * cos_second).to(kind).to(tl.float32) + (first * sin_second).to(kind).to(tl.float32)
    target = out_ptr + batch * stride_ob + head * stride_oh + token * stride_ot + offsets
    tl.store(target, out_first.to(kind), mask=mask)
    tl.store(target + half, out_second.to(kind), mask=mask)
