"""The committed stubs must be exactly what protos/generate.py produces from the .proto files."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_protos", REPO / "protos" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_up_to_date(tmp_path):
    generated = _generator().generate(tmp_path)
    assert {p.name for p in generated} == {"worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py"}
    stale = [p.name for p in generated if p.read_bytes() != (REPO / "sluice" / "v1" / p.name).read_bytes()]
    assert not stale, f"stubs differ from the .proto: {stale}; run `python protos/generate.py`"


def test_contract_has_the_full_event_vocabulary():
    from sluice.v1 import worker_pb2 as pb

    events = {f.name for f in pb.GenerateResponse.DESCRIPTOR.oneofs_by_name["event"].fields}
    assert events == {
        "started",
        "progress",
        "content",
        "reasoning",
        "tool_call",
        "refusal",
        "finished",
        "usage",
        "prompt_logprobs",
    }
    optional = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields if f.has_presence}
    assert {"temperature", "top_p", "seed", "max_tokens", "n", "logprobs", "prompt_logprobs"} <= optional
