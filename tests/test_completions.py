"""POST /v1/completions through the whole cluster with the official `openai` client, on the
built-in model: a prompt as text or token ids, several prompts at once, echo, logprobs,
stop, streaming, structured outputs, and the 400s."""

from __future__ import annotations

import openai
import pytest

from common.served_model import builtin_model
from models import Tokenizer

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tests.cluster_helpers import Cluster

    c = Cluster(tmp_path_factory.mktemp("completions"), builtin_model(), encoders=1)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{c.proxy_http}/v1", api_key="-")
    c.stop()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(builtin_model())


def test_text_and_token_id_prompts_give_the_same_completion(client, tokenizer):
    prompt = CHAT.format("How many shapes are there?")
    by_text = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    by_ids = client.completions.create(
        model="tiny", prompt=tokenizer.encode(prompt), max_tokens=12, temperature=0
    )
    (a,), (b,) = by_text.choices, by_ids.choices
    assert a.text and a.text == b.text and a.finish_reason == b.finish_reason
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    assert by_text.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert by_text.usage.completion_tokens == len(tokenizer.encode(a.text)) + (
        a.finish_reason == "stop"  # the end token, not in the text
    )


def test_several_prompts_echo_and_the_default_max_tokens(client):
    prompts = [CHAT.format("What colour is the circle?"), CHAT.format("Which shape is red?")]
    reply = client.completions.create(model="tiny", prompt=prompts, temperature=0, echo=True)
    assert [c.index for c in sorted(reply.choices, key=lambda c: c.index)] == [0, 1]
    alone = [
        client.completions.create(model="tiny", prompt=p, temperature=0).choices[0].text
        for p in prompts
    ]
    for choice in reply.choices:
        prompt = prompts[choice.index]
        assert choice.text == prompt + alone[choice.index]  # echoed, then the same completion
    # 16 tokens unless it stops first (OpenAI's default for this endpoint).
    assert reply.usage.completion_tokens <= 32


def test_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(
        model="tiny", prompt=CHAT.format("What is red?"), max_tokens=6, temperature=0, logprobs=3
    )
    (choice,) = reply.choices
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n == reply.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens).startswith(choice.text)  # the end token's string may follow
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == logprob  # greedy: the sampled token is the most likely
        assert top.get(token, logprob) == logprob


def test_streaming_several_prompts_assembles_each_choice(client):
    prompts = [CHAT.format("How many shapes are there?"), CHAT.format("What is blue?")]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0)
    want = {c.index: c.text for c in whole.choices}
    got, finishes, usage = {0: "", 1: ""}, {}, None
    stream = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for event in stream:
        for c in event.choices:
            got[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = event.usage or usage
    assert got == want and set(finishes) == {0, 1}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_and_a_structured_output(client):
    prompt = CHAT.format("Tell me about the shapes")
    free = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert cut.choices[0].text == text[: text.index(stop)], (text, stop)
    assert cut.choices[0].finish_reason == "stop"
    shaped = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=1, seed=4,
        extra_body={"structured_outputs": {"regex": "(red|blue) (circle|square)"}},
    )  # fmt: skip
    assert shaped.choices[0].text in {f"{c} {s}" for c in ("red", "blue")
                                      for s in ("circle", "square")}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"prompt": "Hi", "echo": True, "logprobs": 1}, "prompt's log-probabilities"),
        ({"prompt": [10**6]}, "outside the vocabulary"),
        ({"prompt": []}, "prompt must be"),
        ({"prompt": [["a"]]}, "prompt must be"),
        ({"prompt": "Hi", "best_of": 2}, "best_of"),
        ({"prompt": "Hi", "suffix": "x"}, "suffix"),
        ({"prompt": ["Hi"] * 65}, "at most 64"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_completions_get_a_400(client, kwargs, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", **kwargs)
    assert says in str(e.value)
