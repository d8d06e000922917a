"""The LM engine on the CPU, held against the models' reference path (itself held against
transformers in test_models_*): batching, chunked prefill, the multimodal gather, realtime
decode-step embeddings, preemption, prefix caching, sampling, abort."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from lm_worker.attention import PagedAttention
from lm_worker.request import Request
from models import MMFeature, SamplingParams
from models.qwen2_vl import Qwen2VLFamily
from models.qwen2_vl.language_model import Qwen2LanguageModel
from models.testing import ContiguousKVAttention, ReferenceModel
from tests.lm_helpers import Collected, case, make_engine, png, run, three_cases


@pytest.fixture(scope="module")
def cases(tiny_ref):
    return three_cases(tiny_ref)


def test_mixed_batch_of_text_and_image_requests(tiny_checkpoint, cases):
    engine = make_engine(tiny_checkpoint)
    out = run(engine, *cases.values())
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected, c.request_id
        assert out[c.request_id].last.finish_reason == "length"


def test_two_images_in_one_request(tiny_checkpoint, cases):
    two = cases["two"]
    assert len(two.features) == 2
    assert run(make_engine(tiny_checkpoint), two)["two"].token_ids == two.expected


def test_chunked_prefill_cuts_through_an_image(tiny_checkpoint, cases):
    image = cases["image"]
    budget = 8
    f = image.features[0]
    # Chunks end at multiples of the budget; one of them falls inside the image's placeholders.
    assert any(
        f.offset < k < f.offset + f.length for k in range(budget, f.offset + f.length, budget)
    )
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=budget, max_num_seqs=4)
    out = run(engine, image, cases["text"])
    assert out["image"].token_ids == image.expected
    assert out["text"].token_ids == cases["text"].expected


def test_padded_decode_batches_match_unpadded(tiny_checkpoint, cases):
    # The CUDA-graph input path (padded to a captured size, full-width block tables, padded
    # request count in the metadata), run eagerly.
    engine = make_engine(tiny_checkpoint, pad_decodes=True, max_num_seqs=8)
    assert engine.runner.graph_sizes == [1, 2, 4, 8]
    out = run(engine, *cases.values())  # 3 decodes pad to 4
    for c in cases.values():
        assert out[c.request_id].token_ids == c.expected


def test_is_embed_mask_with_holes(tiny_checkpoint, tiny_ref):
    # A placeholder run of 10 tokens where positions 3 and 7 are ordinary tokens (not
    # embeddings): 8 embedding rows fill the other 8.
    tokenizer = tiny_ref.tokenizer
    ids = tokenizer.encode("Some text before the media and after it too, padded out.")
    offset, length = 4, 10
    is_embed = np.ones(length, dtype=bool)
    is_embed[[3, 7]] = False
    torch.manual_seed(0)
    rows = torch.randn(int(is_embed.sum()), tiny_ref.lm.config.hidden_size) * 0.5
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[offset : offset + length] = torch.from_numpy(is_embed)
    expected = reference_greedy(tiny_ref, ids, rows, mask, max_tokens=16)

    feature = MMFeature("holes", offset, length, is_embed, modality="audio")
    request = Request(
        "holes", ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), [feature]
    )
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=8, max_num_seqs=4)  # chunks cut it
    out = run(engine, (request, {"holes": rows}))
    assert out["holes"].token_ids == expected


@torch.inference_mode()
def reference_greedy(
    tiny_ref: ReferenceModel, ids, rows, mask, max_tokens, audio=None
) -> list[int]:
    """Greedy tokens of the reference LM on text positions, with `rows` merged at `mask`, and
    (realtime) `audio[i]` added to the embedding of the i-th generated token fed back."""
    lm = tiny_ref.lm
    attention = ContiguousKVAttention(lm.config.num_layers)
    model = Qwen2LanguageModel(lm.config, attention)
    model.load_state_dict(lm.state_dict())
    ids_t = torch.tensor(ids)
    embeds = model.embed_input_ids(ids_t, [rows] if rows is not None else None, mask)
    positions = torch.arange(len(ids))
    meta = attention.metadata([0], [len(ids)])
    logits = model.compute_logits(model(None, positions, embeds, meta)[-1:])
    out = []
    for step in range(max_tokens):
        token = int(logits.argmax())
        out.append(token)
        x = model.embed_input_ids(torch.tensor([token]))
        if audio is not None:
            x = x + audio[step]
        position = torch.tensor([len(ids) + step])
        logits = model.compute_logits(model(None, position, x, attention.metadata([0], [1])))
    return out


class RealtimeTestLM(Qwen2LanguageModel):
    """A synthetic realtime model: on every decode step the session's next audio embedding is
    added to the token embedding (as Voxtral Realtime does)."""

    supports_realtime = True

    def embed_input_ids(self, input_ids, mm_embeds=None, is_mm_embed=None):
        embeds = self.embed_tokens(input_ids)
        if mm_embeds:
            embeds = embeds.clone()
            embeds[is_mm_embed] += torch.cat(mm_embeds).to(embeds.dtype)
        return embeds


class RealtimeTestFamily(Qwen2VLFamily):
    """The tiny checkpoint's family with the synthetic realtime LM."""

    def load_language_model(self, attn_backend, dtype, device):
        return RealtimeTestLM.from_checkpoint(
            self.path, self.arch.text, attn_backend, dtype, device
        )


