"""gateway/tokenizer/: prompt token ids as the backend computes them, or None.

Everything here runs without transformers or vLLM: the tokenizer is trained in the test, the
way scripts/build_tiny_model.py trains the tiny model's (its constants are imported; its
function needs transformers to save). The comparison with vLLM itself is in
tests/e2e/test_tokenizer.py; here the rendering rules are checked against hand-written
expectations, the simulator's tokenizer against the simulator's own functions, and
``Tokenizers``' thread pool and bound with counters.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from gateway.tokenizer import (
    HfTokenizer,
    PathKind,
    SimTokenizer,
    Tokenizers,
    _template,
    load_tokenizer,
    prompt_chars,
)
from scripts.build_tiny_model import (
    BOS,
    CHAT_TEMPLATE,
    CORPUS,
    EOS,
    MODEL,
    PAD,
    VOCAB_SIZE,
    train_tokenizer,
)
from tests.waiting import wait_for
from tools.sim.protocol import ApiError, parse_generate


def build_tiny_tokenizer(
    out: Path,
    *,
    template: str | None = CHAT_TEMPLATE,
    config_extra: Mapping[str, Any] | None = None,
    bos_post_processor: bool = False,
) -> Path:
    """A model directory with the tiny model's tokenizer (scripts/build_tiny_model.py
    `build_tokenizer`, without transformers): byte-level BPE with a 512-token vocabulary
    trained on its corpus, tokenizer_config.json as transformers 5 saves it, the chat template
    in chat_template.jinja, and a config.json so transformers can load the directory too.

    ``bos_post_processor`` gives it a TemplateProcessing post-processor that adds BOS, as
    Llama's has, instead of the byte-level one.
    """
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
        )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": MODEL["max_position_embeddings"],
        "pad_token": PAD,
        "tokenizer_class": "TokenizersBackend",
        **(config_extra or {}),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if template is not None:
        (out / "chat_template.jinja").write_text(template)
    model = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **MODEL}
    model |= {"vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(model))
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> HfTokenizer:
    return HfTokenizer.from_path(tiny_dir)


def model_dir(tmp_path: Path, template: str | None, **options: Any) -> HfTokenizer:
    return HfTokenizer.from_path(build_tiny_tokenizer(tmp_path / "m", template=template, **options))


SYSTEM_USER = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, world!"},
]
MULTI_TURN = [
    *SYSTEM_USER,
    {"role": "assistant", "content": "Hi! How are you?"},
    {"role": "user", "content": "Fine, thank you."},
]


def text_ids(tok: HfTokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---- chat, rendered as transformers renders for vLLM ------------------------------------


def test_tiny_template_renders_with_trim_blocks_and_special_tokens(tiny: HfTokenizer) -> None:
    expected = (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHello, world!</s>\n"
        "<|assistant|>\nHi! How are you?</s>\n<|user|>\nFine, thank you.</s>\n<|assistant|>\n"
    )
    assert tiny.prompt_tokens("chat", {"messages": MULTI_TURN}) == text_ids(tiny, expected)
    # <s> and </s> are single special tokens, not BPE pieces; the chat adds no BOS of its own.
    ids = tiny.prompt_tokens("chat", {"messages": SYSTEM_USER})
    assert ids is not None
    assert ids[0] == 1
    assert ids.count(1) == 1
    assert ids.count(2) == 2


def test_generation_prompt_and_continue_final_message(tiny: HfTokenizer) -> None:
    no_prompt = tiny.prompt_tokens("chat", {"messages": MULTI_TURN, "add_generation_prompt": False})
    assert no_prompt == text_ids(
        tiny,
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHello, world!</s>\n"
        "<|assistant|>\nHi! How are you?</s>\n<|user|>\nFine, thank you.</s>\n",
    )
    partial = [*MULTI_TURN, {"role": "assistant", "content": "The quick brown"}]
    continued = tiny.prompt_tokens(
        "chat",
        {"messages": partial, "add_generation_prompt": False, "continue_final_message": True},
    )
    # The final message is left open: no </s> after it, and no generation prompt.
    assert continued == text_ids(
        tiny,
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHello, world!</s>\n"
        "<|assistant|>\nHi! How are you?</s>\n<|user|>\nFine, thank you.</s>\n"
        "<|assistant|>\nThe quick brown",
    )
    both = {"messages": partial, "continue_final_message": True}  # add_generation_prompt: true
    assert tiny.prompt_tokens("chat", both) is None


def test_text_parts_are_joined_for_a_string_template(tiny: HfTokenizer) -> None:
    parts = [
        {"type": "text", "text": "The gateway"},
        {"type": "text", "text": "routes", "cache_control": {"type": "ephemeral"}},
        "plain",
    ]
    as_parts = tiny.prompt_tokens("chat", {"messages": [{"role": "user", "content": parts}]})
    joined = tiny.prompt_tokens(
        "chat", {"messages": [{"role": "user", "content": "The gateway\nroutes\nplain"}]}
    )
    assert as_parts == joined


PARTS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for part in message['content'] %}[{{ part['type'] }}:{{ part['text'] }}]{% endfor %}"
    "{% if loop.last %}{% break %}{% endif %}\n{% endfor %}"
)


def test_text_parts_are_kept_for_a_template_that_loops_over_content(tmp_path: Path) -> None:
    tok = model_dir(tmp_path, PARTS_TEMPLATE)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}]}
    assert tok.prompt_tokens("chat", body) == text_ids(tok, "<|user|>[text:a][text:b]")
    # A string content is one text part.
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert tok.prompt_tokens("chat", plain) == text_ids(tok, "<|user|>[text:hi]")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (CHAT_TEMPLATE, "string"),
        (PARTS_TEMPLATE, "openai"),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set conv = messages[1:] %}{% for m in conv %}"
            "{% for p in m['content'] | list %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set content = m.content %}"
            "{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{{ m.content | upper }}{% endfor %}", "string"),
    ],
)
def test_content_format_detection(source: str, expected: str) -> None:
    """vLLM's "auto" content format: parts only for templates that loop over content."""
    assert _template(source).content_format == expected


