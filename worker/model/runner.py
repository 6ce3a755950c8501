"""Executes the model over the paged KV cache: the only module that runs torch forward passes.

Design notes: docs/worker.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from worker.attention import paged
from worker.attention.decode_kernel import decode_kernel, kernel_problem
from worker.attention.kv_pool import KVPool, KVShape, kv_shape
from worker.attention.state_pool import StatePool
from worker.device.staging import fence
from worker.lora.choice import lora_ops, lora_row_ops
from worker.lora.layers import LoraLayers
from worker.model.architecture import check_attention
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.loader import LoadedModel, ModelLoadError
from worker.model.recurrent import StateStep, mixer_paths, serial_step, state_pool, state_step, state_step_of
from worker.model.step_inputs import (
    ChunkImage,
    DecodeInputs,
    FlatTokens,
    Work,
    decode_inputs,
    fed_ids,
    is_decode_row,
    token_rows,
)
from worker.model.verify_states import VerifyStates, verify_states
from worker.model.vision import VisionEncoder, mrope_positions, vision_spec
from worker.quant.layers import row_invariant_linears
from worker.quant.moe import model_scheme, row_invariant_moe
from worker.types import FastPath, LoraHandle, SampledLogprobs


def _image_spans(flat: FlatTokens, work: Sequence[Work]) -> torch.Tensor:
    """Bool ``[T]``: which of the flat tokens lie inside an image's span (its placeholders there)."""
    inside = torch.zeros(len(flat.ids), dtype=torch.bool)
    for item, first in zip(work, flat.starts, strict=True):
        for image in item.images:
            low = max(image.span[0], item.start) - item.start
            high = min(image.span[1], item.start + len(item.tokens)) - item.start
            inside[first + low : first + high] = True
    return inside


def check_batch_invariant(loaded: LoadedModel, exempt: tuple[str, ...] = ()) -> None:
    """Raises :class:`ModelLoadError` unless ``loaded`` can run batch-invariant steps (the module
    docstring), and drops the quantized layers' float copies for batches (their kernels are not);
    an MoE block's float experts and router go on the same kernels (worker/quant/moe.py).
    ``exempt``: module paths whose products see one token at a time (a hybrid's mixers); the input
    embedding, whatever its class (a tensor-parallel rank's vocabulary slice), is a lookup."""
    table = loaded.model.get_input_embeddings()
    exempt = (*exempt, *(name for name, module in loaded.model.named_modules() if module is table))
    if loaded.device.type != "cpu":
        raise ModelLoadError("--batch-invariant runs on the CPU only for now", param="batch_invariant")
    scheme = model_scheme(loaded.model)
    if scheme is not None:  # a float model is refused below
        row_invariant_moe(loaded.model, scheme)
    float_layers = [
        name
        for name in row_invariant_linears(loaded.model)
        if not name.startswith(tuple(f"{e}." for e in exempt))
    ]
    if float_layers:
        raise ModelLoadError(
            "--batch-invariant needs every linear layer on the int4 or int8 weight-only kernels "
            f"(--quantization int4 or int8); float products: {', '.join(float_layers[:3])}",
            param="batch_invariant",
        )


class Followers(Protocol):
    """The other tensor-parallel ranks (worker/parallel/): told each forward before rank 0 runs it."""

    def execute(self, work: Sequence[Work], fed: torch.Tensor | None) -> None: ...
    def score(self, prompt: Sequence[int], top_n: int, lora: LoraHandle | None) -> None: ...
    def accepted(self, item: Work, kept: int) -> None: ...