def test_realtime_model_gathers_embeddings_on_decode_steps(tiny_checkpoint, tiny_ref, cases):
    ids = tiny_ref.tokenizer.encode("Transcribe the audio that follows:")
    steps = 12
    torch.manual_seed(1)
    audio = torch.randn(steps, tiny_ref.lm.config.hidden_size) * 0.5
    expected = reference_greedy(tiny_ref, ids, None, None, steps, audio=audio)

    engine = make_engine(tiny_checkpoint, RealtimeTestFamily(tiny_checkpoint))
    assert engine.runner.is_realtime
    # The first generated token sits at index len(ids); from there on each step adds a row.
    feature = MMFeature("session-1", len(ids), steps, modality="audio")
    realtime = Request(
        "rt",
        ids,
        SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True),
        [feature],
        realtime_session="session-1",
    )
    sinks = {"rt": Collected(), "text": Collected()}
    engine.add_request(realtime, sinks["rt"])
    engine.add_request(cases["text"].request(), sinks["text"])
    engine.append_realtime("session-1", audio[:5])
    engine.run_to_completion()
    # The text request finished; the realtime one waits for audio it does not have yet.
    assert sinks["text"].token_ids == cases["text"].expected
    assert sinks["rt"].outputs and sinks["rt"].outputs[-1].finish_reason is None
    assert len(sinks["rt"].token_ids) == 6  # from the prompt, then one per row

    engine.append_realtime("session-1", audio[5:], closed=True)
    engine.run_to_completion()
    assert sinks["rt"].token_ids == expected
    assert sinks["rt"].last.finish_reason == "length"


