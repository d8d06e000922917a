"""The committed stubs match proto/epd.proto, and the API has the services the roles serve."""

from __future__ import annotations

from proto import codegen, epd_pb2


def test_stubs_are_fresh():
    stale = codegen.check()
    assert stale == [], "run `python -m proto.codegen` and commit:\n" + "\n".join(stale)


def test_services_and_methods():
    services = {
        name: {m.name for m in s.methods} for name, s in epd_pb2.DESCRIPTOR.services_by_name.items()
    }
    assert services == {
        "Inference": {"Generate", "Realtime", "Abort", "ListModels"},
        "Encoder": {"Encode", "EncodeStream", "GetLoad"},
        "LanguageModel": {"Generate", "Abort", "GetLoad"},
    }
    generate = epd_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    realtime = epd_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Realtime"]
    assert realtime.server_streaming and realtime.client_streaming


def test_sampling_presence_and_round_trip():
    params = epd_pb2.SamplingParams(temperature=0.0, stop=["\n\n"])
    assert params.HasField("temperature") and params.temperature == 0.0
    assert not params.HasField("top_p")
    request = epd_pb2.GenerateRequest(
        chat=epd_pb2.ChatPrompt(
            messages=[
                epd_pb2.ChatMessage(
                    role="user",
                    content=[epd_pb2.ContentPart(media_index=0), epd_pb2.ContentPart(text="hi")],
                )
            ]
        ),
        media=[epd_pb2.MediaItem(image=b"\x89PNG", uuid="img-1")],
        sampling=params,
    )
    decoded = epd_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.WhichOneof("prompt") == "chat"
    assert decoded.media[0].WhichOneof("payload") == "image"
