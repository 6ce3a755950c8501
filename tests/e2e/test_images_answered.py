"""Images answered: the official clients (openai-python's chat and Responses APIs, anthropic,
LangChain's ChatOpenAI and ChatAnthropic) send an image to a real edge in front of a worker
serving a tiny random-weight LLaVA-style model (tests/tiny_vlms.py), and get an answer with usage
that counts the image's placeholder tokens in the prompt. What the random model writes is not
asserted; that an answer comes, with its finish reason and usage, is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.images import b64, data_url, tiny_png
from tests.processes import EdgeProcess, WorkerProcess

pytestmark = pytest.mark.e2e

PNG = tiny_png(8, 8, (10, 200, 40))
LIMIT = 4


@pytest.fixture(scope="module")
def vlm_edge(
    model_cache: Path, tmp_path_factory: pytest.TempPathFactory, tiny_vlm: Callable[[str], Path]
) -> Iterator[EdgeProcess]:
    folder = tiny_vlm("llava")
    with (
        WorkerProcess(
            cache_dir=model_cache, log_dir=tmp_path_factory.mktemp("vlm-worker-log"), model=str(folder)
        ) as worker,
        EdgeProcess([worker.address], log_dir=tmp_path_factory.mktemp("vlm-edge-log")) as edge,
    ):
        yield edge


@pytest.fixture(scope="module")
def model(vlm_edge: EdgeProcess) -> str:
    listing = httpx.get(f"{vlm_edge.base_url}/v1/models").json()["data"]
    assert len(listing) == 1
    return str(listing[0]["id"])


@pytest.fixture(scope="module")
def text_only_prompt_tokens(vlm_edge: EdgeProcess, model: str) -> int:
    """The prompt tokens of the same question without its image: an image adds its placeholders."""
    client = openai.OpenAI(base_url=f"{vlm_edge.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is in the picture?"}],
        max_tokens=1,
        temperature=0,
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def openai_parts() -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "low"}},
    ]


def test_openai_chat_answers_an_image(
    vlm_edge: EdgeProcess, model: str, text_only_prompt_tokens: int
) -> None:
    client = openai.OpenAI(base_url=f"{vlm_edge.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": openai_parts()}], max_tokens=LIMIT, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.usage.prompt_tokens > text_only_prompt_tokens
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": openai_parts()}],
        max_tokens=LIMIT,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    # The same prompt, image included (what the random model writes is not compared: a cached
    # image prefix may tip a near-tie between its tokens).
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens >= 1


def test_openai_responses_answers_an_input_image(vlm_edge: EdgeProcess, model: str) -> None:
    client = openai.OpenAI(base_url=f"{vlm_edge.base_url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(
        model=model,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is in the picture?"},
                    {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=LIMIT,
        temperature=0,
    )
    assert (
        response.usage is not None and response.usage.input_tokens > 0 and response.usage.output_tokens >= 1
    )


def test_anthropic_answers_an_image_block(
    vlm_edge: EdgeProcess, model: str, text_only_prompt_tokens: int
) -> None:
    client = anthropic.Anthropic(base_url=vlm_edge.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=model,
        max_tokens=LIMIT,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the picture?"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)},
                    },
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt > text_only_prompt_tokens and message.usage.output_tokens >= 1


def test_langchain_clients_answer_an_image(vlm_edge: EdgeProcess, model: str) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    chat_openai = ChatOpenAI(
        base_url=f"{vlm_edge.base_url}/v1", api_key="unused", model=model, max_tokens=LIMIT, temperature=0
    )
    answer = chat_openai.invoke([HumanMessage(content=openai_parts())])
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] >= 1
    chat_anthropic = ChatAnthropic(
        base_url=vlm_edge.base_url, api_key="unused", model=model, max_tokens=LIMIT, temperature=0
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)}}
    answer = chat_anthropic.invoke([HumanMessage(content=[{"type": "text", "text": "What is it?"}, image])])
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] >= 1