def test_dummy_run_reads_dummy_inputs_embeds(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    runner = engine.runner
    torch.manual_seed(2)
    embeds = runner.buffers.inputs_embeds
    embeds[:4] = torch.randn(4, embeds.shape[1])
    state = runner.model_state
    assert state.dummy_inputs_embeds(4).data_ptr() == embeds.data_ptr()
    first = runner.dummy_run(4).clone()
    embeds[:4] *= 2
    second = runner.dummy_run(4)
    assert not torch.allclose(first, second)  # it reads the buffer, nothing else
    # And nothing about it touched a real sequence's KV: it wrote the null block only.
    assert torch.count_nonzero(runner.attention.kv_cache[:, :, 1:]) == 0


def test_preemption_and_resume_give_identical_tokens(tiny_checkpoint, tiny_ref):
    cases = [
        case(tiny_ref, f"p{i}", f"Tell me story number {i} in a few words", max_tokens=40)
        for i in range(4)
    ]
    # 16 usable blocks of 8 tokens: the four requests cannot all hold their ~100 tokens.
    per_block = PagedAttention.bytes_per_block(
        2, 8, tiny_ref.lm.config.num_kv_heads, tiny_ref.lm.config.head_dim, torch.float32
    )
    engine = make_engine(tiny_checkpoint, block_size=8, kv_cache_bytes=17 * per_block)
    out = run(engine, *cases)
    assert engine.scheduler.num_preemptions > 0
    for c in cases:
        assert out[c.request_id].token_ids == c.expected, c.request_id


def test_prefix_cache_hits_give_identical_tokens(tiny_checkpoint, tiny_ref, cases):
    engine = make_engine(tiny_checkpoint, block_size=8)
    text = cases["text"]
    first = run(engine, text)["text"]
    again = run(engine, text)["text"]
    assert first.last.num_cached_tokens == 0
    assert again.last.num_cached_tokens >= len(text.token_ids) // 8 * 8 - 8
    assert again.token_ids == first.token_ids == text.expected


def test_same_text_different_images_never_share_blocks(tiny_checkpoint, tiny_ref):
    engine = make_engine(tiny_checkpoint, block_size=4)
    a = case(tiny_ref, "a", "Describe the image", [png(56, 84)])
    b = case(tiny_ref, "b", "Describe the image", [png(56, 84, (0, 0, 255))])
    assert a.token_ids == b.token_ids  # same text, same placeholder run
    run(engine, a)
    out = run(engine, b)["b"]
    image_offset = b.features[0].offset
    # Only whole blocks before the image can be shared.
    assert out.last.num_cached_tokens <= image_offset // 4 * 4
    assert out.token_ids == b.expected


def test_sampling_with_a_seed_is_reproducible_whatever_the_batch(tiny_checkpoint, cases):
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1234, "max_tokens": 20}
    alone = run(make_engine(tiny_checkpoint), (cases["text"].request(**params), {}))
    crowd = run(
        make_engine(tiny_checkpoint),
        (cases["text"].request(**params), {}),
        cases["image"],
        cases["two"],
    )
    assert alone["text"].token_ids == crowd["text"].token_ids
    other = run(make_engine(tiny_checkpoint), (cases["text"].request(**{**params, "seed": 99}), {}))
    assert other["text"].token_ids != alone["text"].token_ids


def test_a_resumed_request_goes_on_as_if_in_one_piece(tiny_checkpoint, tiny_ref, cases):
    # What the proxy sends after a worker died mid-stream: the prompt plus the k tokens the
    # client has, and how much of their text it has. The new engine must continue the seeded
    # draws from token k, and a stop string that began before the cut must still stop it.
    text = cases["text"]
    params = {"temperature": 0.9, "top_k": 50, "seed": 77, "max_tokens": 24}
    whole = run(make_engine(tiny_checkpoint), (text.request(**params), {}))["text"]
    decode = tiny_ref.tokenizer.decode
    full = whole.text
    # A 4-character stop string spanning the text of the first k tokens and what follows.
    found = None
    for k in range(6, 16):
        end = len(decode(whole.token_ids[:k], skip_special_tokens=True))
        for j in range(end - 3, end):
            if j > 0 and full.find(full[j : j + 4]) == j and len(full) >= j + 4:
                found = k, full[j : j + 4], j
                break
        if found:
            break
    assert found, full
    k, stop, at = found
    params["stop"] = (stop,)
    first = run(make_engine(tiny_checkpoint), (text.request(**params), {}))["text"]
    assert first.text == full[:at] and first.last.finish_reason == "stop"
    seen = first.outputs[:k]  # what the client had when the first worker died
    seen_tokens = [t for o in seen for t in o.token_ids]
    seen_text = "".join(o.text for o in seen)
    assert len(seen_text) <= at  # the stop string's start was held back

    resumed = text.request(**{**params, "max_tokens": params["max_tokens"] - k})
    resumed.prompt_token_ids += seen_tokens
    resumed.resumed_output_tokens = k
    resumed.resumed_text_chars = len(seen_text)
    rest = run(make_engine(tiny_checkpoint), (resumed, {}))["text"]
    assert seen_tokens + rest.token_ids == first.token_ids
    assert seen_text + rest.text == first.text
    assert rest.last.finish_reason == "stop"