def test_chat_template_kwargs_as_vllm_merges_them(tiny: HfTokenizer) -> None:
    base = tiny.prompt_tokens("chat", {"messages": SYSTEM_USER})
    # Variables the template does not read are dropped; "auto" and None mean "unset".
    for kwargs in ({"enable_thinking": False, "whatever": [1]}, {"bos_token": "auto"}):
        assert (
            tiny.prompt_tokens("chat", {"messages": SYSTEM_USER, "chat_template_kwargs": kwargs})
            == base
        )
    # A variable the template reads overrides the special token of the same name, and the
    # top-level add_generation_prompt overrides the kwarg.
    overridden = tiny.prompt_tokens(
        "chat",
        {
            "messages": SYSTEM_USER,
            "chat_template_kwargs": {"bos_token": "BOS:", "add_generation_prompt": False},
        },
    )
    assert overridden == text_ids(
        tiny, "BOS:<|system|>\nBe brief.</s>\n<|user|>\nHello, world!</s>\n<|assistant|>\n"
    )
    # Names that clash with the renderer's own arguments make vLLM fail: None.
    clashing: list[dict[str, Any]] = [{"messages": []}, {"chat_template": "x"}, {"conversation": 1}]
    for kwargs in clashing:
        assert (
            tiny.prompt_tokens("chat", {"messages": SYSTEM_USER, "chat_template_kwargs": kwargs})
            is None
        )


