"""The committed gRPC stubs are what proto/kv_transfer.proto generates, and import as installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pagefleet.proto.kv_transfer_pb2 as installed_pb2
import pagefleet.proto.kv_transfer_pb2_grpc as installed_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_regenerated_stubs_are_byte_identical_to_the_installed_ones(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for module in (installed_pb2, installed_grpc):
        installed = Path(module.__file__)
        fresh = tmp_path / installed.name
        assert fresh.read_bytes() == installed.read_bytes(), (
            f"{installed.name} is stale: run `python scripts/gen_proto.py`"
        )


def test_stubs_describe_the_service_the_transport_uses():
    service = installed_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    assert {m.name for m in service.methods} == {"Challenge", "Handshake", "ReadBlocks", "Release"}
    assert service.methods_by_name["ReadBlocks"].server_streaming
    assert installed_grpc.KVTransferStub.__module__ == "pagefleet.proto.kv_transfer_pb2_grpc"
