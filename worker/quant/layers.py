"""Weight-only quantized linear layers (int8, int4, fp8) and the ``--quantization`` choice.

Design notes: docs/worker.md.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from worker.quant.cuda_kernels import (
    fp8_fits,
    fp8_mm,
    fp8_problem,
    int4_fits,
    int4_mm,
    int4_pack,
    int4_problem,
)

log = logging.getLogger(__name__)

CHOICES = ("none", "int8", "int4", "fp8", "auto")
INT4_GROUP = 32  # GGUF's block size; 576 (the default model's width) is not a multiple of 64 or 128
# From this many rows on, a CPU layer multiplies with its float16 batch copy (see BatchCopy).
BATCH_ROWS = 4


class QuantizationError(ValueError):
    """A ``--quantization`` choice this device, model or torch build cannot serve."""


def cpu_kernels_available() -> bool:
    """Whether this torch build has the CPU weight-only int8 and int4 kernels."""
    return all(
        hasattr(torch.ops.aten, name)
        for name in (
            "_weight_int8pack_mm",
            "_weight_int4pack_mm_for_cpu",
            "_convert_weight_to_int4pack_for_cpu",
        )
    )


def check_choice(quantization: str, device: torch.device) -> None:
    """Raises :class:`QuantizationError` (naming ``--quantization``) where ``device`` cannot serve it."""
    if quantization not in CHOICES:
        raise QuantizationError(f"--quantization must be one of {', '.join(CHOICES)}, got {quantization!r}")
    if quantization == "fp8":
        if device.type != "cuda":
            raise QuantizationError(
                f"--quantization fp8 needs a CUDA GPU with float8 support (compute capability 8.9 or "
                f"later); this worker runs on {device.type}: use int8 or int4"
            )
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise QuantizationError("--quantization fp8 needs compute capability 8.9 or later (Ada, Hopper)")
    if quantization in ("int8", "int4") and device.type == "cpu" and not cpu_kernels_available():
        raise QuantizationError(
            f"--quantization {quantization}: this torch build has no CPU int8/int4 kernels"
        )


def _uses_cpu_kernels(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


class BatchCopy:
    """The layer's dequantized weight in float16, packed once by fbgemm, for batches of rows.

    torch's weight-only int8/int4 CPU kernels widen the weight again for every row, and on
    AVX2 machines without AVX-512 (this project's) that made a 16-row decode step 1.35x
    slower than float32 (bench/bench_quant.py), while fbgemm's float16 kernel was faster than
    float32 at every batch size. A layer therefore keeps both: the 4- or 8-bit weight for
    one to three rows (a single stream's decode reads the fewest bytes) and this copy, 2
    bytes per weight, from :data:`BATCH_ROWS` rows on. Both hold the same quantized weight (the
    copy rounds it to float16, 11 significant bits) and round activations and results to bfloat16
    alike, so a row's output depends on its batch only through rare rounding-boundary cases.
    """

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    @staticmethod
    def build(weight: torch.Tensor, enabled: bool) -> BatchCopy | None:
        """A copy of ``weight`` where ``enabled``, on the CPU and with fbgemm in this build; else None."""
        if not enabled or weight.device.type != "cpu":
            return None
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return None
        try:
            return BatchCopy(weight)
        except RuntimeError:
            return None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        # Activations in and results out rounded to bfloat16 as the 4/8-bit kernels round them, so a
        # row's output mostly matches bit for bit whichever path its batch size picks.
        rows = rows.to(torch.bfloat16).float().contiguous()
        return torch.ops.quantized.linear_dynamic_fp16(rows, self.packed).to(torch.bfloat16)


def _flatten(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return x.reshape(-1, in_features)


class Int8Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W = qweight * scale[:, None]`` (int8, one scale per output row)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    scale_bf16: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        batch_copy: bool = True,
    ):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scale.shape != qweight.shape[:1]:
            raise ValueError("Int8Linear wants an int8 [out, in] weight and one scale per output row")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        # Rounded to bfloat16 (what the CPU kernel takes) once, so every path holds the same weight.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16).contiguous())
        self.register_buffer("scale", self.scale_bf16.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.batch_copy = BatchCopy.build(self.dequantized(), True) if batch_copy else None

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, batch_copy: bool = True
    ) -> Int8Linear:
        """Symmetric per-row quantization: each row's largest magnitude maps to 127."""
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(qweight, scale, bias, batch_copy=batch_copy)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _flatten(x, self.in_features)
        if self.batch_copy is not None and rows.shape[0] >= BATCH_ROWS:
            y = self.batch_copy(rows).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        elif _uses_cpu_kernels(self.qweight):
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.scale_bf16)
            y = y.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        else:
            y = F.linear(
                rows, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
            )
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


class Int8Embedding(torch.nn.Module):
    """An embedding table stored as an :class:`Int8Linear`'s rows (the tied output layer's own data)."""

    def __init__(self, table: Int8Linear):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.qweight[ids].float()
        return rows * self.table.scale[ids].unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 (shared with the output layer)"


class Int4Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``, ``g = k // group``.

    ``q`` (int32 or uint8 values 0..15, shape [out, in]) is packed once for the kernel; ``scale`` and
    ``zero`` have shape [in // group, out].
    """

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None
    kernel_kind = "int4"  # its CUDA kernel's name in worker/quant/cuda_kernels.py
    on_cuda_kernel = False  # torch's CUDA int4 kernel (worker/quant/cuda_kernels.py)

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        group: int = INT4_GROUP,
        *,
        batch_copy: bool = True,
    ):
        super().__init__()
        out_features, in_features = q.shape
        if (
            in_features % group
            or scale.shape != (in_features // group, out_features)
            or zero.shape != scale.shape
        ):
            raise ValueError(
                f"Int4Linear: bad shapes q {tuple(q.shape)}, scale {tuple(scale.shape)}, group {group}"
            )
        self.out_features, self.in_features, self.group = out_features, in_features, group
        scales_and_zeros = torch.stack([scale.float(), zero.float()], dim=-1)
        if _uses_cpu_kernels(q):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
        elif q.is_cuda and int4_fits(out_features, in_features, group) and int4_problem(q.device) is None:
            self.register_buffer("packed", int4_pack(q))
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous())
            self.on_cuda_kernel = True
        else:  # the generic path keeps two 4-bit values per byte, dequantized per call
            nibbles = q.to(torch.uint8)
            self.register_buffer("packed", nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
            self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.batch_copy = None
        if batch_copy and _uses_cpu_kernels(q):
            # The kernel's own (bfloat16) scales and offsets: both paths hold the same weight.
            kernel_scale = self.scales_and_zeros[..., 0].float().t()[..., None]
            kernel_zero = self.scales_and_zeros[..., 1].float().t()[..., None]
            grouped = (q.float() - 8).reshape(out_features, -1, group) * kernel_scale + kernel_zero
            self.batch_copy = BatchCopy.build(grouped.reshape(out_features, in_features), True)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        group: int = INT4_GROUP,
        *,
        batch_copy: bool = True,
    ) -> Int4Linear:
        """Asymmetric group-wise quantization (as GGUF's Q4_1): each group's [min, max] spans 0..15."""
        weight = weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // group, group)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        zero = low + 8 * scale
        return cls(
            q.reshape(out_features, in_features), scale.t(), zero.t(), bias, group, batch_copy=batch_copy
        )

    def _dequantized_generic(self) -> torch.Tensor:
        low, high = self.packed & 0xF, self.packed >> 4
        q = torch.stack([low, high], dim=-1).reshape(self.out_features, self.in_features).float() - 8
        scale, zero = self.scales_and_zeros[..., 0].t(), self.scales_and_zeros[..., 1].t()
        grouped = q.reshape(self.out_features, -1, self.group) * scale[..., None] + zero[..., None]
        return grouped.reshape(self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        if self.on_cuda_kernel:  # the kernel's layout: read back through a product with the identity
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            return int4_mm(eye, self.packed, self.group, self.scales_and_zeros).float().t().contiguous()
        if not _uses_cpu_kernels(self.packed):
            return self._dequantized_generic()
        # The CPU layout is the kernel's own; multiplying by the identity reads the weight back.
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scales_and_zeros)
        return w_t.float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _flatten(x, self.in_features)
        if self.batch_copy is not None and rows.shape[0] >= BATCH_ROWS:
            y = self.batch_copy(rows).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        elif _uses_cpu_kernels(self.packed):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.packed, self.group, self.scales_and_zeros
            ).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        elif self.on_cuda_kernel:
            y = int4_mm(rows, self.packed, self.group, self.scales_and_zeros).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
        else:
            weight = self._dequantized_generic().to(x.dtype)
            y = F.linear(rows, weight, None if self.bias is None else self.bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group}"


class Fp8Linear(torch.nn.Module):
    """``y = x W^T + b`` with ``W = qweight * scale[:, None]``, ``qweight`` float8 e4m3 (CUDA).

    Where ``_scaled_mm`` serves (worker/quant/cuda_kernels.py), bfloat16 inputs go through it, each
    row rounded to e4m3 first; otherwise the weight is upcast per call (half the memory of bfloat16).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    kernel_kind = "fp8"
    on_cuda_kernel = False  # ``_scaled_mm`` with per-token fp8 inputs

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.on_cuda_kernel = (
            qweight.is_cuda and fp8_fits(*qweight.shape) and fp8_problem(qweight.device) is None
        )

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Linear:
        weight = weight.detach().float()
        finfo = torch.finfo(torch.float8_e4m3fn)
        scale = (weight.abs().amax(dim=1) / finfo.max).clamp(min=1e-12)
        qweight = (weight / scale[:, None]).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
        return cls(qweight, scale, bias)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda_kernel and x.dtype == torch.bfloat16:
            y = fp8_mm(_flatten(x, self.in_features), self.qweight, self.scale)
            if self.bias is not None:
                y = y + self.bias.to(x.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)
        weight = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-row"


QuantizedLinear = Int8Linear | Int4Linear | Fp8Linear


def quantize_weight(
    scheme: str, weight: torch.Tensor, bias: torch.Tensor | None = None, *, batch_copy: bool = True
) -> QuantizedLinear:
    """A quantized layer of ``scheme`` (``int8``, ``int4`` or ``fp8``) for a float ``weight``;
    ``batch_copy``: an int8/int4 layer's float16 copy for batches (:class:`BatchCopy`)."""
    if scheme == "int8":
        return Int8Linear.from_float(weight, bias, batch_copy=batch_copy)
    if scheme == "int4":
        # No whole groups, or on the CPU an output width its int4 packing refuses (it wants a
        # multiple of 16): the next best thing.
        if weight.shape[1] % INT4_GROUP or (_uses_cpu_kernels(weight) and weight.shape[0] % 16):
            return Int8Linear.from_float(weight, bias, batch_copy=batch_copy)
        return Int4Linear.from_float(weight, bias, batch_copy=batch_copy)
    if scheme == "fp8":
        return Fp8Linear.from_float(weight, bias)
    raise QuantizationError(f"unknown quantization scheme {scheme!r}")


def quantize_linears(model: torch.nn.Module, scheme: str, *, skip: tuple[str, ...] = ()) -> int:
    """Replaces every ``nn.Linear`` of ``model`` (except those named in ``skip``) by a quantized
    layer of ``scheme``, one layer at a time so only one float weight is copied at once; returns
    how many. A tied output layer (sharing its weight with the embedding) gets its own int8 copy.
    """
    slots = [
        (parent, name, f"{prefix}.{name}" if prefix else name)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]
    done = 0
    for parent, name, path in slots:
        if path in skip:
            continue
        layer = getattr(parent, name)
        # The output layer is the most sensitive to rounding; llama.cpp keeps it at 6-8 bits too.
        # (A tensor-parallel rank's vocabulary slice of it is ``lm_head.part``.)
        layer_scheme = "int8" if scheme == "int4" and "lm_head" in path.split(".") else scheme
        with torch.no_grad():
            replacement = quantize_weight(layer_scheme, layer.weight, layer.bias)
        setattr(parent, name, replacement.to(layer.weight.device))
        done += 1
    return done


def row_invariant_linears(model: torch.nn.Module) -> list[str]:
    """Sets every int4/int8 layer of ``model`` to compute on torch's weight-only CPU kernels at
    every batch size (dropping the float copies for batches: their kernels, like float ``F.linear``,
    round a row differently depending on how many rows come with it, while the int4/int8 kernels
    compute each row alike); returns the names of the products left that are not on those
    kernels (empty: the model's products are batch-invariant): other linear layers, and any float
    matrix parameter outside an embedding table (an MoE block's 3-D experts or its router, which
    worker/quant/moe.py puts on the kernels)."""
    others: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear)) and _uses_cpu_kernels(
            module.packed if isinstance(module, Int4Linear) else module.qweight
        ):
            module.batch_copy = None
        elif (
            isinstance(module, (Int4Linear, Int8Linear, Fp8Linear, torch.nn.Linear))
            or "Linear" in type(module).__name__
        ):
            others.append(name)
        elif not isinstance(module, torch.nn.Embedding):
            others += [
                f"{name}.{key}" if name else key
                for key, parameter in module.named_parameters(recurse=False)
                if parameter.dim() >= 2 and parameter.is_floating_point()
            ]
    return others


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta":
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
