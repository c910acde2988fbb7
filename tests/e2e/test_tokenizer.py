"""The gateway's prompt tokens (gateway/tokenizer/) are vLLM's, token for token.

Against the real servers on the tiny model: every chat body's ids equal what ``POST /tokenize``
answers (its chat form, ``messages``) and what ``/v1/chat/completions`` really feeds the
engine (``return_token_ids``); string prompts likewise through ``/tokenize``'s completion form
(``prompt``, a string only) and ``/v1/completions``, and token-id prompts and one-element
lists, which ``/tokenize`` does not take, through ``/v1/completions``.

The tiny model's template is small, so a third test renders richer templates (parts content,
tools, tool calls, documents, loop controls, macros, named templates, ...) with vLLM's own
functions in the vLLM virtualenv, offline, and compares. It needs no server.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from gateway.tokenizer import HfTokenizer, PathKind
from tests.e2e.servers import MODEL_DIR, SERVED_MODEL, VllmServer, vllm_python
from tests.gateway.tokenizer.test_tokenizer import build_tiny_tokenizer

SYSTEM_USER: Final = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, world! How are you today?"},
]
MULTI_TURN: Final = [
    *SYSTEM_USER,
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "The gateway routes every request to the least loaded backend."},
]
LONG_TEXT: Final = " ".join(
    ["Prefix caching reuses the key and value blocks of prompts that share a beginning."] * 40
)
TOOLS: Final = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Bodies /tokenize's chat form takes as they are.
CHATS: Final[list[tuple[str, dict[str, Any]]]] = [
    ("system and user", {"messages": SYSTEM_USER}),
    ("multi-turn", {"messages": MULTI_TURN}),
    (
        "text parts",
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "A quick brown fox"},
                        {"type": "text", "text": "jumps over the lazy dog."},
                    ],
                },
            ]
        },
    ),
    ("no generation prompt", {"messages": MULTI_TURN, "add_generation_prompt": False}),
    (
        "continue final message",
        {
            "messages": [*MULTI_TURN, {"role": "assistant", "content": "Tokens stream through"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    (
        "template kwargs",
        {
            "messages": SYSTEM_USER,
            "chat_template_kwargs": {"bos_token": "[BOS]", "enable_thinking": False},
        },
    ),
    ("developer role", {"messages": [{"role": "developer", "content": "Answer."}, *MULTI_TURN]}),
    ("tools", {"messages": SYSTEM_USER, "tools": TOOLS}),
    (
        "unicode and whitespace",
        {
            "messages": [
                {"role": "user", "content": "Grüße 🌍 «ok»\n\n\ttabs  spaces ", "name": "x"}
            ]
        },
    ),
    (
        "empty assistant content",
        {"messages": [*SYSTEM_USER, {"role": "assistant", "content": None}]},
    ),
    ("add special tokens", {"messages": SYSTEM_USER, "add_special_tokens": True}),
    ("long", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
]
# Chat completions fields /tokenize does not have.
CHATS_SERVED_ONLY: Final[list[tuple[str, dict[str, Any]]]] = [
    ("documents", {"messages": SYSTEM_USER, "documents": [{"title": "t", "text": "x"}]}),
    ("reasoning effort", {"messages": SYSTEM_USER, "reasoning_effort": "low"}),
]
STRING_PROMPTS: Final[list[tuple[str, dict[str, Any]]]] = [
    ("string", {"prompt": "The quick brown fox jumps over the lazy dog."}),
    ("no special tokens", {"prompt": "Hello, world!", "add_special_tokens": False}),
    ("special tokens in text", {"prompt": "<s>Hello</s> <pad>world"}),
    ("long", {"prompt": LONG_TEXT}),
]
ID_PROMPTS: Final[list[tuple[str, dict[str, Any]]]] = [
    ("token ids", {"prompt": [1, 42, 7, 300, 2, 99]}),
    ("one string in a list", {"prompt": ["Hello, world! How are you today?"]}),
    ("one id list in a list", {"prompt": [[5, 6, 7, 8]]}),
]


@pytest.fixture(scope="module")
def tiny() -> HfTokenizer:
    return HfTokenizer.from_path(MODEL_DIR)


def ours(tok: HfTokenizer, path_kind: PathKind, body: dict[str, Any]) -> list[int]:
    ids = tok.prompt_tokens(path_kind, body)
    assert ids is not None, f"the gateway cannot tokenize {body}"
    return ids


async def post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await http.post(url, json={"model": SERVED_MODEL, **body})
    assert resp.status_code == 200, resp.text
    doc: dict[str, Any] = resp.json()
    return doc


async def test_tokens_equal_vllm_tokenize(
    servers: list[VllmServer], http: httpx.AsyncClient, tiny: HfTokenizer
) -> None:
    url = f"{servers[0].url}/tokenize"
    for label, body in CHATS:
        vllm = (await post(http, url, body))["tokens"]
        assert ours(tiny, "chat", body) == vllm, label
    for label, body in STRING_PROMPTS:
        vllm = (await post(http, url, body))["tokens"]
        assert ours(tiny, "completions", body) == vllm, label


async def test_tokens_equal_the_prompts_vllm_serves(
    servers: list[VllmServer], http: httpx.AsyncClient, tiny: HfTokenizer
) -> None:
    """The ids the engine ran, from the generation endpoints themselves."""
    server = servers[-1]
    served = {"max_tokens": 1, "return_token_ids": True}
    for label, chat in [*CHATS, *CHATS_SERVED_ONLY]:
        # With tools, vLLM defaults tool_choice to "auto", which needs --enable-auto-tool-choice.
        body = {**chat, "tool_choice": "none"} if "tools" in chat else chat
        doc = await post(http, f"{server.url}/v1/chat/completions", {**body, **served})
        assert ours(tiny, "chat", body) == doc["prompt_token_ids"], label
    for label, body in [*STRING_PROMPTS, *ID_PROMPTS]:
        doc = await post(http, f"{server.url}/v1/completions", {**body, **served})
        assert ours(tiny, "completions", body) == doc["choices"][0]["prompt_token_ids"], label


# ---- richer templates, against vLLM's functions (offline, in the vLLM virtualenv) -----------

REFERENCE: Final = r'''
"""stdin: {"models": {name: dir}, "cases": [{"model", "kind", "body"}]}; one JSON line per
case on stdout, {"ids": [...]} or {"error": "..."}: vLLM 0.32's own chat path, as
vllm/renderers/online_renderer.py `preprocess_chat` and hf.py `render_messages` run it."""
import json, os, sys
from types import SimpleNamespace
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template
from vllm.renderers.inputs.preprocess import parse_dec_only_prompt, prompt_to_seq
from vllm.renderers.params import merge_kwargs
from vllm.tokenizers.registry import get_tokenizer

job = json.load(sys.stdin)
loaded = {}
for name, path in job["models"].items():
    config = SimpleNamespace(
        multimodal_config=None, enable_prompt_embeds=False, revision=None, code_revision=None,
        trust_remote_code=False, tokenizer_revision=None, tokenizer=path, model=path,
        hf_config=SimpleNamespace(model_type="llama"), is_encoder_decoder=False,
        max_model_len=16384, allowed_local_media_path="", allowed_media_domains=None,
    )
    loaded[name] = (get_tokenizer(path), config)

def chat(tokenizer, mc, body):
    req = ChatCompletionRequest(**body)
    if req.chat_template is not None or (req.chat_template_kwargs or {}).get("chat_template"):
        raise ValueError("untrusted chat template")  # OnlineRenderer.validate_chat_template
    tool_dicts = None if req.tools is None else [t.model_dump() for t in req.tools]
    defaults = merge_kwargs(None, dict(tools=tool_dicts, tokenize=False))
    params = req.build_chat_params(None, "auto").with_defaults(defaults)
    fmt = resolve_chat_template_content_format(
        chat_template=params.chat_template, tools=params.chat_template_kwargs.get("tools"),
        given_format="auto", tokenizer=tokenizer, model_config=mc,
    )
    conversation, mm_data, _ = parse_chat_messages(req.messages, mc, content_format=fmt)
    assert mm_data is None
    raw = safe_apply_chat_template(
        mc, tokenizer, conversation, **params.get_apply_chat_template_kwargs()
    )
    prompt = parse_dec_only_prompt(raw)
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    kwargs = req.build_tok_params(mc).get_encode_kwargs()
    return list(tokenizer(prompt["prompt"], **kwargs)["input_ids"])

def completions(tokenizer, mc, body):
    req = CompletionRequest(**body)
    prompts = prompt_to_seq(req.prompt)
    if len(prompts) != 1:
        raise ValueError(f"{len(prompts)} prompts")
    prompt = parse_dec_only_prompt(prompts[0])
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    kwargs = req.build_tok_params(mc).get_encode_kwargs()
    return list(tokenizer(prompt["prompt"], **kwargs)["input_ids"])

for case in job["cases"]:
    tokenizer, mc = loaded[case["model"]]
    try:
        run = chat if case["kind"] == "chat" else completions
        out = {"ids": run(tokenizer, mc, case["body"])}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps(out), flush=True)
'''

PARTS_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{%- if tools %}<|tools|>{{ tools | tojson(indent=2) }}{{ eos_token }}\n{% endif %}"
    "{%- if documents %}{% for d in documents %}<|doc|>{{ d['title'] }}: {{ d['text'] }}\n"
    "{% endfor %}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'developer' %}<|dev|>{{ image_token }}"
    "{% else %}<|{{ message['role'] }}|>{% endif %}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% if part.cache_control is defined %}[cached]{% endif %}{% endif %}"
    "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}{% endif %}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}\n{% endif %}"
)
QWEN_LIKE_TEMPLATE: Final = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are helpful.' %}{%- set rest = messages %}{%- endif %}"
    "<|im_start|>system\n{{ system }}{% if tools %}\n\n# Tools\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}{% endif %}<|im_end|>\n"
    "{% for message in rest %}"
    "{%- if message.role == 'system' %}{{ raise_exception('System message must be first') }}"
    "{% endif %}"
    "<|im_start|>{{ message.role }}{% if message.name %} ({{ message.name }}){% endif %}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>\n{% endif %}"
    "{{ message.content }}"
    "{%- if message.tool_calls %}{% for tc in message.tool_calls %}\n"
    '<tool_call>{"name": {{ tc.function.name | tojson }}, '
    '"arguments": {{ tc.function.arguments | tojson }}, "id": {{ tc.id | tojson }}}</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% endif %}"
)
MACRO_TEMPLATE: Final = (
    "{% macro render(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p.text }}|"
    "{% endfor %}{% endif %}{% endmacro %}"
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ render(m.content) }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
NAMED_TEMPLATES: Final = [
    {
        "name": "default",
        "template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}",
    },
    {
        "name": "tool_use",
        "template": "TOOLS {{ tools | tojson }}\n{% for m in messages %}{{ m['role'] }}: "
        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    },
]

_CALL: Final = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
}
RICH_CHATS: Final[list[dict[str, Any]]] = [
    *(body for _, body in CHATS),
    *(body for _, body in CHATS_SERVED_ONLY),
    {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "one"}, "The quick "]},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
                    "c",
                    {"type": "input_text", "text": "d"},
                    {"type": "refusal", "refusal": "e"},
                ],
            }
        ]
    },
    {"messages": MULTI_TURN, "chat_template_kwargs": {"enable_thinking": True, "unused": 1}},
    {"messages": MULTI_TURN, "chat_template_kwargs": {"enable_thinking": "auto"}},
    {"messages": MULTI_TURN, "reasoning_effort": "none"},
    {"messages": MULTI_TURN, "chat_template_kwargs": {"add_generation_prompt": False}},
    {
        "messages": [
            {"role": "system", "content": "S1"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": [{"type": "text", "text": "D2"}]},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [_CALL]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}],
            },
            {"role": "tool", "tool_call_id": "c2", "content": "ok", "name": "noop"},
        ],
        "tools": TOOLS,
    },
    {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "tool_calls": [], "reasoning": "hmm"},
            {"role": "user", "content": "again"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "tool_calls": [{**_CALL, "function": {"name": "f", "arguments": "not json"}}],
            },
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nThe real prompt."},
            {"role": "user", "content": "hi"},
        ]
    },
    {"messages": [{"role": "user", "content": "first"}, {"role": "system", "content": "late"}]},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
    {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"documents": [{"title": "kw", "text": "from kwargs"}]},
    },
    {"messages": [{"role": "custom", "content": "c", "task": "t"}]},
    {"messages": SYSTEM_USER, "continue_final_message": True},
    {"messages": SYSTEM_USER, "chat_template": "{{ 'mine' }}"},
]
RICH_COMPLETIONS: Final[list[dict[str, Any]]] = [
    *(body for _, body in STRING_PROMPTS),
    *(body for _, body in ID_PROMPTS),
    {"prompt": ["a", "b"]},
    {"prompt": ""},
]


@pytest.mark.timeout(600)
def test_rendering_equals_vllm_on_richer_templates(tmp_path: Path) -> None:
    """Where vLLM computes ids, the gateway computes the same ones; where vLLM rejects the
    request, the gateway says None. Besides, the gateway gives ids for every body here but
    those vLLM rejects: nothing is left unsupported by accident."""
    dirs = {
        "tiny": build_tiny_tokenizer(tmp_path / "tiny"),
        "parts": build_tiny_tokenizer(
            tmp_path / "parts", template=PARTS_TEMPLATE, config_extra={"image_token": "<image>"}
        ),
        "qwen-like": build_tiny_tokenizer(tmp_path / "qwen", template=QWEN_LIKE_TEMPLATE),
        "macro": build_tiny_tokenizer(tmp_path / "macro", template=MACRO_TEMPLATE),
        "named": build_tiny_tokenizer(
            tmp_path / "named", template=None, config_extra={"chat_template": NAMED_TEMPLATES}
        ),
    }
    cases: list[tuple[str, PathKind, dict[str, Any]]] = []
    for name in dirs:
        cases += [(name, "chat", {"model": SERVED_MODEL, **b}) for b in RICH_CHATS]
        cases += [(name, "completions", {"model": SERVED_MODEL, **b}) for b in RICH_COMPLETIONS]
    job = {
        "models": {name: str(d) for name, d in dirs.items()},
        "cases": [{"model": m, "kind": k, "body": b} for m, k, b in cases],
    }
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    done = subprocess.run(
        [str(vllm_python()), str(script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
        timeout=540,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(answers) == len(cases), done.stderr[-3000:]

    tokenizers = {name: HfTokenizer.from_path(d) for name, d in dirs.items()}
    compared = 0
    for (name, kind, body), answer in zip(cases, answers, strict=True):
        got = tokenizers[name].prompt_tokens(kind, body)
        if "error" in answer:
            assert got is None, (name, body, answer["error"])
        else:
            assert got == answer["ids"], (name, body)
            compared += 1
    assert compared > len(cases) * 3 // 4