def test_tools_and_documents(tmp_path: Path, tiny: HfTokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = tiny.prompt_tokens("chat", {"messages": SYSTEM_USER})
    # The tiny template reads neither: they change nothing.
    assert tiny.prompt_tokens("chat", {"messages": SYSTEM_USER, "tools": tools}) == base
    docs = [{"title": "t", "text": "x"}]
    assert tiny.prompt_tokens("chat", {"messages": SYSTEM_USER, "documents": docs}) == base
    # A template that reads tools sees ChatCompletionToolsParam.model_dump(): unset fields
    # as null, unknown keys gone.
    tok = model_dir(
        tmp_path, "{{ tools | tojson }}{% for d in documents %}|{{ d.title }}{% endfor %}"
    )
    body = {"messages": SYSTEM_USER, "tools": [{**tools[0], "x": 1}], "documents": docs}
    expected = (
        '[{"type": "function", "function": {"name": "f", "description": null, '
        '"parameters": {"type": "object"}}}]|t'
    )
    assert tok.prompt_tokens("chat", body) == text_ids(tok, expected)
    assert tok.prompt_tokens("chat", {**body, "tools": [{"type": "custom"}]}) is None
    assert tok.prompt_tokens("chat", {**body, "documents": [{"title": 1}]}) is None


def test_developer_role_becomes_system_for_templates_without_it(tiny: HfTokenizer) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "D"},
        ]
    }
    expected = "<s><|system|>\nS\n\nD</s>\n<|user|>\nu</s>\n<|assistant|>\n"
    assert tiny.prompt_tokens("chat", body) == text_ids(tiny, expected)


def test_named_templates_in_tokenizer_config(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": "D{% for m in messages %}:{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    tok = model_dir(tmp_path, None, config_extra={"chat_template": named})
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    assert tok.prompt_tokens("chat", msgs) == text_ids(tok, "D:hi")
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.prompt_tokens("chat", {**msgs, "tools": tools}) == text_ids(tok, "T1")


def test_reused_prompt_token_ids_of_a_disaggregated_decode(tiny: HfTokenizer) -> None:
    body = {"messages": SYSTEM_USER, "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}
    assert tiny.prompt_tokens("chat", body) == [5, 6, 7]
    assert tiny.prompt_tokens("chat", {**body, "echo": True}) == tiny.prompt_tokens(
        "chat", {"messages": SYSTEM_USER}
    )
    bad = {"messages": SYSTEM_USER, "kv_transfer_params": {"prompt_token_ids": [-1]}}
    assert tiny.prompt_tokens("chat", bad) is None


def test_tool_calls_reach_the_template_as_vllm_passes_them(tmp_path: Path) -> None:
    tok = model_dir(
        tmp_path,
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c | tojson }};{% endfor %}{% endfor %}",
    )
    call = {"type": "function", "function": {"arguments": '{"b": 1}', "name": "f"}, "id": "c1"}
    empty = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call, empty]},
        ]
    }
    expected = (
        '{"id": "c1", "function": {"arguments": {"b": 1}, "name": "f"}, "type": "function"};'
        '{"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"};'
    )
    assert tok.prompt_tokens("chat", body) == text_ids(tok, expected)


