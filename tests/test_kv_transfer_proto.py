"""The committed gRPC stubs are what proto/*.proto generate, and import as installed: the KV
transfer service, and the Envoy ext_proc and gRPC health services `pagefleet epp` serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pagefleet.proto.envoy_ext_proc_pb2 as ext_proc_pb2
import pagefleet.proto.grpc_health_pb2 as health_pb2
import pagefleet.proto.kv_transfer_pb2 as installed_pb2
import pagefleet.proto.kv_transfer_pb2_grpc as installed_grpc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path(installed_pb2.__file__).parent


def test_regenerated_stubs_are_byte_identical_to_the_installed_ones(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert len(protos) == 6
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            installed = PROTO_DIR / f"{proto.stem}{suffix}"
            fresh = tmp_path / installed.name
            assert fresh.read_bytes() == installed.read_bytes(), (
                f"{installed.name} is stale: run `python scripts/gen_proto.py`"
            )


def test_stubs_describe_the_service_the_transport_uses():
    service = installed_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    assert {m.name for m in service.methods} == {"Challenge", "Handshake", "ReadBlocks", "Release"}
    assert service.methods_by_name["ReadBlocks"].server_streaming
    assert installed_grpc.KVTransferStub.__module__ == "pagefleet.proto.kv_transfer_pb2_grpc"


def test_ext_proc_and_health_keep_envoys_and_grpcs_wire_names():
    """Envoy calls /envoy.service.ext_proc.v3.ExternalProcessor/Process and probes call
    /grpc.health.v1.Health/Check: the packages and field numbers are the contract."""
    process = ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].methods[0]
    assert process.full_name == "envoy.service.ext_proc.v3.ExternalProcessor.Process"
    assert process.client_streaming and process.server_streaming
    fields = {f.name: f.number for f in ext_proc_pb2.ProcessingRequest.DESCRIPTOR.fields}
    assert fields["request_headers"] == 2 and fields["metadata_context"] == 8
    assert fields["protocol_config"] == 11
    check = health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name["Check"]
    assert check.full_name == "grpc.health.v1.Health.Check"
