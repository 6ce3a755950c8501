"""The recurrent mixers of hybrid models (Gated DeltaNet, Mamba-2, short convolutions) over the
state pool: each mixer's forward is wrapped, not rewritten, and called once for all decode rows and
once per prompt chunk with a duck-typed cache (:class:`SlotStates`) over that group's slots.

Design notes: docs/worker.md ("The state cache of hybrid models").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from worker.attention.installed import Installed
from worker.attention.state_pool import StatePool, StateShape
from worker.model.architecture import HYBRID_TYPES
from worker.model.loader import ModelLoadError
from worker.model.serial_states import serial_tokens
from worker.model.verify_states import Round, VerifyStates

# transformers 5.24's mixers that keep their state through the Cache's conv/recurrent interface
# (get_conv_state, get_recurrent_state, update_conv_state, update_recurrent_state,
# is_recording_past); the model types served through them: architecture.HYBRID_TYPES.
MIXERS = frozenset(
    {
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "Qwen3NextGatedDeltaNet",
        "GraniteMoeHybridMambaLayer",
        "NemotronHMamba2Mixer",
        "FalconH1Mixer",
        "Lfm2ShortConv",
    }
)


class SlotStates:
    """The part of transformers' ``Cache`` a mixer reads and writes, for one call over one group
    of rows: ``conv`` and ``recurrent`` are the group's states (``[rows, ...]``; None before the
    sequence's first token). Semantics of ``LinearAttentionLayer``: the conv state keeps the last
    kernel-size columns; a first update returns its input left-padded to the kernel, a later one
    the state and the input joined. Decode paths update the tensors it returned in place."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv = conv
        self.recurrent = recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.conv is not None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self,
        states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Keeps the last ``conv_kernel_size`` columns; returns what the convolution reads."""
        kernel = conv_kernel_size or states.shape[-1]
        if self.conv is None:
            full = F.pad(states, (kernel - states.shape[-1], 0)) if states.shape[-1] < kernel else states
        else:
            full = torch.cat([self.conv, states.to(self.conv.dtype)], dim=-1)
        self.conv = full[..., -kernel:]
        return full

    def update_recurrent_state(
        self, states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.recurrent = states
        return states


@dataclass
class StateStep:
    """What the mixers need of a step: the pool, the decode rows (their flat token indexes, None
    when the forward is a ``[rows, 1]`` decode batch; their pool slots; which of them start their
    sequence) and the prompt chunks ``(flat start, count, pool slot, starts the sequence)``;
    ``verify``: the decode rows' rounds when some verify proposals (None: one round); ``serial``:
    every item ``(flat start, count, pool slot, position)`` token by token instead (batch-invariant
    steps, worker/model/serial_states.py)."""

    pool: StatePool
    decode_tokens: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_fresh: torch.Tensor | None = None  # bool [rows]
    chunks: list[tuple[int, int, int, bool]] = field(default_factory=list)
    verify: VerifyStates | None = None
    serial: list[tuple[int, int, int, int]] | None = None


STATES: Installed[StateStep] = Installed()  # the state step of the forward running in this thread


def state_step(step: StateStep | None) -> contextlib.AbstractContextManager[None]:
    """Installs ``step`` for the forward run inside, in this thread (None: no change)."""
    return STATES.using(step)


def find_mixers(model: Any) -> dict[int, Any]:
    """The model's recurrent mixers by layer index; raises :class:`ModelLoadError` for a hybrid
    model type whose mixers this transformers version does not give in a known form."""
    config = model.config.get_text_config()
    mixers = {int(module.layer_idx): module for module in model.modules() if type(module).__name__ in MIXERS}
    kind = getattr(config, "model_type", "?")
    if kind in HYBRID_TYPES and not mixers:
        names = ", ".join(getattr(config, "architectures", None) or []) or kind
        raise ModelLoadError(
            f"{names} ({kind}): no recurrent mixer of a known form found (transformers version?)"
        )
    return mixers


@torch.inference_mode()
def state_shapes(
    mixers: dict[int, Any], hidden_size: int, device: torch.device, dtype: torch.dtype
) -> dict[int, StateShape]:
    """Each mixer's per-sequence state, learned from one forward of two zero tokens with a
    recording :class:`SlotStates` (the states' shapes and dtypes as the mixer makes them)."""
    shapes = {}
    for layer, mixer in mixers.items():
        states = SlotStates()
        mixer(torch.zeros((1, 2, hidden_size), dtype=dtype, device=device), cache=states)
        if states.conv is None:
            raise ModelLoadError(f"layer {layer}'s {type(mixer).__name__} kept no convolution state")
        recurrent = states.recurrent
        shapes[layer] = StateShape(
            tuple(states.conv.shape[1:]),
            states.conv.dtype,
            None if recurrent is None else tuple(recurrent.shape[1:]),
            None if recurrent is None else recurrent.dtype,
        )
    return shapes


def wrap_mixers(mixers: dict[int, Any]) -> None:
    """Replaces each mixer's forward with :func:`_stepped` around the original (idempotent)."""
    for layer, mixer in mixers.items():
        if getattr(mixer, "_sluice_original", None) is None:
            original = mixer.forward
            mixer._sluice_original = original
            mixer.forward = _stepped(original, layer)


def _stepped(original: Callable[..., torch.Tensor], layer: int) -> Callable[..., torch.Tensor]:
    def forward(
        hidden_states: torch.Tensor, cache: Any = None, attention_mask: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        step = STATES.value
        if step is None:  # no step: the model's own forward (prompt scoring, start-up checks)
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        return _run_step(original, layer, step, hidden_states)

    return forward


def _run_step(
    original: Callable[..., torch.Tensor], layer: int, step: StateStep, hidden: torch.Tensor
) -> torch.Tensor:
    """The mixer over a step's rows: decode rows as one batch, each chunk alone (our flat layout
    has no padding, so no mask); the states go back to the pool."""
    if step.serial is not None:
        group = functools.partial(_decode_group, original, layer, step.pool)
        return serial_tokens(group, layer, step.pool, hidden, step.serial, step.verify)
    if step.decode_tokens is None and step.decode_slots is not None:  # a [rows, 1] decode batch
        return _decode_rows(original, layer, step, hidden, step.decode_slots)
    out = torch.empty_like(hidden)
    if step.decode_tokens is not None and step.decode_slots is not None:
        rows = hidden[0, step.decode_tokens][:, None, :]
        out[0, step.decode_tokens] = _decode_rows(original, layer, step, rows, step.decode_slots)[:, 0]
    for start, count, slot, fresh in step.chunks:
        out[:, start : start + count] = _chunk(
            original, layer, step.pool, hidden[:, start : start + count], slot, fresh
        )
    return out


def _decode_rows(
    original: Callable[..., torch.Tensor],
    layer: int,
    step: StateStep,
    rows: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Decode rows ``[rows, 1, H]`` as one group or, when some verify proposals, in rounds: a
    verifying row's tokens one after another over its slot, each round's verifying states kept
    (worker/model/verify_states.py)."""
    if step.verify is None:
        return _decode_group(original, layer, step.pool, rows, slots, step.decode_fresh)[0]
    out = torch.empty_like(rows)
    for round_ in step.verify.rounds:
        index: torch.Tensor = round_.rows
        fresh = None if step.decode_fresh is None else step.decode_fresh[index]
        part, states = _decode_group(original, layer, step.pool, rows[index], slots[index], fresh)
        out[index] = part
        _record(step.verify, layer, round_, states)
    return out


def _record(verify: VerifyStates, layer: int, round_: Round, states: SlotStates) -> None:
    if states.conv is not None:
        verify.record(layer, round_, states.conv, states.recurrent)


def _decode_group(
    original: Callable[..., torch.Tensor],
    layer: int,
    pool: StatePool,
    rows: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
) -> tuple[torch.Tensor, SlotStates]:
    """Decode rows ``[rows, 1, H]``: their states gathered (zeroed for a row that starts its
    sequence, ``fresh``), updated by the mixer, scattered back; the output and the new states."""
    conv = pool.conv[layer].index_select(0, slots)
    recurrent = pool.recurrent[layer].index_select(0, slots) if layer in pool.recurrent else None
    if fresh is not None:
        keep = (~fresh).to(conv.dtype)
        conv.mul_(keep.view(-1, *([1] * (conv.dim() - 1))))
        if recurrent is not None:
            recurrent.mul_((~fresh).to(recurrent.dtype).view(-1, *([1] * (recurrent.dim() - 1))))
    states = SlotStates(conv, recurrent)
    out = original(rows, cache=states, attention_mask=None)
    _put(pool, layer, slots, states)
    return out, states


def _chunk(
    original: Callable[..., torch.Tensor],
    layer: int,
    pool: StatePool,
    tokens: torch.Tensor,
    slot: int,
    fresh: bool,
) -> torch.Tensor:
    """One prompt chunk ``[1, count, H]`` from its slot's state (none when it starts the sequence)."""
    states = SlotStates()
    if not fresh:
        states.conv = pool.conv[layer][slot : slot + 1].clone()
        if layer in pool.recurrent:
            states.recurrent = pool.recurrent[layer][slot : slot + 1].clone()
    out = original(tokens, cache=states, attention_mask=None)
    _put(pool, layer, torch.tensor([slot], device=tokens.device), states)
    return out


def _put(pool: StatePool, layer: int, slots: torch.Tensor, states: SlotStates) -> None:
    """Writes a group's states back to their slots."""
    if states.conv is not None:
        pool.conv[layer].index_copy_(0, slots, states.conv.to(pool.conv[layer].dtype))
    if states.recurrent is not None and layer in pool.recurrent:
        pool.recurrent[layer].index_copy_(0, slots, states.recurrent.to(pool.recurrent[layer].dtype))


def state_step_of(
    pool: StatePool,
    device: torch.device,
    decode: Sequence[tuple[int, int]] = (),
    decode_tokens: Sequence[int] | None = None,
    chunks: Sequence[tuple[int, int, int, int]] = (),
    verify: VerifyStates | None = None,
) -> StateStep:
    """A :class:`StateStep` from host lists: ``decode`` rows ``(state slot, position)``,
    ``decode_tokens`` their flat indexes (None: a ``[rows, 1]`` batch), ``chunks``
    ``(flat start, count, state slot, position)``, ``verify`` the decode rows' rounds."""
    step = StateStep(pool, verify=verify)
    if decode:
        step.decode_slots = torch.tensor(
            [pool.slot_of(s) for s, _ in decode], dtype=torch.long, device=device
        )
        step.decode_fresh = torch.tensor([p == 0 for _, p in decode], dtype=torch.bool, device=device)
        if decode_tokens is not None:
            step.decode_tokens = torch.tensor(list(decode_tokens), dtype=torch.long, device=device)
    step.chunks = [
        (start, count, pool.slot_of(slot), position == 0) for start, count, slot, position in chunks
    ]
    return step


def serial_step(
    pool: StatePool, items: Sequence[tuple[int, int, int, int]], verify: VerifyStates | None
) -> StateStep:
    """A batch-invariant step's :class:`StateStep`: ``items`` ``(flat start, count, state slot,
    position)``, each token alone (worker/model/serial_states.py)."""
    serial = [(start, count, pool.slot_of(slot), position) for start, count, slot, position in items]
    return StateStep(pool, verify=verify, serial=serial)


def mixer_paths(model: Any) -> tuple[str, ...]:
    """The module paths of ``model``'s recurrent mixers (each runs one token at a time in a
    batch-invariant step, so its own products need no row-invariant kernel)."""
    return tuple(name for name, module in model.named_modules() if type(module).__name__ in MIXERS)


def state_pool(model: Any, device: torch.device, dtype: torch.dtype, slots: int) -> StatePool | None:
    """The state pool of a hybrid ``model`` (None for a model without recurrent mixers), sized for
    ``slots`` running sequences and as many prefix checkpoints, its mixers wrapped to run over it."""
    mixers = find_mixers(model)
    if not mixers:
        return None
    hidden = int(model.config.get_text_config().hidden_size)
    pool = StatePool(state_shapes(mixers, hidden, device, dtype), slots, device, checkpoints=slots)
    wrap_mixers(mixers)
    return pool


def state_slot_bytes(model: Any, device: torch.device, dtype: torch.dtype) -> int:
    """One sequence's state over every recurrent layer of ``model`` (0 without recurrent layers)."""
    mixers = find_mixers(model)
    if not mixers:
        return 0
    hidden = int(model.config.get_text_config().hidden_size)
    return sum(shape.bytes for shape in state_shapes(mixers, hidden, device, dtype).values())