def test_template_errors_give_none(tmp_path: Path) -> None:
    tok = model_dir(
        tmp_path,
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system first') }}{% endif %}{{ m.content }}{% endfor %}",
    )
    ok = {"messages": SYSTEM_USER}
    assert tok.prompt_tokens("chat", ok) is not None
    late = {"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]}
    assert tok.prompt_tokens("chat", late) is None


# ---- completions -------------------------------------------------------------------------


def test_completions_prompts(tiny: HfTokenizer, tmp_path: Path) -> None:
    text = tiny.encode("Hello, world!", add_special_tokens=True)
    assert tiny.prompt_tokens("completions", {"prompt": "Hello, world!"}) == text
    assert tiny.prompt_tokens("completions", {"prompt": ["Hello, world!"]}) == text
    assert tiny.prompt_tokens("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tiny.prompt_tokens("completions", {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
    # The tiny model's byte-level post-processor adds nothing; Llama's adds BOS, to
    # completions (add_special_tokens defaults to true there) and not to chats.
    llama = model_dir(tmp_path, CHAT_TEMPLATE, bos_post_processor=True)
    assert llama.prompt_tokens("completions", {"prompt": "Hello"}) == [1, *text_ids(llama, "Hello")]
    assert llama.prompt_tokens(
        "completions", {"prompt": "Hello", "add_special_tokens": False}
    ) == text_ids(llama, "Hello")
    chat = llama.prompt_tokens("chat", {"messages": SYSTEM_USER})
    assert chat is not None
    assert chat.count(1) == 1  # the template's <s> only
    with_special = llama.prompt_tokens(
        "chat", {"messages": SYSTEM_USER, "add_special_tokens": True}
    )
    assert with_special == [1, *chat]


BAD_COMPLETIONS: list[Any] = [
    {},
    {"prompt": None},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": ["a", "b"]},
    {"prompt": [[1], [2]]},
    {"prompt": [1, "a"]},
    {"prompt": [True, 2]},
    {"prompt": [-1, 2]},
    {"prompt": [1.5]},
    {"prompt": {"text": "a"}},
    {"prompt": "a", "suffix": "b"},
    {"prompt": "a", "prompt_embeds": "AAAA"},
    {"prompt": "a", "truncate_prompt_tokens": 10},
    {"prompt": "a", "add_special_tokens": "yes"},
]
BAD_CHATS: list[Any] = [
    {},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [None]},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": 1, "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "uuid": "u"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    {"messages": [{"role": "user", "content": [{"type": "mystery"}]}]},
    {"messages": [{"role": "user", "content": [7]}]},
    {"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"type": "custom"}]}]},
    {"messages": [{"role": "assistant", "content": "a", "tool_calls": "x"}]},
    {"messages": [{"role": "assistant", "content": "a", "reasoning": 3}]},
    {"messages": [{"role": "developer", "content": "d", "tools": [{}]}]},
    {"messages": SYSTEM_USER, "chat_template": "{{ 'mine' }}"},
    {"messages": SYSTEM_USER, "chat_template_kwargs": "x"},
    {"messages": SYSTEM_USER, "add_generation_prompt": "true"},
    {"messages": SYSTEM_USER, "continue_final_message": 1},
    {"messages": SYSTEM_USER, "reasoning_effort": "extreme"},
    {"messages": SYSTEM_USER, "truncate_prompt_tokens": 5},
    {"messages": SYSTEM_USER, "tools": {"a": 1}},
    {"messages": SYSTEM_USER, "tools": []},
    {"messages": SYSTEM_USER, "documents": "d"},
]


@pytest.mark.parametrize("doc", BAD_COMPLETIONS)
def test_bad_or_unsupported_completions_give_none(tiny: HfTokenizer, doc: Any) -> None:
    assert tiny.prompt_tokens("completions", doc) is None


@pytest.mark.parametrize("doc", BAD_CHATS)
def test_bad_or_unsupported_chats_give_none(tiny: HfTokenizer, doc: Any) -> None:
    assert tiny.prompt_tokens("chat", doc) is None


def test_no_chat_template_means_no_chat(tmp_path: Path) -> None:
    tok = model_dir(tmp_path, None)
    assert not tok.has_chat_template
    assert tok.prompt_tokens("chat", {"messages": SYSTEM_USER}) is None
    assert tok.prompt_tokens("completions", {"prompt": "Hello"}) == tok.encode(
        "Hello", add_special_tokens=True
    )


HEADER = "x-anthropic-billing-header: cch=1"


def test_the_request_is_not_modified(tiny: HfTokenizer) -> None:
    body = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": HEADER + "\nS"}]},
            {"role": "developer", "content": "D"},
            {"role": "assistant", "content": "part", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }  # fmt: skip
    before = json.dumps(body)
    assert tiny.prompt_tokens("chat", body) is not None
    assert json.dumps(body) == before


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-5, max_value=600)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = (
    "messages", "prompt", "role", "content", "type", "text", "tools", "tool_calls", "function",
    "documents", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "kv_transfer_params", "prompt_token_ids", "reasoning_effort",
)  # fmt: skip
messages = st.lists(
    st.dictionaries(
        st.sampled_from(("role", "content", "name", "tool_calls", "reasoning")),
        st.sampled_from(("user", "assistant", "system", "developer", "tool")) | json_values,
    ),
    max_size=3,
)
bodies = (
    st.dictionaries(st.sampled_from(FIELD_NAMES), json_values | messages, max_size=5)
    | st.fixed_dictionaries({"messages": messages})
    | json_values
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=bodies, path_kind=st.sampled_from(("chat", "completions")))
def test_never_raises_on_client_input(doc: Any, path_kind: PathKind, tiny: HfTokenizer) -> None:
    for tok in (tiny, SimTokenizer()):
        ids = tok.prompt_tokens(path_kind, doc)
        assert ids is None or (ids and all(type(t) is int for t in ids))
    assert prompt_chars(path_kind, doc) >= 0


# ---- the simulator's tokenizer equals the simulator ---------------------------------------

SIM_BODIES: list[tuple[PathKind, dict[str, Any]]] = [
    ("completions", {"prompt": "the quick brown fox"}),
    ("completions", {"prompt": "  spaces\tand\nnewlines  "}),
    ("completions", {"prompt": ["one prompt in a list"]}),
    ("completions", {"prompt": [3, 4, 5]}),
    ("completions", {"prompt": [[3, 4, 5]]}),
    ("completions", {"prompt": ["a", "b"]}),
    ("completions", {"prompt": ""}),
    ("completions", {"prompt": [True]}),
    ("chat", {"messages": SYSTEM_USER}),
    ("chat", {"messages": MULTI_TURN, "add_generation_prompt": False}),
    ("chat", {"messages": [*MULTI_TURN, {"role": "assistant", "content": "so"}],
              "continue_final_message": True}),
    ("chat", {"messages": MULTI_TURN, "continue_final_message": True,
              "add_generation_prompt": True}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a b"},
                                                         {"type": "image_url"}, "c"]}]}),
    ("chat", {"messages": [{"role": "assistant", "content": None}]}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"content": "x"}]}),
    ("chat", {"messages": SYSTEM_USER, "add_generation_prompt": "no"}),
]  # fmt: skip


