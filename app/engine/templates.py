"""Conversation templates: turning chat messages into the prompt text a model was trained on.

Two kinds, one interface (`ConversationTemplate`): built-in templates looked up by name
(`chatml`, `llama-2`, `llama-3`, `mistral`, `qwen2`, `phi-3`, `gemma`, `rwkv_world`,
`rwkv_world_think`, `raw`),
and a model's own Jinja `chat_template`, rendered in a sandbox the way transformers renders it.
`resolve_template` picks one for a model folder; `ConversationTemplate.render_delta` gives the
text a new turn adds, so a conversation that keeps its KV/RNN state prefills only that.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from localchat.errors import GenerationError, ModelConfigError

Message = Mapping[str, Any]
ROLES = ("system", "user", "assistant")

# Special tokens that end a turn or a document in the template families we know. When one of
# them appears literally in a model's Jinja template, generating it ends the reply.
KNOWN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|endoftext|>",
    "<end_of_turn>",
)
HARMONY_CHANNEL = "<|channel|>"
HARMONY_END_TOKENS = ("<|return|>", "<|call|>")
# The special-token names transformers passes to a chat template as variables.
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenLookup(Protocol):
    """The part of the tokenizer protocol needed to turn stop tokens into ids."""

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given by its exact string, or None."""
        ...


@dataclass(frozen=True)
class Stops:
    """What ends a reply for one model: token ids, and strings (never shown to the user)."""

    token_ids: tuple[int, ...]
    strings: tuple[str, ...]


