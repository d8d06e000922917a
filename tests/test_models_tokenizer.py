"""Tokenizer, chat template and placeholders against transformers' tokenizer on the same files."""

from __future__ import annotations

import json
import random
import shutil

import jinja2
import pytest

from models import IncrementalDetokenizer, Tokenizer, expand_placeholders
from tests.model_helpers import build_tiny

TEXTS = [
    "Describe the image.",
    "  leading spaces, trailing\t\n\nnewlines  ",
    "<|im_start|>user\nHi<|im_end|>\n<|vision_start|><|image_pad|><|vision_end|>",
    "Numbers 1234567 and prices $3.50; e-mail@example.com",
    "naïve café 東京タワー 🙂🚀 \u00e9 (NFC: e\u0301)",
    "",
]

MESSAGES = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}]},
    ],
    [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare with"},
                {"type": "image", "image": "file://b.png"},
                {"type": "video"},
            ],
        },
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tok"), "qwen2_vl")


@pytest.fixture(scope="module")
def ours(checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def theirs(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_reference(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_ids_match_config(ours, checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert ours.required_id("<|image_pad|>") == config["image_token_id"]
    assert ours.required_id("<|video_pad|>") == config["video_token_id"]
    assert ours.required_id("<|vision_start|>") == config["vision_start_token_id"]
    assert ours.required_id("<|vision_end|>") == config["vision_end_token_id"]
    assert ours.eos_token_id == config["text_config"]["eos_token_id"]
    assert ours.vocab_size == config["text_config"]["vocab_size"]


@pytest.mark.parametrize("messages", MESSAGES, ids=range(len(MESSAGES)))
@pytest.mark.parametrize("extra", [{}, {"add_vision_id": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_reference(ours, theirs, messages, extra, add_generation_prompt):
    want = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    assert ours.apply_chat_template(messages, add_generation_prompt, **extra) == want


HELPER_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{{ bos_token if bos_token else '' }}{{ m['role'] | upper }}: "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] | tojson }}{% endif %}\n"
    "{% endfor %}"
    "{% if tools %}TOOLS {{ tools | tojson(indent=1) }}{% endif %}"
    "{{ eos_token }}"
)


@pytest.mark.parametrize("where", ["tokenizer_config", "chat_template.jinja", "chat_template.json"])
def test_template_helpers_and_locations(checkpoint, tmp_path, where):
    from transformers import AutoTokenizer

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    if where == "tokenizer_config":
        config["chat_template"] = HELPER_TEMPLATE
    else:
        del config["chat_template"]
        if where == "chat_template.jinja":
            (copy / where).write_text(HELPER_TEMPLATE)
        else:
            (copy / where).write_text(json.dumps({"chat_template": HELPER_TEMPLATE}))
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_dir(copy), AutoTokenizer.from_pretrained(copy)
    messages = [
        {"role": "user", "content": 'say "<b>ünï</b>"'},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"name": "f", "description": "é"}]
    # (transformers' tokenizer does not read chat_template.json, its processor does.)
    assert ours.chat_template == HELPER_TEMPLATE
    want = theirs.apply_chat_template(
        messages, tokenize=False, tools=tools, chat_template=HELPER_TEMPLATE
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=False, tools=tools) == want
    with pytest.raises(Exception, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sandbox_refuses_internals(checkpoint):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    evil = Tokenizer(tok, "{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError, match="is unsafe"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> str:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return "".join(deltas) + detok.flush()


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_detokenizer(ours, chunk):
    # The tiny BPE never saw CJK or emoji, so they arrive as single-byte tokens: the
    # detokenizer must hold partial characters back.
    text = "Hello 東京タワー 🙂🚀 naïve <|im_end|> done"
    ids = ours.encode(text)
    assert len(ids) > len(text) / 2
    detok = ours.detokenizer(skip_special_tokens=False)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == ours.decode(ids)
    assert stream(ours.detokenizer(), ids, chunk) == ours.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_random_ids(ours):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            got = stream(ours.detokenizer(skip), ids, rng.randint(1, 4))
            assert got == ours.decode(ids, skip)


def test_expand_placeholders():
    IMG, VID = 7, 8
    ids, spans = expand_placeholders([1, 2, IMG, 3, VID, IMG], (IMG, VID), [3, 2, 1])
    assert ids == [1, 2, IMG, IMG, IMG, 3, VID, VID, IMG]
    assert spans == [(2, 3), (6, 2), (8, 1)]
    assert expand_placeholders([1, 2], (IMG,), []) == ([1, 2], [])
    with pytest.raises(ValueError, match="2 media placeholders but 1 items"):
        expand_placeholders([IMG, IMG], (IMG,), [4])
    with pytest.raises(ValueError, match="placeholder tokens"):
        expand_placeholders([IMG], (IMG,), [0])
