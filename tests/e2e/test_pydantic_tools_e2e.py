"""Tools and structured outputs made by openai-python from pydantic models (``pydantic_function_tool``,
``.parse(response_format=Model)``), against a real edge and worker serving the default model.

Their schemas use ``$defs``/``$ref`` for nested models and enums; forced calls
(``tool_choice`` named or ``"required"``) embed them in the call grammar, which used to fail with
``Pointer '/$defs/Options' does not exist``. The SDK parses every answer back into the model.
"""

from __future__ import annotations

import enum

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Search the catalogue for red shoes, verbose please."}]


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Options(BaseModel):
    verbose: bool
    color: Color


class SearchCatalogue(BaseModel):
    """Nested (``options``), enum (``color``) and optional (``limit``). Recursive models are
    covered at the grammar level (tests/unit/worker/test_grammar_refs.py): forced to fill a
    recursive tree, a small model may nest it until the length limit."""

    query: str = Field(max_length=24)
    options: Options
    limit: int | None


class OrderStatus(BaseModel):
    order_id: str = Field(max_length=12)
    options: Options


TOOLS = [openai.pydantic_function_tool(SearchCatalogue), openai.pydantic_function_tool(OrderStatus)]


@pytest.fixture(scope="module")
def client(default_edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_sdk_tools_use_defs_and_refs() -> None:
    parameters = TOOLS[0]["function"]["parameters"]
    assert {"Options", "Color"} <= set(parameters["$defs"])
    assert parameters["properties"]["options"] == {"$ref": "#/$defs/Options"}


def test_named_tool_choice_with_a_nested_pydantic_tool_is_parsed_by_the_sdk(client) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "SearchCatalogue"}},
        max_tokens=300,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "SearchCatalogue"
    assert isinstance(call.function.parsed_arguments, SearchCatalogue)


def test_required_with_two_pydantic_tools_streams_a_parsable_call(client) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    model = {"SearchCatalogue": SearchCatalogue, "OrderStatus": OrderStatus}[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_with_pydantic_tools_answers(client) -> None:
    """With "auto" the tools (and their $defs) go to the prompt; any answer the model gives is valid."""
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0
    )
    message = reply.choices[0].message
    for call in message.tool_calls or ():
        assert call.function.name in ("SearchCatalogue", "OrderStatus")
    assert message.tool_calls or message.content is not None


def test_response_format_from_a_nested_pydantic_model_is_parsed_by_the_sdk(client) -> None:
    reply = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=SearchCatalogue, max_tokens=300, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, SearchCatalogue)
