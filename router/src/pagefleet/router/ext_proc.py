"""Envoy's ext_proc messages as the Gateway API Inference Extension's Endpoint Picker Protocol
uses them (kubernetes-sigs/gateway-api-inference-extension, docs/proposals/
004-endpoint-picker-protocol): reading what the proxy sends, and building what the picker
answers. Pure: protobuf messages in, protobuf messages out, no I/O.

The protocol, in short: the proxy sends the request's headers and body; the picker answers
with the chosen endpoints (`ip:port`, or an ordered `ip:port,ip:port` list the proxy may retry
down) in the `x-gateway-destination-endpoint` request header and, with the same value, in the
`envoy.lb` dynamic-metadata namespace under that key. The proxy may restrict the choice with a
subset hint (filter metadata `envoy.lb.subset_hint`, key
`x-gateway-destination-endpoint-subset`), and reports the endpoint that served the response in
`envoy.lb` / `x-gateway-destination-endpoint-served`. No endpoint: an ImmediateResponse 503.

Everything a peer sends is bounded here: header count and bytes, subset entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf import struct_pb2

from pagefleet.common.http_errors import error_body
from pagefleet.proto import envoy_core_pb2 as core
from pagefleet.proto import envoy_ext_proc_pb2 as pb
from pagefleet.proto import envoy_http_status_pb2 as http_status
from pagefleet.proto import envoy_processing_mode_pb2 as mode

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Envoy puts requested attributes (response_attributes: upstream.address) under its name.
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
UPSTREAM_ADDRESS = "upstream.address"

BUFFERED = mode.ProcessingMode.BUFFERED
FULL_DUPLEX = mode.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = mode.ProcessingMode.NONE
# Modes in which the proxy shows the whole body before it picks an upstream: routed on it.
BODY_FIRST = (BUFFERED, mode.ProcessingMode.BUFFERED_PARTIAL, FULL_DUPLEX)

MAX_HEADERS = 256  # per request or response: Envoy's own default limit is 100
MAX_HEADER_BYTES = 96 * 1024  # keys and values together: Envoy's default is 60 KiB
MAX_SUBSET = 4096  # endpoints in a subset hint
STREAMED_CHUNK = 64 * 1024  # body chunks sent back in full-duplex mode (Envoy's advice)
OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


class PeerError(ValueError):
    """What the proxy sent is beyond a bound or malformed: answered with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def read_headers(header_map: core.HeaderMap) -> dict[str, str]:
    """Lower-case names -> values (raw_value as Envoy sends it, else value; repeated names
    joined with commas, as HTTP reads them). PeerError 431 beyond the bounds."""
    entries = header_map.headers
    if len(entries) > MAX_HEADERS:
        raise PeerError(431, f"more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    size = 0
    for entry in entries:
        value = entry.raw_value.decode("utf-8", "replace") if entry.raw_value else entry.value
        size += len(entry.key) + len(value)
        if size > MAX_HEADER_BYTES:
            raise PeerError(431, f"headers larger than {MAX_HEADER_BYTES} bytes")
        key = entry.key.lower()
        headers[key] = f"{headers[key]},{value}" if key in headers else value
    return headers


def _strings(value: struct_pb2.Value) -> list[str]:
    """A metadata value as endpoints: a string (comma separated) or a list of strings."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    else:
        return []
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def subset_hint(request: pb.ProcessingRequest) -> set[str] | None:
    """The endpoints the proxy allows for this request; None when it sets no hint (any pod of
    the pool). PeerError 400 for an oversized hint."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    endpoints = _strings(namespace.fields[SUBSET_KEY])
    if len(endpoints) > MAX_SUBSET:
        raise PeerError(400, f"a subset hint of more than {MAX_SUBSET} endpoints")
    return set(endpoints)


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the response: the protocol's `envoy.lb` metadata entry, else
    the `upstream.address` attribute (a proxy configured to send it)."""
    namespace = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is not None and SERVED_KEY in namespace.fields:
        found = _strings(namespace.fields[SERVED_KEY])
        if found:
            return found[0]
    attributes = request.attributes.get(EXT_PROC_FILTER)
    if attributes is not None and UPSTREAM_ADDRESS in attributes.fields:
        found = _strings(attributes.fields[UPSTREAM_ADDRESS])
        if found:
            return found[0]
    return None


def _option(key: str, value: str) -> core.HeaderValueOption:
    # Overwrite: the default (append) would keep a value the client sent beside ours, and a
    # client could then steer the proxy with its own x-gateway-destination-endpoint.
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key.lower(), raw_value=value.encode()),
        append_action=OVERWRITE,
    )


@dataclass
class Destination:
    """What the picker tells the proxy about one request."""

    endpoints: list[str]  # in the order to try them; the first is the pick
    set_headers: dict[str, str]  # besides the destination header (auth, signature, length)
    remove_headers: list[str]

    @property
    def value(self) -> str:
        return ",".join(self.endpoints)

    def mutation(self) -> pb.HeaderMutation:
        headers = {DESTINATION_HEADER: self.value, **self.set_headers}
        return pb.HeaderMutation(
            set_headers=[_option(k, v) for k, v in headers.items()],
            remove_headers=self.remove_headers,
        )

    def metadata(self) -> struct_pb2.Struct:
        out = struct_pb2.Struct()
        out.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: self.value}})
        return out


def routed_headers(destination: Destination) -> pb.ProcessingResponse:
    """The answer to the request headers that routes the request (the headers-only and
    full-duplex paths): the destination header, the metadata, and a cleared route cache so
    routes that match on the header see it."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=destination.mutation(), clear_route_cache=True
            )
        ),
        dynamic_metadata=destination.metadata(),
    )


def routed_buffered_body(destination: Destination, body: bytes | None) -> pb.ProcessingResponse:
    """The answer to a buffered request body that routes the request (header mutations take
    effect on a buffered body's answer); `body` replaces it when not None."""
    common = pb.CommonResponse(header_mutation=destination.mutation(), clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=destination.metadata()
    )


def streamed_body(body: bytes, end_of_stream: bool, request: bool = True) -> list:
    """A body sent back in full-duplex mode, in chunks; the last carries `end_of_stream`."""
    chunks = [body[i : i + STREAMED_CHUNK] for i in range(0, len(body), STREAMED_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        streamed = pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream and last)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        body_response = pb.BodyResponse(response=common)
        if request:
            out.append(pb.ProcessingResponse(request_body=body_response))
        else:
            out.append(pb.ProcessingResponse(response_body=body_response))
    return out


def proceed(kind: str) -> pb.ProcessingResponse:
    """Continue unchanged: the answer to request_headers, request_body, response_headers,
    response_body, request_trailers or response_trailers."""
    if kind.endswith("_trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    if kind.endswith("_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    return pb.ProcessingResponse(**{kind: pb.BodyResponse()})


def immediate(
    status: int,
    message: str,
    type_: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> pb.ProcessingResponse:
    """An OpenAI-shaped JSON error the proxy answers the client with, instead of routing."""
    body = json.dumps(error_body(message, type_, status, param)).encode()
    all_headers = {"content-type": "application/json", **(headers or {})}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_option(k, v) for k, v in all_headers.items()]),
            body=body,
            details=f"pagefleet_epp_{status}",
        )
    )


def split_endpoints(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def header_map(headers: Iterable[tuple[str, str]]) -> core.HeaderMap:
    """Headers as Envoy sends them (lower-case keys, raw values): for tests and tools."""
    return core.HeaderMap(
        headers=[core.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in headers]
    )