class ConversationTemplate(ABC):
    """Renders messages to a prompt and knows what ends a reply."""

    name: str
    bos_token: str
    eos_token: str
    stop_strings: tuple[str, ...]
    stop_token_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]

    @abstractmethod
    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's header when asked;
        `tools` (OpenAI function definitions) only for a template that `supports_tools`;
        `enable_thinking` reaches a template that reads it (None: the template's default)."""

    @property
    def thinks(self) -> bool:
        """Whether the template writes `<think>` blocks (a reasoning model's template)."""
        return False

    @property
    def reads_enable_thinking(self) -> bool:
        """Whether the template has a thinking switch (`enable_thinking`)."""
        return False

    @property
    def supports_tools(self) -> bool:
        """Whether this template renders tool definitions (a Jinja template that uses `tools`)."""
        return False

    @property
    def tool_call_style(self) -> str:
        """How the model writes a call: "tag" = `<tool_call>\n{"name": .., "arguments": ..}
        \n</tool_call>` (Qwen2.5, Hermes), "json" = a bare `{"name": .., "parameters": ..}`
        (Llama 3.1/3.2), "harmony" = a message to `functions.<name>` (gpt-oss)."""
        return "json"

    def stops(self, tokenizer: TokenLookup, model_dir: Path | None = None) -> Stops:
        """Stop token ids and stop strings for this template with this tokenizer.

        Ids: the template's fixed ids, its stop tokens that the tokenizer knows, and the
        `eos_token_id` of `generation_config.json` / `config.json` in `model_dir`. A stop
        token the tokenizer does not know as one token becomes a stop string instead.
        """
        ids = list(self.stop_token_ids)
        strings = list(self.stop_strings)
        for token in self.stop_token_strings:
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                strings.append(token)
            else:
                ids.append(token_id)
        if model_dir is not None:
            ids.extend(_eos_ids_from_configs(Path(model_dir)))
        return Stops(tuple(sorted(set(ids))), tuple(dict.fromkeys(strings)))


# ---------------------------------------------------------------------------------------------
# Built-in templates


def _normalize(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """(role, content) pairs, checked: known roles and string content."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise GenerationError(f"message {i} must be a mapping with 'role' and 'content'")
        role, content = m["role"], m.get("content")
        if role not in ROLES:
            raise GenerationError(
                f"message {i}: unknown role {role!r} (expected one of {', '.join(ROLES)})"
            )
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise GenerationError(f"message {i}: content must be a string")
        out.append((role, content))
    return out


def _split_system(
    name: str, msgs: list[tuple[str, str]]
) -> tuple[str | None, list[tuple[str, str]]]:
    """The leading system prompt (if any) and the user/assistant turns, which must alternate."""
    system = None
    if msgs and msgs[0][0] == "system":
        system, msgs = msgs[0][1], msgs[1:]
    for i, (role, _) in enumerate(msgs):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            if role == "system":
                raise GenerationError(f"template {name}: a system message may only come first")
            raise GenerationError(
                f"template {name}: after the optional system message, roles must alternate "
                f"user/assistant/user/..., but message {i + (system is not None)} is {role!r}"
            )
    return system, msgs


Renderer = Callable[["BuiltinTemplate", list[tuple[str, str]], bool], str]


@dataclass(frozen=True)
class BuiltinTemplate(ConversationTemplate):
    """A template implemented here, looked up by name."""

    name: str
    renderer: Renderer = field(repr=False)
    bos_token: str = ""
    eos_token: str = ""
    stop_strings: tuple[str, ...] = ()
    stop_token_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    default_system: str | None = None
    description: str = ""

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's header when asked
        (no built-in template thinks: `enable_thinking` changes nothing)."""
        if tools:
            raise GenerationError(f"template {self.name} does not render tools")
        return self.renderer(self, _normalize(messages), add_generation_prompt)


def _render_chatml(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    parts = []
    if t.default_system is not None and (not msgs or msgs[0][0] != "system"):
        parts.append(f"<|im_start|>system\n{t.default_system}<|im_end|>\n")
    parts.extend(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in msgs)
    if gen:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_llama2(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    system, turns = _split_system(t.name, msgs)
    parts = []
    for i, (role, content) in enumerate(turns):
        if i == 0 and system is not None:
            content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
        if role == "user":
            parts.append(f"{t.bos_token}[INST] {content.strip()} [/INST]")
        else:
            parts.append(f" {content.strip()} {t.eos_token}")
    return "".join(parts)  # the user turn's [/INST] is the generation prompt


def _render_llama3(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    parts = [t.bos_token]
    parts.extend(
        f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
        for role, content in msgs
    )
    if gen:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def _render_mistral(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    system, turns = _split_system(t.name, msgs)
    parts = [t.bos_token]
    for i, (role, content) in enumerate(turns):
        if role == "user":
            if i == 0 and system is not None:
                content = f"{system}\n\n{content}"
            parts.append(f"[INST] {content} [/INST]")
        else:
            parts.append(f"{content}{t.eos_token}")
    return "".join(parts)


def _render_phi3(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    parts = [
        f"<|{role}|>\n{content}<|end|>\n"
        for role, content in msgs
        if not (role == "system" and not content)
    ]
    parts.append("<|assistant|>\n" if gen else t.eos_token)
    return "".join(parts)


def _render_gemma(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    system, turns = _split_system(t.name, msgs)
    parts = [t.bos_token]
    for i, (role, content) in enumerate(turns):
        prefix = f"{system}\n\n" if i == 0 and system is not None else ""
        turn_role = "model" if role == "assistant" else role
        parts.append(f"<start_of_turn>{turn_role}\n{prefix}{content.strip()}<end_of_turn>\n")
    if gen:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


def _render_rwkv_world(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    system, turns = _split_system(t.name, msgs)
    parts = [t.bos_token]
    if system:
        parts.append(f"System: {system}\n\n")
    for role, content in turns:
        speaker = "User" if role == "user" else "Assistant"
        parts.append(f"{speaker}: {content.strip()}\n\n")
    if gen:
        parts.append("Assistant:")
    return "".join(parts)


@dataclass(frozen=True)
class WorldThinkTemplate(BuiltinTemplate):
    """The RWKV World format of a reasoning model (the RWKV-7 G1 line), with the model card's
    prompts: thinking on (the default) ends the prompt with `Assistant: <think>` (in the World
    vocabulary `>` is a token of its own, so this is the very token prefix of the trained
    `<think>\n…`), off with an empty block, `Assistant: <think>\n</think>`. Earlier replies are
    rendered without their thinking."""

    @property
    def thinks(self) -> bool:
        return True

    @property
    def reads_enable_thinking(self) -> bool:
        return True

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text, its generation prompt opening a think block unless thinking is off."""
        if tools:
            raise GenerationError(f"template {self.name} does not render tools")
        text = self.renderer(self, _normalize(messages), False)
        if not add_generation_prompt:
            return text
        return text + ("Assistant: <think>\n</think>" if enable_thinking is False
                       else "Assistant: <think>")


def _render_raw(t: BuiltinTemplate, msgs: list[tuple[str, str]], gen: bool) -> str:
    return "".join(content for _, content in msgs)


QWEN2_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    t.name: t
    for t in (
        BuiltinTemplate(
            "chatml",
            _render_chatml,
            stop_token_strings=("<|im_end|>", "<|endoftext|>"),
            description="<|im_start|>role ... <|im_end|> (SmolLM, OpenHermes)",
        ),
        BuiltinTemplate(
            "llama-2",
            _render_llama2,
            bos_token="<s>",
            eos_token="</s>",
            stop_token_strings=("</s>",),
            description="Llama-2-chat: <s>[INST] <<SYS>>...<</SYS>> user [/INST] reply </s>",
        ),
        BuiltinTemplate(
            "llama-3",
            _render_llama3,
            bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>",
            stop_token_strings=("<|eot_id|>", "<|end_of_text|>"),
            description="Llama 3 Instruct: <|start_header_id|>role<|end_header_id|> headers",
        ),
        BuiltinTemplate(
            "mistral",
            _render_mistral,
            bos_token="<s>",
            eos_token="</s>",
            stop_token_strings=("</s>",),
            description="Mistral Instruct v0.1/v0.2: [INST] user [/INST]reply</s>; a system "
            "prompt goes before the first user message",
        ),
        BuiltinTemplate(
            "qwen2",
            _render_chatml,
            eos_token="<|im_end|>",
            stop_token_strings=("<|im_end|>", "<|endoftext|>"),
            default_system=QWEN2_DEFAULT_SYSTEM,
            description="Qwen2/2.5 Instruct: ChatML with Qwen's default system prompt",
        ),
        BuiltinTemplate(
            "phi-3",
            _render_phi3,
            eos_token="<|endoftext|>",
            stop_token_strings=("<|end|>", "<|endoftext|>"),
            description="Phi-3/3.5: <|user|> ... <|end|> <|assistant|>",
        ),
        BuiltinTemplate(
            "gemma",
            _render_gemma,
            bos_token="<bos>",
            eos_token="<eos>",
            stop_token_strings=("<end_of_turn>", "<eos>"),
            description="Gemma: <start_of_turn>user/model; a system prompt goes before the first "
            "user message",
        ),
        BuiltinTemplate(
            "rwkv_world",
            _render_rwkv_world,
            stop_strings=("\n\nUser:",),
            stop_token_ids=(0,),
            description="RWKV World: System:/User:/Assistant: paragraphs",
        ),
        WorldThinkTemplate(
            "rwkv_world_think",
            _render_rwkv_world,
            stop_strings=("\n\nUser:",),
            stop_token_ids=(0,),
            description="RWKV World for reasoning models (RWKV-7 G1): the reply opens with a "
            "<think> block",
        ),
        BuiltinTemplate(
            "raw",
            _render_raw,
            description="no template: the messages' text as it is",
        ),
    )
}


def builtin_template(name: str) -> BuiltinTemplate:
    """The built-in template called `name` (a clear error lists the known names)."""
    try:
        return BUILTIN_TEMPLATES[name]
    except KeyError:
        raise GenerationError(
            f"unknown conversation template {name!r}; known: {', '.join(BUILTIN_TEMPLATES)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Jinja templates


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like transformers: plain json.dumps, without jinja's HTML escaping.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_environment() -> Any:
    """A sandboxed, immutable Jinja environment configured as transformers configures its own."""
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; render it as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaTemplate(ConversationTemplate):
    """A model's own Jinja chat template (HF `chat_template`), rendered in a sandbox.

    The template sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None`, the
    special tokens (`bos_token`, `eos_token`, ...) and any `variables` given, as with
    transformers' `apply_chat_template`.
    """

    def __init__(
        self,
        source: str,
        *,
        name: str = "jinja",
        special_tokens: Mapping[str, str] | None = None,
        variables: Mapping[str, Any] | None = None,
        stop_strings: Iterable[str] = (),
        stop_token_strings: Iterable[str] | None = None,
    ) -> None:
        from jinja2 import TemplateError

        self.name = name
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.bos_token = self.special_tokens.get("bos_token", "")
        self.eos_token = self.special_tokens.get("eos_token", "")
        self.variables = dict(variables or {})
        self.stop_strings = tuple(stop_strings)
        if stop_token_strings is None:
            # OpenAI's harmony format (gpt-oss) ends each message of a turn with <|end|> (the
            # thinking, then the answer): only <|return|> and <|call|> end the reply
            found = (list(HARMONY_END_TOKENS) if HARMONY_CHANNEL in source
                     else [t for t in KNOWN_END_TOKENS if t in source])
            stop_token_strings = [self.eos_token, *found] if self.eos_token else found
        self.stop_token_strings = tuple(dict.fromkeys(stop_token_strings))
        self.stop_token_ids = ()
        try:
            self._template = _jinja_environment().from_string(source)
        except TemplateError as exc:
            raise ModelConfigError(f"chat template {name}: cannot parse it ({exc})") from None

    def __repr__(self) -> str:
        return f"JinjaTemplate(name={self.name!r}, {len(self.source)} chars)"

    @property
    def supports_tools(self) -> bool:
        """Whether the template renders `tools` (it mentions the variable)."""
        import re

        return re.search(r"\btools\b", self.source) is not None

    @property
    def tool_call_style(self) -> str:
        """"harmony" for OpenAI's harmony format (gpt-oss: a message to `functions.f`), "tag"
        when the template writes calls in <tool_call> tags, else "json"."""
        if HARMONY_CHANNEL in self.source:
            return "harmony"
        return "tag" if "<tool_call>" in self.source else "json"

    @property
    def thinks(self) -> bool:
        """Whether the template writes `<think>` blocks (Qwen3, the DeepSeek-R1 distills)."""
        return "</think>" in self.source

    @property
    def reads_enable_thinking(self) -> bool:
        """Whether the template reads the `enable_thinking` switch (Qwen3)."""
        return "enable_thinking" in self.source

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text for `messages`, ending with the assistant's header when asked;
        `enable_thinking` is passed as the variable of that name unless None."""
        from jinja2 import TemplateError

        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise GenerationError(f"message {i} must be a mapping with 'role' and 'content'")
            # Like transformers: keys whose value is None are dropped.
            plain.append({k: v for k, v in m.items() if v is not None})
        context = {
            **self.special_tokens,
            "tools": None,
            "documents": None,
            **self.variables,
            **({"tools": [dict(t) for t in tools]} if tools else {}),
            "messages": plain,
            "add_generation_prompt": add_generation_prompt,
            **({"enable_thinking": enable_thinking} if enable_thinking is not None else {}),
        }
        try:
            return self._template.render(**context)
        except TemplateError as exc:
            raise GenerationError(f"chat template {self.name}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Finding the template of a model folder


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


def _pick_named_template(value: Any, path: Path) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use default)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            item.get("name"): item.get("template") for item in value if isinstance(item, Mapping)
        }
        chosen = named.get("default") or next(iter(named.values()), None)
        if isinstance(chosen, str):
            return chosen
    raise ModelConfigError(f"{path}: chat_template must be a string or a list of named templates")


def load_chat_template(model_dir: Path) -> JinjaTemplate | None:
    """The model's own Jinja template from its folder, or None when it has none.

    Looks, in transformers' order, at `chat_template.jinja`, `chat_template.json`, then the
    `chat_template` of `tokenizer_config.json`; special tokens come from tokenizer_config.json.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json_object(config_path) if config_path.exists() else {}
    source: str | None = None
    origin = config_path
    if (model_dir / "chat_template.jinja").exists():
        origin = model_dir / "chat_template.jinja"
        source = origin.read_text(encoding="utf-8")
    elif (model_dir / "chat_template.json").exists():
        origin = model_dir / "chat_template.json"
        source = _pick_named_template(_read_json_object(origin).get("chat_template"), origin)
    else:
        source = _pick_named_template(config.get("chat_template"), config_path)
    if not source:
        return None
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            special[key] = text
    return JinjaTemplate(source, name=f"{model_dir.name}/{origin.name}", special_tokens=special)


def resolve_template(
    model_dir: Path | None = None, name: str | None = None, default: str | None = None
) -> ConversationTemplate:
    """The template to use: `name` if given (a built-in name or a .jinja file), else the model's
    own Jinja template, else the built-in `default` (e.g. from a recipe)."""
    if name:
        if name in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[name]
        path = Path(name)
        if path.suffix == ".jinja" and path.is_file():
            special: dict[str, str] = {}
            if model_dir is not None:
                own = load_chat_template(model_dir)
                special = own.special_tokens if own is not None else {}
            return JinjaTemplate(
                path.read_text(encoding="utf-8"), name=path.name, special_tokens=special
            )
        return builtin_template(name)  # raises with the list of known names
    if model_dir is not None:
        own = load_chat_template(model_dir)
        if own is not None:
            return own
    if default:
        return builtin_template(default)
    where = f"{model_dir} has no chat_template" if model_dir is not None else "no model folder"
    raise GenerationError(
        f"no conversation template: {where}; choose one of {', '.join(BUILTIN_TEMPLATES)}"
    )


def _eos_ids_from_configs(model_dir: Path) -> list[int]:
    """eos_token_id values (an int or a list) of generation_config.json and config.json."""
    ids: list[int] = []
    for file in ("generation_config.json", "config.json"):
        path = model_dir / file
        if not path.exists():
            continue
        value = _read_json_object(path).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.extend(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return ids