class ModelRunner:
    # With --tensor-parallel-size above 1, on rank 0: the ranks that run each forward with it.
    followers: Followers | None = None
    scores_prompts = True  # ``score`` works (a runner without a model says False)
    # A hybrid model's last step's verifying rows and their kept states (worker/model/verify_states.py).
    _verify: VerifyStates | None = None
    # With --enable-lora: the wrapped projections and the adapters' slots (:meth:`enable_lora`).
    lora: LoraLayers | None = None
    # A hybrid model's mixers on their packages' kernels (False: torch forms; None: no mixers), a metric.
    mixers_on_kernels: bool | None = None

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        batch_invariant: bool = False,
        triton_decode: bool | None = None,
        max_sequences: int = 16,
        kv_cache_dtype: str = "auto",
        ranks: int = 1,
    ):
        """``triton_decode``: decode rows on the Triton kernel; None chooses (below), True forces it
        (tests run it on the CPU through triton's interpreter). ``max_sequences``: the state slots
        of a hybrid model (one per running sequence: the scheduler's ``max_running``).
        ``kv_cache_dtype``: ``--kv-cache-dtype`` (worker/attention/kv_quant.py). ``ranks``: the
        tensor-parallel ranks the model is sharded over (the pool holds this rank's heads)."""
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.attention = check_attention(self.model, getattr(loaded, "context_length", None))
        spec = vision_spec(self.model.config)  # raises for a vision-language model not served
        paged.register()
        if spec is None:
            self.model.set_attn_implementation(paged.NAME)
        else:  # the language model on the pool; the vision tower on SDPA (no cache)
            self.model.set_attn_implementation(
                {"": paged.NAME, "text_config": paged.NAME, "vision_config": "sdpa"}
            )
        self.vision = None if spec is None else VisionEncoder(self.model, spec, loaded.device, loaded.dtype)
        self.kv_shape: KVShape = kv_shape(self.model.config, self.dtype, kv_cache_dtype).per_rank(ranks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the scheduler hands out: padding rows of a captured decode batch write
        # their keys and values there.
        self.pool = KVPool(self.kv_shape, num_blocks + 1, block_size, self.device)
        self.scratch_block = num_blocks
        # A hybrid model's recurrent states (worker/model/recurrent.py; None: attention only).
        self.states: StatePool | None = state_pool(self.model, self.device, self.dtype, max_sequences)
        self.graphs: DecodeGraphs | None = None  # set once captured (CUDA)
        self.fast_path: FastPath | None = None  # set at start-up on CUDA (a metric)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            check_batch_invariant(loaded, mixer_paths(self.model))
            if self.vision is not None:
                raise ModelLoadError("--batch-invariant serves text-only models", param="batch_invariant")
        # On CUDA, decode rows use the Triton kernel (no gather), graphs or not, once it passed its
        # start-up check (worker.attention.decode_kernel.kernel_problem: why not, logged at ERROR);
        # ``triton_decode`` forces the choice (tests run the kernel through triton's interpreter).
        self.kernel_problem: str | None = None
        if triton_decode is None:
            if self.device.type == "cuda":
                softcap = self.attention.softcap
                self.kernel_problem = kernel_problem(self.kv_shape, self.block_size, self.device, softcap)
            self._use_kernel = self.device.type == "cuda" and self.kernel_problem is None
        else:
            self._use_kernel = triton_decode

    @property
    def decode_kernel_enabled(self) -> bool:
        """Decode attention runs the Triton kernel (CUDA, triton installed, start-up check passed)."""
        return self._use_kernel

    @property
    def pool_bytes(self) -> int:
        return self.pool.bytes

    @property
    def state_bytes(self) -> int:
        """The state pool's bytes (0 for a model without recurrent layers)."""
        return 0 if self.states is None else self.states.bytes

    @torch.inference_mode()
    def execute(self, work: Sequence[Work], fed: torch.Tensor | None = None) -> torch.Tensor:
        """Runs every item in one forward; float32 logits [kept rows, vocab] in ``work`` order (one
        row per sampling item, ``1 + proposed`` for a verifying one), on the model's device (the
        sampler runs there). Queues the work without waiting for it on CUDA. ``fed``: the previous
        step's drawn ids on the device, which the items' placeholder tokens name (:func:`fed_ids`)."""
        if not work:
            raise ValueError("execute needs at least one item")
        if self.followers is not None:
            self.followers.execute(work, fed)
        if self.lora is not None:
            with self.lora.step([(item.lora, len(item.tokens)) for item in work]):
                return self._execute_states(work, fed)
        return self._execute_states(work, fed)

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraLayers:
        """Wraps the model's attention and MLP projections for LoRA adapters (worker/lora/): each
        step then adds its adapters' products, grouped by adapter, to their rows (per row, each
        row's slot a graph input, in the captured decode steps). Before the graphs are captured."""
        ops, row_ops = lora_ops(self.device), lora_row_ops(self.device)
        self.lora = LoraLayers(self.model, max_loras, max_rank, ops, row_ops)
        return self.lora

    def _execute_states(self, work: Sequence[Work], fed: torch.Tensor | None) -> torch.Tensor:
        """:meth:`execute` around a hybrid model's state checkpoints (none for other models)."""
        if self.states is None:
            return self._execute(work, fed)
        self._copy_states([(item.state_from, item.state_slot, True) for item in work if item.state_from >= 0])
        self._verify = verify_states([item for item in work if is_decode_row(item)], self.states, self.device)
        logits = self._execute(work, fed)
        self._copy_states([(item.state_to, item.state_slot, False) for item in work if item.state_to >= 0])
        return logits

    def accepted(self, item: Work, kept: int) -> None:
        """The last step's verifying ``item`` kept ``kept`` of its proposals: a hybrid model's slot
        takes the state after them (rejected proposals must not advance it); nothing otherwise."""
        if self._verify is not None and self.states is not None:
            if self.followers is not None:  # their states advanced over the same proposals
                self.followers.accepted(item, kept)
            self._verify.keep(self.states, item.state_slot, kept)

    def _copy_states(self, copies: Sequence[tuple[int, int, bool]]) -> None:
        """State checkpoint copies ``(checkpoint, state slot, into the slot)``: a resumed prefix's
        state before the forward, a chunk's end state after it."""
        assert self.states is not None
        for checkpoint, slot, restore in copies:
            stored, live = self.states.checkpoint(checkpoint), self.states.slot_of(slot)
            if restore:
                self.states.copy(stored, live)
            else:
                self.states.copy(live, stored)

    def _execute(self, work: Sequence[Work], fed: torch.Tensor | None) -> torch.Tensor:
        if self.batch_invariant:
            return self._invariant(work, fed)
        if all(is_decode_row(item) for item in work):
            rows = work  # one-token steps pass as they are; a verifying item becomes several rows
            if any(item.proposed for item in work):
                rows = [row for item in work for row in token_rows(item)]
            logits = self._decode(rows, fed)
            wanted = [i for i, row in enumerate(rows) if row.sample]
            if len(wanted) == len(rows):
                return logits
            return logits[torch.tensor(wanted, dtype=torch.long, device=logits.device)]
        return self._mixed(work, fed)

    def ready(self) -> Callable[[], None]:
        """A callable that returns once the device finished what was queued so far (the engine
        takes one after a step's draw and calls it before reading the draw)."""
        return fence(self.device)

    def _decode_rows(
        self, step: paged.PagedStep, work: Sequence[Work], inputs: DecodeInputs | None = None
    ) -> None:
        """Fills ``step``'s decode rows (one query token each) for these items: block tables and
        lengths, and the gather's mask or, on CUDA with triton, the decode kernel."""
        rows = len(work)
        kernel = self._use_kernel
        index_type = torch.int32 if kernel else torch.long
        if inputs is None:
            inputs = decode_inputs(work, self.block_size, self.device, index_type)
        width = inputs.tables.shape[1]
        step.decode_tables = inputs.tables
        step.decode_lengths = inputs.lengths
        if kernel:
            step.decode_kernel = decode_kernel(rows, self.kv_shape, width, self.block_size, self.device)
        else:
            step.decode_mask = paged.decode_mask(step.decode_lengths, width * self.block_size)

    def _decode(self, work: Sequence[Work], fed: torch.Tensor | None) -> torch.Tensor:
        # The graphs take each row's LoRA slot as an input (captured with adapters on); a hybrid
        # model's step with verifying rows runs eagerly (their states are kept per round).
        lora_rows = self.lora is not None and self.lora.plan is not None
        eager = (lora_rows and not (self.graphs and self.graphs.adapters)) or self._verify is not None
        if self.graphs is not None and self.graphs.fits(len(work)) and not eager:
            return self.graphs.run(work, fed)
        index_type = torch.int32 if self._use_kernel else torch.long
        inputs = decode_inputs(work, self.block_size, self.device, index_type, fed)
        step = paged.PagedStep(pool=self.pool, slots=inputs.slots)
        self._decode_rows(step, work, inputs)
        states = self._state_step(decode=work)
        with paged.paged_step(step), state_step(states):
            out = self.model(input_ids=inputs.ids, position_ids=inputs.positions, use_cache=False)
        return out.logits[:, -1].float()

    def _mixed(self, work: Sequence[Work], fed: torch.Tensor | None) -> torch.Tensor:
        device = self.device
        flat = FlatTokens.of(work, self.block_size)
        decode_tokens: list[int] = []
        decode_work: list[Work] = []
        chunks: list[paged.Chunk] = []
        for item, start in zip(work, flat.starts, strict=True):
            count = len(item.tokens)
            if is_decode_row(item):
                decode_tokens += range(start, start + count)
                decode_work += token_rows(item)
                continue
            context = item.start + count
            blocks = item.table[: -(-context // self.block_size)]
            bidirectional = self.vision is not None and self.vision.spec.bidirectional
            chunks.append(
                paged.Chunk(
                    start,
                    count,
                    context,
                    torch.tensor(list(blocks), dtype=torch.long, device=device),
                    spans=tuple(image.span for image in item.images) if bidirectional else (),
                    windowed_spans=bidirectional and bool(self.vision and self.vision.spec.windowed_only),
                )
            )
        step = paged.PagedStep(pool=self.pool, slots=flat.slot_tensor(device), chunks=chunks)
        if decode_work:
            step.decode_tokens = torch.tensor(decode_tokens, dtype=torch.long, device=device)
            self._decode_rows(step, decode_work)
        states = self._state_step(work, flat.starts, decode_work, decode_tokens)
        with state_step(states):
            return self._forward_flat(step, flat, fed, work)

    def _state_step(
        self,
        work: Sequence[Work] = (),
        starts: Sequence[int] = (),
        decode: Sequence[Work] = (),
        decode_tokens: Sequence[int] | None = None,
    ) -> StateStep | None:
        """The recurrent layers' view of a step (None for a model without them): ``decode`` rows
        (flat indexes ``decode_tokens``; None: a ``[rows, 1]`` batch) and ``work``'s prompt chunks,
        which start at ``starts`` in the flat tokens."""
        if self.states is None:
            return None
        chunks = [
            (first, len(item.tokens), item.state_slot, item.start)
            for item, first in zip(work, starts, strict=True)
            if not is_decode_row(item)
        ]
        rows = [(item.state_slot, item.start) for item in decode]
        return state_step_of(self.states, self.device, rows, decode_tokens, chunks, self._verify)

    def _invariant(self, work: Sequence[Work], fed: torch.Tensor | None) -> torch.Tensor:
        size = self.block_size
        flat = FlatTokens.of(work, size)
        width = paged.invariant_blocks(max(item.start + len(item.tokens) for item in work), size)
        tables = []
        for item in work:
            used = -(-(item.start + len(item.tokens)) // size)
            # Entries past the context name the scratch block (zeros), so masked keys are finite.
            table = torch.full((width,), self.scratch_block, dtype=torch.long)
            table[:used] = torch.tensor(list(item.table[:used]), dtype=torch.long)
            tables.append(table.expand(len(item.tokens), width))
        widest = max(layer.kv_heads * layer.head_dim for layer in self.kv_shape.layers)
        rows = paged.invariant_rows(
            torch.cat(tables),
            torch.tensor(flat.positions, dtype=torch.long) + 1,
            size,
            widest * torch.empty((), dtype=self.dtype).element_size(),  # gathered in the model's dtype
            self.device,
        )
        step = paged.PagedStep(pool=self.pool, slots=flat.slot_tensor(self.device), invariant=rows)
        states = None  # a hybrid model's mixers: each token alone (worker/model/serial_states.py)
        if self.states is not None:
            items = [
                (first, len(item.tokens), item.state_slot, item.start)
                for item, first in zip(work, flat.starts, strict=True)
            ]
            states = serial_step(self.states, items, self._verify)
        with state_step(states):
            return self._forward_flat(step, flat, fed)

    def _forward_flat(
        self, step: paged.PagedStep, flat: FlatTokens, fed: torch.Tensor | None, work: Sequence[Work] = ()
    ) -> torch.Tensor:
        """One forward of ``flat``'s tokens as a ``[1, T]`` sequence under ``step``; the logits of
        its sampling tokens. ``work``'s images: the vision encoder runs first (outside the paged
        step) and its features replace their placeholders' embeddings; an M-RoPE model's positions
        are 3-D."""
        device = self.device
        ids = fed_ids(torch.tensor([flat.ids], dtype=torch.long, device=device), fed)
        inputs: dict[str, torch.Tensor] = {"input_ids": ids}
        images: list[ChunkImage] = [image for item in work for image in item.images]
        if images:
            assert self.vision is not None
            inputs = self.vision.inputs(ids, images, _image_spans(flat, work))
        positions = torch.tensor([flat.positions], dtype=torch.long, device=device)
        if any(item.grids for item in work):
            positions = torch.cat(
                [mrope_positions(item.grids, item.start, len(item.tokens)) for item in work], 1
            )
            positions = positions[:, None, :].to(device)
        with paged.paged_step(step):
            out = self.model(
                **inputs,
                position_ids=positions,
                use_cache=False,
                logits_to_keep=torch.tensor(flat.keep, dtype=torch.long, device=device),
            )
        return out.logits[0].float()

    @torch.inference_mode()
    def score(
        self, prompt: Sequence[int], top_n: int, lora: LoraHandle | None = None
    ) -> list[SampledLogprobs]:
        """The logprob of each prompt token after the first given the tokens before it, with the
        ``top_n`` best alternatives, from one forward over the whole prompt (no KV kept, no prefix
        reused: every position needs its logits), under ``lora``'s adapter when given."""
        if self.followers is not None:
            self.followers.score(prompt, top_n, lora)
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)
        if self.lora is not None:
            with self.lora.step([(lora, len(prompt))]):
                logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        else:
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = ids[0, 1:]
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_values: list[list[float]] = [[] for _ in chosen]
        top_ids: list[list[int]] = [[] for _ in chosen]
        if top_n:
            values, indexes = torch.topk(logprobs, top_n, dim=-1)
            top_values, top_ids = values.tolist(), indexes.tolist()
        return [
            SampledLogprobs(int(token), value, tuple(alt_ids), tuple(alt_values))
            for token, value, alt_ids, alt_values in zip(prompt[1:], chosen, top_ids, top_values, strict=True)
        ]
