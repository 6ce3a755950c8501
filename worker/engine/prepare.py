"""A request made ready for the queue: each choice's sampling state built, its grammar compiled, and a
resumed generation's tokens replayed (:meth:`Engine.prepare`, off the event loop)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from worker.errors import InvalidRequest
from worker.sampling.grammar import GrammarCompiler, TokenConstraint
from worker.sampling.sampler import SequenceSampling, blocked_ids
from worker.sampling.thinking_budget import BudgetedThinking
from worker.types import FinishReason, GenerationRequest


@dataclass(frozen=True)
class Prepared:
    """A request with its per-choice sampling state built (grammars compiled): :meth:`Engine.prepare`.

    ``ended``: a resumed request whose resumed tokens already ended it at the token level (they
    reach max_tokens or the context, or complete the grammar): nothing is generated."""

    request: GenerationRequest
    samplings: list[SequenceSampling]
    ended: FinishReason | None = None


class RequestPreparer:
    """Prepares requests for one engine's model: its end tokens, context length and grammars."""

    def __init__(
        self,
        *,
        eos_token_ids: Iterable[int],
        context_length: int,
        scores_prompts: bool,
        grammars: GrammarCompiler | None,
    ):
        self._eos = frozenset(eos_token_ids)
        self._context_length = context_length
        self._scores_prompts = scores_prompts
        self._grammars = grammars

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Builds the request's per-choice sampling state, compiling its grammar (blocking). Raises
        InvalidRequest for what this engine cannot do."""
        opts = request.sampling
        if opts.prompt_logprobs is not None and not self._scores_prompts:
            raise InvalidRequest(
                "this worker runs no model (--fake-tokens), so it cannot score a prompt; "
                "leave prompt_logprobs unset (completions: echo with logprobs, or max_tokens 0)",
                param="prompt_logprobs",
            )
        blocked = blocked_ids(self._eos, opts)
        samplings = [
            SequenceSampling(
                opts,
                request.prompt_token_ids,
                blocked,
                seed_offset=i,
                constraint=self._constraint(request),
                thinking=self._thinking(request),
            )
            for i in range(opts.n)
        ]
        ended = self._resume(request, samplings) if request.resumed_token_ids else None
        return Prepared(request, samplings, ended)

    def _resume(self, request: GenerationRequest, samplings: list[SequenceSampling]) -> FinishReason | None:
        """Records a resumed request's tokens as generated (penalties, the seeded draw's step, the
        grammar, max_tokens all continue from them); returns how they already ended it, if they did.
        Raises InvalidRequest (param ``resume``) for tokens this request cannot continue from."""
        resumed, opts = request.resumed_token_ids, request.sampling
        if opts.n != 1 or len(samplings) != 1:
            raise InvalidRequest("resuming a generation supports n = 1 only", param="resume")
        if opts.prompt_logprobs is not None:
            raise InvalidRequest("a resumed generation cannot score its prompt again", param="resume")
        if len(resumed) > opts.max_tokens:
            raise InvalidRequest(
                f"{len(resumed)} resumed tokens exceed max_tokens ({opts.max_tokens})", param="resume"
            )
        if len(request.prompt_token_ids) + len(resumed) > self._context_length:
            raise InvalidRequest(
                "the prompt and the resumed tokens exceed the context length", param="resume"
            )
        sampling = samplings[0]
        for token in resumed:
            sampling.record(token)
            if sampling.constraint is not None and (error := sampling.constraint.error) is not None:
                raise InvalidRequest(
                    f"the resumed tokens do not follow the request's grammar: {error}", param="resume"
                )
        # The same token-level ends, in the same order, as the last resumed token would have met in
        # Update._stop (a stop token is never among them: it is never delivered).
        if sampling.constraint is not None and sampling.constraint.finished:
            return FinishReason.STOP
        if sampling.generated >= opts.max_tokens or len(request.prefill_token_ids) >= self._context_length:
            return FinishReason.LENGTH
        return None

    def _thinking(self, request: GenerationRequest) -> BudgetedThinking | None:
        """A choice's thinking budget state; the markers are read in text (the grammars' tokenizer)."""
        if request.thinking_budget is None:
            return None
        if self._grammars is None:
            raise RuntimeError(
                "a thinking budget reached an engine without a tokenizer (its grammar compiler)"
            )
        return BudgetedThinking(request.thinking_budget, self._grammars.decode)

    def _constraint(self, request: GenerationRequest) -> TokenConstraint | None:
        if request.grammar is None:
            return None
        if self._grammars is None:
            raise RuntimeError("a grammar-constrained request reached an engine without a grammar compiler")
        return self._grammars.constraint(request.grammar)
