"""`epd generate`: a gRPC client of the proxy's Inference service.

The API key comes from --api-key-file, EPD_API_KEY or --api-key (the last shows in the process
list); TLS is on with --tls (the system's roots) or --tls-ca (the CA that signed the proxy's
certificate)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from common.server import GRPC_OPTIONS
from proto import epd_pb2, epd_pb2_grpc


def build_request(args: argparse.Namespace) -> epd_pb2.GenerateRequest:
    media = [epd_pb2.MediaItem(image=Path(p).read_bytes()) for p in args.image]
    media += [epd_pb2.MediaItem(video_file=Path(p).read_bytes()) for p in args.video]
    media += [
        epd_pb2.MediaItem(audio=epd_pb2.AudioClip(data=Path(p).read_bytes())) for p in args.audio
    ]
    sampling = epd_pb2.SamplingParams(top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    request = epd_pb2.GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:12]}",
        model=args.model,
        media=media,
        sampling=sampling,
        return_prompt_token_ids=args.json,
    )
    if args.raw:
        request.text = args.prompt
    else:
        parts = [epd_pb2.ContentPart(media_index=i) for i in range(len(media))]
        parts.append(epd_pb2.ContentPart(text=args.prompt))
        request.chat.messages.append(epd_pb2.ChatMessage(role="user", content=parts))
    return request


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        return Path(args.api_key_file).read_text().split()[0]
    return os.environ.get("EPD_API_KEY") or args.api_key


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if not (args.tls or args.tls_ca):
        return grpc.insecure_channel(args.target, options=GRPC_OPTIONS)
    roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    options = list(GRPC_OPTIONS)
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(args.target, grpc.ssl_channel_credentials(roots), options=options)


def run_generate(args: argparse.Namespace) -> int:
    try:
        request = build_request(args)
    except OSError as e:
        print(f"epd generate: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    text, token_ids, last = [], [], None
    prompt_token_ids: list[int] = []
    try:
        key = api_key(args)
        channel = open_channel(args)
    except OSError as e:
        print(f"epd generate: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    metadata = [("authorization", f"Bearer {key}")] if key else None
    with channel:
        stub = epd_pb2_grpc.InferenceStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                if not args.json:
                    print(response.text, end="", flush=True)
                text.append(response.text)
                token_ids.extend(response.token_ids)
                prompt_token_ids.extend(response.prompt_token_ids)
                last = response
        except grpc.RpcError as e:
            if not args.json and text:
                print()
            print(f"epd generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        last = last or epd_pb2.GenerateResponse()
        out = {
            "request_id": request.request_id,
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_token_ids": prompt_token_ids,
            "finish_reason": epd_pb2.FinishReason.Name(last.finish_reason),
            "usage": MessageToDict(last.usage, preserving_proto_field_name=True),
            "timings": MessageToDict(last.timings, preserving_proto_field_name=True),
        }
        print(json.dumps(out))
    else:
        print()
    return 0
