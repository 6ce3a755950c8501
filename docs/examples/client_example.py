"""Calling a Sluice worker from Python with sluice.client (see docs/grpc.md).

Run against a worker (``python -m worker`` listens on 127.0.0.1:50051 by default)::

    .venv/bin/python docs/examples/client_example.py 127.0.0.1:50051

It checks the worker's health, lists its model, streams one chat answer,
stops a second generation early (which cancels it on the worker), and shows
how a refused request reads. Exit status 0 when all of that worked.
"""

from __future__ import annotations

import asyncio
import sys

from sluice.client import ServingStatus, WorkerCallError, WorkerClient
from sluice.v1 import worker_pb2 as pb


def chat(text: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )


async def main(address: str) -> int:
    async with WorkerClient(address) as client:
        # 1. Health (grpc.health.v1) and the served model.
        status = await client.health(timeout=5)
        if status != ServingStatus.SERVING:
            print(f"worker {address} is {status}", file=sys.stderr)
            return 1
        listing = await client.list_models(timeout=5)
        model = listing.models[0]
        print(f"worker {listing.worker_id} serves {model.id} (context {model.context_length} tokens)")

        # 2. Stream one answer. `timeout` is the call's deadline: the worker drops
        #    the request when it passes. x-request-id names the request in its logs.
        metadata = [("x-request-id", "example-1")]
        async with client.generate(chat("Say hello.", 24), timeout=60, metadata=metadata) as stream:
            async for event in stream:
                kind = event.WhichOneof("event")
                if kind == "started":
                    print(f"[started: {event.started.prompt_tokens} prompt tokens]")
                elif kind == "content":
                    print(event.content.text, end="", flush=True)
                elif kind == "finished":
                    print(f"\n[finished: {pb.FinishReason.Name(event.finished.reason)}]")
                elif kind == "usage":
                    print(f"[usage: {event.usage.total_tokens} tokens]")

        # 3. Stop early: leaving the `async with` block (here by `break`) cancels
        #    the call, and the worker frees the sequence before its next step.
        deltas = 0
        async with client.generate(chat("Count to one hundred.", 200), timeout=60) as stream:
            async for event in stream:
                if event.WhichOneof("event") == "content":
                    deltas += 1
                    if deltas == 3:
                        break
        print(f"[stopped after {deltas} deltas; the call was cancelled]")

        # 4. Errors arrive as WorkerCallError, with the worker's structured details.
        try:
            async for _ in client.generate(chat("Hi", 0), timeout=10):
                pass
        except WorkerCallError as error:
            print(f"[refused: {error.code().name}, reason={error.reason}, param={error.param}]")
        else:
            print("expected max_tokens=0 to be refused", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051")))
