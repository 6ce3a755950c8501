"""A request's images made ready before any worker call: refused with a 400 naming the first image
part when the model takes none (its workers' ``ModelInfo.accepts_images``), then each ``http(s)``
image URL fetched (``--allow-image-urls``, :mod:`edge.image_urls.fetch`) and checked as a data
URL's bytes are. Notes: docs/http.md, "Images"."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable

from edge.errors import InvalidRequestError
from edge.http import current_pool, current_settings
from edge.image_urls.fetch import FetchPolicy, ImageFetchError, check_url, fetch_image
from edge.surfaces.shared.chat_request import ChatCompletionRequest, ImageUrlPart
from edge.surfaces.shared.images import checked_image


async def prepare_images(chat: ChatCompletionRequest) -> None:
    """Makes every image part of ``chat`` hold its bytes, or raises a 400 naming the part in the
    caller's terms (``messages[0].content[1]``, ``input[2].content[0]``): first an image URL whose
    host is not public, then any image for a model that takes none, then a failed fetch."""
    parts = list(chat.image_parts())
    if not parts:
        return
    remote = [(chat.surface_param(param), part) for param, part in parts if part.image is None]
    await _each([(param, check_url(part.image_url.url, _policy())) for param, part in remote])
    if not await current_pool().accepts_images(chat.model):
        param = chat.surface_param(parts[0][0])
        raise InvalidRequestError(
            f"Invalid '{param}': the model {chat.model!r} takes no images (it is not a vision-language "
            "model, or one whose images are not served yet); send text only, or choose a model that "
            "accepts images.",
            param=param,
            code="image_not_supported",
        )
    await _each([(param, _fetch(part)) for param, part in remote])
    settings = current_settings()
    total = sum(len(part.image.data) for _, part in parts if part.image is not None)
    if total > settings.max_body_bytes:
        param = chat.surface_param(parts[-1][0])
        raise InvalidRequestError(
            f"Invalid '{param}': the request's images hold {total} bytes; at most {settings.max_body_bytes} "
            "(--max-body-bytes) are accepted per request.",
            param=param,
            code="invalid_value",
        )


async def _each(steps: list[tuple[str, Awaitable[None]]]) -> None:
    """Runs every step at once (each on the image at its param); the first failing one, in the
    parts' order, is a 400 naming its param."""
    results = await asyncio.gather(*(step for _, step in steps), return_exceptions=True)
    for (param, _), result in zip(steps, results, strict=True):
        if isinstance(result, ImageFetchError | ValueError):
            raise InvalidRequestError(
                f"Invalid '{param}': {result}.", param=param, code="invalid_value"
            ) from None
        if isinstance(result, BaseException):
            raise result


async def _fetch(part: ImageUrlPart) -> None:
    data = await fetch_image(part.image_url.url, _policy())
    part.resolve(checked_image(data, current_settings().max_image_bytes))


def _policy() -> FetchPolicy:
    settings = current_settings()
    return _policy_for(settings.max_image_bytes, settings.image_url_timeout_s)


@functools.cache
def _policy_for(max_bytes: int, timeout_s: float) -> FetchPolicy:
    """One policy (and TLS context) per limits, shared by the process's fetches."""
    return FetchPolicy(max_bytes=max_bytes, timeout_s=timeout_s)
