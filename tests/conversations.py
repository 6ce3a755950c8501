"""Multi-turn chat conversations through an edge, with the prompt tokens each turn had cached.

Used by the routing integration test (and by the retired ``bench/bench_routing.py``,
docs/benchmarks.md "Retired scripts"). Each
conversation has the same short system prompt, a long first question of its
own and short follow-ups; every turn sends the whole conversation so far (the
assistant's real answers included), as chat clients do, so turn ``k``'s
prompt starts with turn ``k-1``'s. A worker that still holds that prefix in
its prefix cache reports it in ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from openai import AsyncOpenAI

SYSTEM_PROMPT = "You are a concise assistant. Answer in one short sentence."
_SUBJECTS = (
    "lighthouses",
    "beekeeping",
    "glaciers",
    "the printing press",
    "sourdough bread",
    "volcanoes",
    "chess openings",
    "coral reefs",
    "steam engines",
    "origami",
    "tidal power",
    "honey badgers",
    "the silk road",
    "jazz harmony",
    "comets",
    "bamboo forests",
    "the abacus",
    "desert foxes",
    "stained glass",
    "hot air balloons",
)
_FOLLOW_UPS = ("Why is that?", "Give one more example.", "Summarise that in five words.")


def first_question(index: int) -> str:
    """A first question long enough that later turns are mostly the conversation so far."""
    subject = _SUBJECTS[index % len(_SUBJECTS)]
    return (
        f"Conversation {index}. I am writing a short school report about {subject}. "
        f"Tell me what {subject} are or were, where one finds them, how people first learned "
        f"about them, what is surprising about them, and which common mistakes people make "
        f"when they talk about {subject}. Keep the answer simple for a ten-year-old reader."
    )


@dataclass(frozen=True)
class Turn:
    """One answered turn: its position in the conversation (0 = first) and its token counts."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    worker_id: str

    @property
    def mostly_cached(self) -> bool:
        """At least half of the prompt's tokens came from the worker's prefix cache."""
        return 2 * self.cached_tokens >= self.prompt_tokens


async def converse(client: AsyncOpenAI, model: str, index: int, turns: int, max_tokens: int) -> list[Turn]:
    """Runs conversation ``index`` for ``turns`` turns (greedy, ``max_tokens`` per answer)."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": first_question(index)},
    ]
    answered = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": _FOLLOW_UPS[(turn - 1) % len(_FOLLOW_UPS)]})
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0,
        )
        reply = raw.parse()
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        answered.append(
            Turn(
                index,
                turn,
                usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens or 0,
                raw.headers.get("x-sluice-worker-id", ""),
            )
        )
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return answered


async def run_conversations(
    base_url: str, *, conversations: int, turns: int, parallel: int, max_tokens: int = 2, model: str = ""
) -> list[Turn]:
    """Runs ``conversations`` conversations, ``parallel`` at a time, each turn after the last."""
    gate = asyncio.Semaphore(parallel)
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        if not model:
            model = (await client.models.list()).data[0].id

        async def one(index: int) -> list[Turn]:
            async with gate:
                return await converse(client, model, index, turns, max_tokens)

        results = await asyncio.gather(*(one(i) for i in range(conversations)))
    return [turn for conversation in results for turn in conversation]


def cached_fraction(turns: list[Turn]) -> float:
    """The fraction of the turns after each conversation's first that were mostly cached."""
    later = [t for t in turns if t.turn > 0]
    return sum(t.mostly_cached for t in later) / len(later) if later else 0.0