def test_stop_tokens_stop_strings_and_logprobs(tiny_checkpoint, tiny_ref, cases):
    text = cases["text"]
    expected = text.expected
    # A stop token id: generation ends on it (it is the last token).
    stop_at = expected[5]
    first = expected.index(stop_at)
    out = run(make_engine(tiny_checkpoint), (text.request(stop_token_ids=(stop_at,)), {}))["text"]
    assert out.token_ids == expected[: first + 1] and out.last.finish_reason == "stop"

    # A stop string: the text ends right before it, and the string itself is not returned.
    full = tiny_ref.tokenizer.decode(expected, skip_special_tokens=True)
    stop = full[10:14]
    out = run(make_engine(tiny_checkpoint), (text.request(stop=(stop,)), {}))["text"]
    assert out.last.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]

    # Log-probabilities of the sampled token and the top 3.
    out = run(make_engine(tiny_checkpoint), (text.request(logprobs=3, max_tokens=4), {}))["text"]
    entries = [lp for o in out.outputs for lp in o.logprobs]
    assert len(entries) == 4
    for token, entry in zip(out.token_ids, entries, strict=True):
        assert entry.top[0][0] == token  # greedy: the most likely one
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.logprob <= 0


def test_abort_mid_stream(tiny_checkpoint, cases):
    engine = make_engine(tiny_checkpoint)
    engine.start()
    try:
        first_token = threading.Event()
        done = threading.Event()
        collected = Collected()

        def sink(out):
            collected(out)
            first_token.set()
            if out.finish_reason is not None:
                done.set()

        long = cases["text"].request(max_tokens=10_000)
        engine.add_request(long, sink)
        assert first_token.wait(30)
        engine.abort("text")
        assert done.wait(30)
        assert collected.last.finish_reason == "abort"
        assert 0 < len(collected.token_ids) < 10_000
        # The aborted request holds nothing anymore.
        assert not engine.scheduler.has_work() or engine.scheduler.find("text") is None
    finally:
        engine.stop()
    assert engine.scheduler.blocks.num_used == 0


def test_the_cpu_engine_never_imports_the_triton_kernel(tiny_checkpoint):
    """A CPU machine need not have Triton: the kernel's module is imported only for a cache on
    a GPU. (Triton itself may be loaded here anyway: where it is installed, as with the test
    extra, torch imports it when building modules.)"""
    import sys

    engine = make_engine(tiny_checkpoint)
    assert engine.runner.attention.decode_kernel is None
    assert "lm_worker.triton_decode" not in sys.modules


def test_a_request_records_its_prefill_chunks_and_its_prefill_time(tiny_checkpoint, cases):
    """Each step that computes prompt tokens is a `prefill_chunk` stage (common/tracing.py),
    and `prefill_seconds` runs from the first such step's start: a prompt prefilled in one
    step used to report 0 (its first step and first token were stamped at the same moment)."""
    engine = make_engine(tiny_checkpoint, max_num_batched_tokens=16)
    whole, chunked = cases["text"].request(), cases["image"].request()
    chunked.request_id = "chunked"
    out = run(engine, (whole, {}), (chunked, cases["image"].embeddings))
    for request in (whole, chunked):
        chunks = [s for s in request.stages if s.name == "prefill_chunk"]
        computed = request.num_prompt_tokens - request.num_cached_tokens  # a prefix-cache hit
        assert sum(s.attributes["tokens"] for s in chunks) == computed
        assert all(s.start < s.end for s in chunks)
        timings = out[request.request_id].last.timings
        assert timings["prefill_seconds"] >= chunks[-1].seconds - 1e-6 > 0
    assert len([s for s in chunked.stages if s.name == "prefill_chunk"]) > 1
    assert chunked.num_cached_tokens > 0  # the chat template's opening, computed by `whole`
    alone = cases["text"].request()  # prefilled in one step
    out = run(make_engine(tiny_checkpoint), (alone, {}))
    (chunk,) = [s for s in alone.stages if s.name == "prefill_chunk"]
    assert out["text"].last.timings["prefill_seconds"] >= chunk.seconds - 1e-6 > 0
