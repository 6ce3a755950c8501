"""Images sent by the official clients (openai-python, anthropic, LangChain's ChatOpenAI and
ChatAnthropic) to a real edge (``--allow-image-urls``) and worker serving the default, text-only
model: every one is a 400 naming the part, before any generation: an image for a model that takes
none, an image URL on a loopback address, base64 that does not decode. The answered side (a
vision model) is tests/e2e/test_images_answered.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.images import b64, data_url, tiny_png
from tests.processes import EdgeProcess

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PNG = tiny_png()
LOOPBACK_URL = "http://127.0.0.1:9/cat.png"


@pytest.fixture(scope="module")
def edge(default_worker, tmp_path_factory) -> Iterator[EdgeProcess]:
    with EdgeProcess(
        [default_worker.address], log_dir=tmp_path_factory.mktemp("edge-log"), extra=["--allow-image-urls"]
    ) as edge:
        yield edge


@pytest.fixture(scope="module")
def openai_client(edge: EdgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{edge.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def anthropic_client(edge: EdgeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=edge.base_url, api_key="unused", max_retries=0)


def openai_parts(url: str) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]


@pytest.mark.parametrize(
    ("url", "code", "words"),
    [
        (data_url(PNG), "image_not_supported", "takes no images"),
        (LOOPBACK_URL, "invalid_value", "not a public address"),
        ("data:image/png;base64,iVBOR#w0KGgo", "invalid_value", "does not decode"),
        (data_url(b"just text", "image/png"), "invalid_value", "not an image"),
    ],
)
def test_openai_chat_images_are_refused_naming_the_part(
    openai_client: openai.OpenAI, url: str, code: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": openai_parts(url)}], max_tokens=4
        )
    assert caught.value.status_code == 400
    assert (caught.value.param, caught.value.code) == ("messages[0].content[1]", code)
    assert words in caught.value.message


def test_openai_responses_input_image_is_refused_naming_the_part(openai_client: openai.OpenAI) -> None:
    for url, words in ((data_url(PNG), "takes no images"), (LOOPBACK_URL, "not a public address")):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client.responses.create(
                model=MODEL,
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is it?"},
                            {"type": "input_image", "image_url": url, "detail": "auto"},
                        ],
                    }
                ],
                max_output_tokens=4,
            )
        assert caught.value.param == "input[0].content[1]" and words in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}]}
            ],
        )
    assert caught.value.param == "input[0].content[0].file_id"


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({"type": "base64", "media_type": "image/png", "data": b64(PNG)}, "takes no images"),
        ({"type": "url", "url": LOOPBACK_URL}, "not a public address"),
        ({"type": "base64", "media_type": "image/png", "data": "%%%not base64%%%"}, "does not decode"),
        ({"type": "base64", "media_type": "image/tiff", "data": b64(PNG)}, "not supported"),
    ],
)
def test_anthropic_image_blocks_are_refused_naming_the_block(
    anthropic_client: anthropic.Anthropic, source: dict[str, Any], words: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "What is it?"}, {"type": "image", "source": source}],
                }
            ],
        )
    assert caught.value.status_code == 400
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    assert "'messages[0].content[1]'" in message and words in message


def test_langchain_chat_openai_sends_the_image_and_gets_the_400(edge: EdgeProcess) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{edge.base_url}/v1", api_key="unused", model=MODEL, max_tokens=4, max_retries=0
    )
    for url, words in ((data_url(PNG), "takes no images"), (LOOPBACK_URL, "not a public address")):
        with pytest.raises(openai.BadRequestError) as caught:
            llm.invoke([HumanMessage(content=openai_parts(url))])
        assert caught.value.param == "messages[0].content[1]" and words in caught.value.message


def test_langchain_chat_anthropic_sends_the_image_and_gets_the_400(edge: EdgeProcess) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage

    llm = ChatAnthropic(base_url=edge.base_url, api_key="unused", model=MODEL, max_tokens=4, max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(PNG)}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        llm.invoke([HumanMessage(content=[{"type": "text", "text": "What is it?"}, image])])
    assert "messages[0].content[1]" in caught.value.body["error"]["message"]  # type: ignore[index]