def simulator_ids(path_kind: PathKind, doc: Any) -> list[int] | None:
    try:
        return list(parse_generate(doc, chat=path_kind == "chat").prompt_ids)
    except ApiError:
        return None


@pytest.mark.parametrize(("path_kind", "doc"), SIM_BODIES)
def test_sim_tokenizer_equals_the_simulator(path_kind: PathKind, doc: dict[str, Any]) -> None:
    assert SimTokenizer().prompt_tokens(path_kind, doc) == simulator_ids(path_kind, doc)


@settings(max_examples=300, deadline=None)
@given(doc=bodies, path_kind=st.sampled_from(("chat", "completions")))
def test_sim_tokenizer_agrees_with_the_simulator_on_any_body(doc: Any, path_kind: PathKind) -> None:
    """Wherever the simulator computes a prompt, the same ids; where it rejects the body only
    for its prompt, None. (It may also reject other fields: then no ids are cached anyway.)"""
    ours = SimTokenizer().prompt_tokens(path_kind, doc)
    theirs = simulator_ids(path_kind, doc)
    if theirs is not None:
        assert ours == theirs
    if ours is None and isinstance(doc, dict):
        assert theirs is None


# ---- load_tokenizer --------------------------------------------------------------------------


def test_load_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    sim = load_tokenizer("sim")
    assert (sim.kind, sim.name) == ("sim", "sim")
    hf = load_tokenizer(str(tiny_dir))
    assert (hf.kind, hf.name) == ("hf", str(tiny_dir))
    bare = load_tokenizer(str(tiny_dir / "tokenizer.json"))
    assert bare.prompt_tokens("completions", {"prompt": "Hello"}) == hf.prompt_tokens(
        "completions", {"prompt": "Hello"}
    )
    assert bare.prompt_tokens("chat", {"messages": SYSTEM_USER}) is None  # no template


