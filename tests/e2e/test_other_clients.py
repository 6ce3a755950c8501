"""Other real clients against a real edge and worker: the official openai Node SDK and LangChain.

The Node SDK is installed from npm into tests/e2e/node/node_modules (pinned by its
package-lock.json) on first use; the test is skipped only when node/npm are missing or npm cannot
reach the registry. The Node script records what the SDK returned; the assertions are here.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
NODE_DIR = Path(__file__).parent / "node"
# npm's words for "the registry could not be reached".
_OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT", "ECONNRESET", "ENETUNREACH", "network")


def _installed_version() -> str | None:
    manifest = NODE_DIR / "node_modules" / "openai" / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


def _locked_version() -> str:
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    return str(lock["packages"]["node_modules/openai"]["version"])


@pytest.fixture(scope="module")
def node_sdk() -> Path:
    """tests/e2e/node with the pinned openai package installed (``npm ci`` when missing or stale)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node SDK test")
    # One install at a time: two test processes (pytest-xdist) that both find it missing would
    # otherwise run `npm ci` together, each deleting what the other installs and runs.
    with (NODE_DIR / ".npm-ci.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed_version() != _locked_version():
            done = subprocess.run(
                ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                cwd=NODE_DIR,
                capture_output=True,
                text=True,
                timeout=240,
            )
            if done.returncode != 0:
                if any(word in done.stderr for word in _OFFLINE):
                    pytest.skip(f"npm cannot reach the registry: {done.stderr.strip()[-300:]}")
                raise AssertionError(f"npm ci failed:\n{done.stderr}")
    return NODE_DIR


@pytest.fixture(scope="module")
def greedy(default_edge) -> dict[str, str]:
    """The Python SDK's greedy answers, which the other clients must reproduce."""
    client = openai.OpenAI(base_url=f"{default_edge.base_url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6)
    text = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5
    )
    return {"chat": chat.choices[0].message.content or "", "completion": text.choices[0].text}


def test_node_sdk(node_sdk, default_edge, greedy):
    done = subprocess.run(
        ["node", "conformance.mjs"],
        cwd=node_sdk,
        env={**os.environ, "SLUICE_BASE_URL": f"{default_edge.base_url}/v1", "SLUICE_MODEL": MODEL},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    chat = seen["chat"]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["content"] == greedy["chat"] and chat["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 6

    stream = seen["chat_stream"]
    assert stream["content"] == greedy["chat"] and stream["roles"] == 1 and stream["finishes"] == ["length"]
    assert stream["objects"] == ["chat.completion.chunk"]
    assert stream["usage"] == chat["usage"]

    helper = seen["stream_helper"]
    assert helper["deltas"] == helper["final_content"] == greedy["chat"]

    assert seen["completion"]["object"] == "text_completion"
    assert seen["completion"]["text"] == seen["completion_stream"]["text"] == greedy["completion"]

    errors = seen["errors"]
    assert errors["bad_temperature"] == {"class": "BadRequestError", "status": 400, "param": "temperature"}
    assert errors["unknown_model"] == {"class": "NotFoundError", "status": 404, "param": "model"}
    assert errors["suffix"] == {"class": "BadRequestError", "status": 400, "param": "suffix"}


def test_langchain_chat_openai(default_edge, greedy):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{default_edge.base_url}/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=6,
        max_retries=0,
        stream_usage=True,
    )
    message = llm.invoke(QUESTION[0]["content"])
    assert message.content == greedy["chat"]
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] == 6
    assert message.response_metadata["finish_reason"] == "length"

    pieces = list(llm.stream(QUESTION[0]["content"]))
    assert len(pieces) > 2
    whole = pieces[0]
    for piece in pieces[1:]:
        whole += piece
    assert whole.content == greedy["chat"]
    assert whole.usage_metadata is not None
    assert whole.usage_metadata["output_tokens"] == 6
    assert whole.usage_metadata["input_tokens"] == message.usage_metadata["input_tokens"]
    assert whole.usage_metadata["total_tokens"] == message.usage_metadata["total_tokens"]
