"""How the worker pool picks a worker for a request: the routing policies (``--routing``).

Design notes: docs/edge-internals.md.
"""

from __future__ import annotations

import array
import enum
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sluice.v1 import worker_pb2


class RoutingPolicy(enum.StrEnum):
    """The edge's ``--routing`` values."""

    LEAST_OUTSTANDING = "least-outstanding"
    PREFIX_AFFINITY = "prefix-affinity"


# Load balance beats cache affinity when the busiest worker has more than BALANCE_ABS_THRESHOLD
# calls in flight above the idlest AND more than BALANCE_REL_THRESHOLD times as many (both, the
# rule of SGLang's cache-aware router). The absolute bound is one default batch (the worker's
# --max-running is 16): beyond it the busier worker makes requests queue while the other has free
# batch slots, and waiting for a slot costs more than prefilling a prefix again. The ratio keeps a
# large fleet-wide load (40 vs 60 in flight) from counting as unbalanced.
BALANCE_ABS_THRESHOLD = 16
BALANCE_REL_THRESHOLD = 1.5
# A recorded prefix must cover at least this fraction of the request (in bytes of its blocks) to
# pull it to that worker (SGLang's cache threshold is 0.5 too). Below it the hit would save little,
# and a new conversation that only shares a short system prompt is spread by load instead of
# following every other conversation to one worker.
MIN_MATCHED_FRACTION = 0.5
# Prefix digests remembered (16-byte keys): a few MB at most, enough for thousands of conversations.
DEFAULT_CAPACITY = 100_000
# A raw text prompt is hashed in slices of this many characters, token ids in slices of this many
# ids (no tokenizer here: a slice is only an affinity key, not a cache block of the worker).
TEXT_BLOCK_CHARS = 256
TOKEN_BLOCK_IDS = 64

_DIGEST_BYTES = 16


@dataclass(frozen=True)
class PrefixBlock:
    """One block of a request's prompt: the chained digest of everything up to its end, and
    ``end``, the size of that prefix (bytes of the blocks so far; a weight, not tokens)."""

    digest: bytes
    end: int


def _chain(previous: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(previous + data, digest_size=_DIGEST_BYTES).digest()


def prefix_blocks(request: worker_pb2.GenerateRequest) -> list[PrefixBlock]:
    """The request's prompt as chained blocks, in order (empty for a request with no input).

    Chat: the first block is the header (model, tools, tool choice, template
    options: what a chat template renders before or around the messages)
    together with the first message, then one block per message. A raw prompt:
    the model and the text in :data:`TEXT_BLOCK_CHARS`-character slices (or
    the ids in :data:`TOKEN_BLOCK_IDS`-id slices). Two requests share block
    ``i``'s digest exactly when their blocks ``0..i`` are equal.
    """
    kind = request.WhichOneof("input")
    if kind == "chat":
        chat = request.chat
        header = worker_pb2.ChatInput(
            tools=chat.tools,
            tool_choice=chat.tool_choice,
            parallel_tool_calls=chat.parallel_tool_calls,
            chat_template_kwargs_json=chat.chat_template_kwargs_json,
        )
        if chat.HasField("enable_thinking"):
            header.enable_thinking = chat.enable_thinking
        head = b"chat\0" + request.model.encode() + b"\0" + header.SerializeToString(deterministic=True)
        pieces = [m.SerializeToString(deterministic=True) for m in chat.messages]
        if pieces:
            pieces[0] = head + pieces[0]
    elif kind == "prompt":
        head = b"prompt\0" + request.model.encode() + b"\0"
        if request.prompt.WhichOneof("prompt") == "token_ids":
            ids = list(request.prompt.token_ids.ids)
            pieces = [
                b"ids" + array.array("i", ids[at : at + TOKEN_BLOCK_IDS]).tobytes()
                for at in range(0, len(ids), TOKEN_BLOCK_IDS)
            ]
        else:
            text = request.prompt.text
            pieces = [
                text[at : at + TEXT_BLOCK_CHARS].encode() for at in range(0, len(text), TEXT_BLOCK_CHARS)
            ]
        if pieces:
            pieces[0] = head + pieces[0]
    else:
        return []
    blocks: list[PrefixBlock] = []
    digest, end = b"", 0
    for piece in pieces:
        digest = _chain(digest, piece)
        end += len(piece)
        blocks.append(PrefixBlock(digest, end))
    return blocks


def load_unbalanced(
    load: Mapping[str, int],
    abs_threshold: int = BALANCE_ABS_THRESHOLD,
    rel_threshold: float = BALANCE_REL_THRESHOLD,
) -> bool:
    """True when the busiest worker has more than ``abs_threshold`` calls above the idlest and
    more than ``rel_threshold`` times as many (``load``: calls in flight per worker)."""
    if len(load) < 2:
        return False
    busiest, idlest = max(load.values()), min(load.values())
    return busiest - idlest > abs_threshold and busiest > idlest * rel_threshold


class PrefixAffinity:
    """The prefix-affinity policy's memory: prefix digest -> the worker that served it last.

    Bounded: at most ``capacity`` digests, the least recently used (recorded
    or matched) forgotten first. Not thread-safe; one per worker pool, used
    on its event loop.
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        abs_threshold: int = BALANCE_ABS_THRESHOLD,
        rel_threshold: float = BALANCE_REL_THRESHOLD,
        min_matched_fraction: float = MIN_MATCHED_FRACTION,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._abs_threshold = abs_threshold
        self._rel_threshold = rel_threshold
        self._min_matched_fraction = min_matched_fraction
        self._owners: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def choose(self, blocks: Sequence[PrefixBlock], load: Mapping[str, int]) -> str | None:
        """The worker (one of ``load``'s keys: the available workers and their calls in flight)
        that should take a request with these blocks, or None for the pool's fewest-outstanding
        choice (no blocks, load unbalanced, or no recorded prefix long enough on an available
        worker)."""
        if not blocks or not load or load_unbalanced(load, self._abs_threshold, self._rel_threshold):
            return None
        enough = blocks[-1].end * self._min_matched_fraction
        for block in reversed(blocks):
            if block.end < enough:
                break
            owner = self._owners.get(block.digest)
            if owner is not None and owner in load:
                self._owners.move_to_end(block.digest)
                return owner
        return None

    def record(self, blocks: Sequence[PrefixBlock], address: str) -> None:
        """``address`` accepted a request with these blocks: it holds their prefixes now."""
        for block in blocks:
            self._owners[block.digest] = address
            self._owners.move_to_end(block.digest)
        while len(self._owners) > self._capacity:
            self._owners.popitem(last=False)