def load_error(spec: str) -> str:
    with pytest.raises(ValueError, match="tokenizer") as info:
        load_tokenizer(spec)
    return str(info.value)


def test_load_tokenizer_errors_name_the_path_and_the_problem(
    tmp_path: Path, tiny_dir: Path
) -> None:
    missing = tmp_path / "nowhere"
    assert str(missing) in load_error(str(missing))
    assert "no such file or directory" in load_error(str(missing))
    assert "empty" in load_error("")

    empty = tmp_path / "empty"
    empty.mkdir()
    message = load_error(str(empty))
    assert str(empty) in message
    assert "no tokenizer.json" in message

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(b"\0")
    assert "only fast tokenizers" in load_error(str(slow))

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "tokenizer.json").write_text("{not json")
    assert str(garbage / "tokenizer.json") in load_error(str(garbage))

    bad_config = build_tiny_tokenizer(tmp_path / "bad_config")
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    message = load_error(str(bad_config))
    assert str(bad_config / "tokenizer_config.json") in message
    assert "not a JSON object" in message

    bad_template = build_tiny_tokenizer(tmp_path / "bad_template", template="{% for %}")
    message = load_error(str(bad_template))
    assert str(bad_template) in message
    assert "chat template does not parse" in message

    mistral = build_tiny_tokenizer(tmp_path / "mistral")
    (mistral / "consolidated.safetensors").write_bytes(b"")
    (mistral / "tekken.json").write_text("{}")
    assert "mistral_common" in load_error(str(mistral))


# ---- Tokenizers: off the event loop, bounded -----------------------------------------------


class Recording:
    """A PromptTokenizer that records the thread it ran in and can be held until released."""

    name = "recording"
    kind = "test"

    def __init__(self, *, hold: bool = False, fail: bool = False) -> None:
        self.threads: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.fail = fail

    def prompt_tokens(self, path_kind: PathKind, doc: Mapping[str, Any]) -> list[int] | None:
        self.threads.append(threading.get_ident())
        self.started.set()
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("a bug")
        return [len(str(doc.get("prompt", "")))]


@pytest.fixture
def make_tokenizers() -> Iterator[Any]:
    made: list[Tokenizers] = []

    def make(by_model: Mapping[str, Any], **options: Any) -> Tokenizers:
        made.append(Tokenizers(by_model, **options))
        return made[-1]

    yield make
    for t in made:
        t.close()


LONG = {"prompt": "x" * 100_000}
SHORT = {"prompt": "short"}


async def test_short_prompts_inline_long_ones_in_the_pool(make_tokenizers: Any) -> None:
    rec = Recording()
    tokenizers = make_tokenizers({"m": rec}, inline_chars=1_000)
    assert await tokenizers.tokens("m", "completions", SHORT) == [5]
    assert await tokenizers.tokens("m", "completions", LONG) == [100_000]
    assert (tokenizers.stats.inline, tokenizers.stats.offloaded) == (1, 1)
    assert rec.threads[0] == threading.get_ident()
    assert rec.threads[1] != threading.get_ident()


async def test_a_long_real_prompt_tokenizes_the_same_in_the_pool(
    make_tokenizers: Any, tiny: HfTokenizer
) -> None:
    words = " ".join(CORPUS)
    long_chat = {"messages": [{"role": "user", "content": words * (100_000 // len(words))}]}
    tokenizers = make_tokenizers({"tiny": tiny})
    ids = await tokenizers.tokens("tiny", "chat", long_chat)
    assert tokenizers.stats.offloaded == 1
    assert ids == tiny.prompt_tokens("chat", long_chat)


async def test_a_full_pool_turns_long_prompts_away(make_tokenizers: Any) -> None:
    rec = Recording(hold=True)
    tokenizers = make_tokenizers({"m": rec}, inline_chars=10, threads=1, max_pending=2)
    first = asyncio.create_task(tokenizers.tokens("m", "completions", LONG))
    second = asyncio.create_task(tokenizers.tokens("m", "completions", LONG))
    await asyncio.to_thread(rec.started.wait, 10)
    # Two running or queued: the third is refused at once, short ones still go inline.
    assert await tokenizers.tokens("m", "completions", LONG) is None
    assert tokenizers.stats.busy == 1
    rec.release.set()
    assert await tokenizers.tokens("m", "completions", SHORT) == [5]
    assert await first == [100_000]
    assert await second == [100_000]
    assert tokenizers.stats.offloaded == 2
    assert await tokenizers.tokens("m", "completions", LONG) == [100_000]  # room again


async def test_a_cancelled_caller_frees_its_slot_when_the_work_ends(make_tokenizers: Any) -> None:
    rec = Recording(hold=True)
    tokenizers = make_tokenizers({"m": rec}, inline_chars=10, threads=1, max_pending=1)
    waiting = asyncio.create_task(tokenizers.tokens("m", "completions", LONG))
    await asyncio.to_thread(rec.started.wait, 10)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # Still running in its thread: still counted.
    assert await tokenizers.tokens("m", "completions", LONG) is None
    assert tokenizers.pending == 1
    rec.release.set()
    await wait_for(lambda: tokenizers.pending == 0, what="the abandoned prompt to finish")
    assert await tokenizers.tokens("m", "completions", LONG) == [100_000]


async def test_unknown_models_failures_and_close(make_tokenizers: Any) -> None:
    tokenizers = make_tokenizers({"m": Recording(fail=True)}, inline_chars=10)
    assert await tokenizers.tokens("other", "completions", SHORT) is None
    assert tokenizers.stats.no_tokenizer == 1
    assert await tokenizers.tokens("m", "completions", SHORT) is None
    assert await tokenizers.tokens("m", "completions", LONG) is None
    assert tokenizers.stats.failed == 2
    tokenizers.close()
    assert await tokenizers.tokens("m", "completions", LONG) is None
    assert tokenizers.stats.offloaded == 1


async def test_close_answers_queued_callers_with_none(make_tokenizers: Any) -> None:
    rec = Recording(hold=True)
    tokenizers = make_tokenizers({"m": rec}, inline_chars=10, threads=1, max_pending=2)
    running = asyncio.create_task(tokenizers.tokens("m", "completions", LONG))
    queued = asyncio.create_task(tokenizers.tokens("m", "completions", LONG))
    await asyncio.to_thread(rec.started.wait, 10)
    tokenizers.close()
    assert await queued is None
    rec.release.set()
    assert await running == [100_000]  # already running: it finishes


def test_tokenizers_load(tiny_dir: Path) -> None:
    tokenizers = Tokenizers.load({"tiny": str(tiny_dir), "sim-model": "sim"})
    try:
        assert tokenizers.get("tiny") is not None
        assert isinstance(tokenizers.get("sim-model"), SimTokenizer)
        assert tokenizers.get("other") is None
    finally:
        tokenizers.close()
    with pytest.raises(ValueError, match="nowhere"):
        Tokenizers.load({"x": "/nowhere"})
    with pytest.raises(ValueError, match="at least 1"):
        Tokenizers({}, threads=0)


def test_prompt_chars() -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "ef"}]},
        ],
        "tools": [{"function": {"name": "xyz"}}],
        "max_tokens": 10_000,
    }
    assert prompt_chars("chat", chat) == len("user" * 2 + "abcd" + "text" + "ef" + "xyz")
    assert prompt_chars("completions", {"prompt": [1, 2, 3]}) == 3
    assert prompt_chars("completions", {"prompt": ["ab", "c"]}) == 3
    assert prompt_chars("completions", {"prompt": "x" * 10_000}, limit=100) == 10_000
    assert prompt_chars("completions", {"prompt": list(range(100_000))}, limit=100) == 101
    assert prompt_chars("completions", {}) == 0
