"""The engine: one loaded model ready to chat, the entry point of every front end.

    engine = Engine.open("smollm2-135m-instruct")        # a store name, name:quant or a folder
    chat = engine.conversation(system="Be brief.")
    for event in chat.send("Hello!", temperature=0):       # or `async for` in an event loop
        print(event.text, end="")

`Engine` owns the model, its conversation template and stops, and the scheduler thread that
generates every active reply together (scheduler.py). `Conversation.send`, `Engine.chat`
(stateless, for a server) and `Engine.complete` (raw text) all return a `ReplyStream`.
`Engine.open` on an embedding model gives an `embedding.EmbeddingEngine`, whose `embed` returns
vectors and whose chat entry points say it cannot chat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat import model_dir as md
from localchat.engine.conversation import Conversation
from localchat.engine.generation_config import GenerationConfig
from localchat.engine.grammar import GrammarCache, TokenConstraint
from localchat.engine.harmony import HarmonySplitter, HarmonyTokens
from localchat.engine.prompt import (
    DEFAULT_REPLY_RESERVE,
    OverflowPolicy,
    PromptPlan,
    PromptPlanner,
    check_policy,
)
from localchat.engine.reasoning import (
    ReasoningSplitter,
    Splitter,
    ThinkTags,
    check_think,
    model_thinks,
    prompt_opens_thinking,
)
from localchat.engine.runtime import Model
from localchat.engine.runtime import Sequence as ModelSequence
from localchat.engine.scheduler import Request, Scheduler, SequenceOwner
from localchat.engine.stream import ReplyStream
from localchat.engine.templates import ConversationTemplate, Message, resolve_template
from localchat.errors import InvalidRequestError

if TYPE_CHECKING:
    from localchat.engine.embedding import Embeddings


def resolve_model_dir(ref: str | Path) -> Path:
    """The model directory for a store name (`name` or `name:quant`) or a directory path.

    Raises ModelNotFoundError with close matches when nothing fits. Cheap: loads no TVM.
    """
    path = Path(ref).expanduser()
    if md.is_model_dir(path):
        return path  # as given (the store resolves it to an absolute path)
    from localchat.store import Store

    return Store().resolve(str(ref))  # the one resolver of names


class Engine:
    """One model ready to chat: template, stops, defaults, and the scheduler that runs replies.

    model: a loaded `Model` (see `Engine.open` to open one by name).
    template: a built-in template name or a .jinja file; default: the model's own Jinja
        template, else the template its localchat config names.
    context_window: tokens a sequence may hold (default and maximum: the model's window and
        the KV cache's size).
    overflow: what a conversation does when it outgrows the window: "truncate" drops the
        oldest turns (never the system prompt) and re-prefills, "error" raises
        ContextWindowError.
    reply_reserve: tokens kept free for a reply when checking the window (max_tokens when
        smaller).
    config: default generation parameters (default: the model's generation_config.json).
    max_queue: requests that may wait for a free slot before EngineBusyError (None: no limit).
    prefix_cache: keep finished sequences so a prompt sharing a prefix with one (a system
        prompt, a resent history) prefills only the rest, and let a conversation roll back to
        a common prefix (None: on unless LOCALCHAT_PREFIX_CACHE=0).
    prefix_cache_tokens: most tokens the kept sequences hold (None: the KV cache's size).
    """

    def __init__(
        self,
        model: Model,
        *,
        template: str | ConversationTemplate | None = None,
        context_window: int | None = None,
        overflow: OverflowPolicy = "truncate",
        reply_reserve: int = DEFAULT_REPLY_RESERVE,
        config: GenerationConfig | None = None,
        max_queue: int | None = None,
        prefix_cache: bool | None = None,
        prefix_cache_tokens: int | None = None,
    ) -> None:
        if not isinstance(model, Model):
            raise TypeError("Engine() takes a loaded Model; use Engine.open(name or folder)")
        self.model = model
        self.tokenizer = self.model.tokenizer
        warm_up = getattr(self.tokenizer, "warm_up", None)
        if warm_up is not None:  # a lazily built tokenizer: pay at load, not at the first reply
            warm_up()
        self.vocab_size = int(self.model.meta.get("vocab_size") or self.tokenizer.vocab_size)
        model_dir = self.model.model_dir
        if isinstance(template, ConversationTemplate):
            self.template = template
        else:
            self.template = resolve_template(model_dir, template, self.model.meta.get("template"))
        stops = self.template.stops(self.tokenizer, model_dir)
        self.stop_token_ids = frozenset([*stops.token_ids, *self.model.eos_token_ids])
        self.stop_strings = stops.strings
        # A reasoning model's replies are split into thinking and answer (reasoning.py).
        self.thinks = model_thinks(self.template, self.tokenizer)
        self.think_tags = ThinkTags.of(self.tokenizer)
        self.harmony_tokens = HarmonyTokens.of(self.tokenizer)  # gpt-oss: channels, not tags
        limit = min(self.model.context_window_size, self.model.max_total_tokens)
        self.context_window = _check_window(context_window, limit) or limit
        check_policy(overflow)
        self.overflow: OverflowPolicy = overflow
        if (
            isinstance(reply_reserve, bool)
            or not isinstance(reply_reserve, int)
            or reply_reserve < 0
        ):
            raise InvalidRequestError(
                f"reply_reserve must be an integer >= 0, got {reply_reserve!r}", "reply_reserve"
            )
        self.reply_reserve = reply_reserve
        self.config = (config or GenerationConfig.from_model_defaults(model_dir)).validate(
            self.vocab_size
        )
        add_bos = bool(self.model.meta.get("add_bos"))
        bos = self.model.meta.get("bos_token_id")
        self.scheduler = Scheduler(
            self.model,
            max_queue=max_queue,
            prefix_cache=prefix_cache,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        self.planner = PromptPlanner(
            self.template,
            self.tokenizer,
            context_window=self.context_window,
            reply_reserve=reply_reserve,
            bos_token_id=int(bos) if add_bos and bos is not None else None,
            # Rolling a conversation back is part of the prefix cache: off with it, so that
            # switching it off restores plain re-prefill everywhere.
            rollback=self.scheduler.cache is not None and self.model.supports_rollback,
        )
        self._grammars: GrammarCache | None = None

    @property
    def grammars(self) -> GrammarCache:
        """The compiled response formats of this model's tokenizer (an LRU, built lazily)."""
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._grammars

    def constraint_for(
        self, config: GenerationConfig, stop_token_ids: frozenset[int]
    ) -> TokenConstraint | None:
        """A fresh token constraint for a reply under `config`'s response format (None: free
        text); InvalidRequestError naming the problem when the schema or grammar does not
        compile."""
        fmt = config.structured_format()
        if fmt is None:
            return None
        compiled = self.grammars.compile(fmt)
        return TokenConstraint(compiled, self.vocab_size, stop_token_ids)

    @classmethod
    def open(
        cls,
        ref: str | Path,
        *,
        device: str = "auto",
        template: str | None = None,
        context_window: int | None = None,
        overflow: OverflowPolicy = "truncate",
        reply_reserve: int = DEFAULT_REPLY_RESERVE,
        config: GenerationConfig | None = None,
        options: Mapping[str, Any] | None = None,
        max_batch_size: int = 8,
        max_queue: int | None = None,
        prefix_cache: bool | None = None,
        prefix_cache_tokens: int | None = None,
        log: Callable[[str], None] | None = None,
    ) -> Engine:
        """A ready engine for a store name (`name` or `name:quant`) or a model directory.

        `options` override generation parameters over `config` (default: the model's own
        defaults). Everything a caller can get wrong (an unknown name, a bad option, template
        or window) is checked before the model is loaded; `log` gets progress lines, e.g.
        when the library must be compiled first.
        """
        model_dir = resolve_model_dir(ref)
        meta = md.load_config(model_dir)
        if md.embedding_settings(meta) is not None:
            # an embedding model: no template, window or generation options apply
            from localchat.engine.embedding import EmbeddingEngine

            return EmbeddingEngine.open_dir(model_dir, device=device, log=log)
        base = config or GenerationConfig.from_model_defaults(model_dir)
        cfg = base.replace(**dict(options)) if options else base.validate()
        cfg.validate(meta.get("vocab_size"))
        if template is not None:
            resolve_template(model_dir, template, meta.get("template"))
        _check_window(context_window, int(meta["context_window_size"]))
        check_policy(overflow)
        model = Model(
            model_dir,
            device,
            max_batch_size=max_batch_size,
            max_total_tokens=context_window,
            log=log,
        )
        return cls(
            model,
            template=template,
            context_window=context_window,
            overflow=overflow,
            reply_reserve=reply_reserve,
            config=cfg,
            max_queue=max_queue,
            prefix_cache=prefix_cache,
            prefix_cache_tokens=prefix_cache_tokens,
        )

    # -- public API --------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The model's name: its store name, else its directory's name (the folder above a
        store-style `<name>/<quantization>` directory)."""
        meta, path = self.model.meta, self.model.model_dir
        if meta.get("name"):
            return str(meta["name"])
        if path.name == meta.get("quantization") and path.parent.name:
            return path.parent.name
        return path.name

    def conversation(
        self,
        system: str | None = None,
        *,
        config: GenerationConfig | None = None,
        overflow: OverflowPolicy | None = None,
        think: bool | None = None,
    ) -> Conversation:
        """A new conversation (optionally with a system prompt) that keeps its state;
        `think` switches a reasoning model's thinking (None: its template's default)."""
        return Conversation(self, system=system, config=config, overflow=overflow, think=think)

    def chat(
        self,
        messages: Sequence[Message],
        config: GenerationConfig | None = None,
        *,
        overflow: OverflowPolicy | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        think: bool | None = None,
        **overrides: Any,
    ) -> ReplyStream:
        """A reply to `messages` on a fresh sequence, freed when it ends (e.g. for a server).

        `tools` (OpenAI function definitions) are rendered by a template that supports them;
        constrain the reply to a call with a "structural_tag" response format. `think` is the
        template's `enable_thinking` (None: its default).
        """
        cfg = self.resolve_config(config, overrides)
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if tools and not self.template.supports_tools:
            raise InvalidRequestError(
                f"the model's chat template ({self.template.name}) does not support tools", "tools"
            )
        plan = self.planner.plan(
            messages, cfg.max_tokens, overflow=overflow or self.overflow, tools=tools,
            think=self.thinking_switch(think),
        )
        return self.scheduler.submit(self.make_request(plan, cfg))

    def complete(
        self, prompt: str, config: GenerationConfig | None = None, **overrides: Any
    ) -> ReplyStream:
        """A continuation of raw text (no template); only the model's EOS tokens stop it."""
        cfg = self.resolve_config(config, overrides)
        if not isinstance(prompt, str):
            raise InvalidRequestError("the prompt must be a string", "prompt")
        ids = self.planner.encode(prompt, raw=True)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        self.planner.check_fits(len(ids), cfg.max_tokens, "the prompt")
        plan = PromptPlan([], prompt, ids, 0, False)
        request = self.make_request(plan, cfg, stop_token_ids=frozenset(self.model.eos_token_ids))
        request.stop_strings = cfg.stop
        request.splitter = None  # raw text: a `<think>` in it is the caller's to read
        return self.scheduler.submit(request)

    @property
    def is_embedding(self) -> bool:
        """Whether this engine embeds (an embedding model) rather than chats."""
        return False

    def embed(self, inputs: Any, *, dimensions: int | None = None,
              truncate: bool = True) -> Embeddings:
        """Vectors of texts: only an embedding model's engine makes them (see
        `engine.embedding.EmbeddingEngine.embed`); a chat model raises InvalidRequestError."""
        raise InvalidRequestError(
            f"{self.name} is a chat model and makes no embeddings: open an embedding model "
            f"(e.g. all-minilm-l6-v2) for vectors", "model")

    def count_tokens(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        think: bool | None = None,
    ) -> int:
        """Tokens of the prompt for `messages` (with the generation prompt) from scratch."""
        return self.planner.count(messages, tools=tools, think=think)

    def close(self) -> None:
        """Cancel running replies, stop the scheduler thread and free all sequences."""
        self.scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for conversations -------------------------------------------------------------------
    def resolve_config(
        self, config: GenerationConfig | None, overrides: Mapping[str, Any]
    ) -> GenerationConfig:
        """`config` (default: the engine's) with `overrides` applied, validated for this model."""
        cfg = config or self.config
        if overrides:
            cfg = cfg.replace(**overrides)
        return cfg.validate(self.vocab_size)

    def make_request(
        self,
        plan: PromptPlan,
        config: GenerationConfig,
        *,
        seq: ModelSequence | None = None,
        owner: SequenceOwner | None = None,
        stop_token_ids: frozenset[int] | None = None,
    ) -> Request:
        """The scheduler request for a planned prompt."""
        stops = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        stops = stops | frozenset(config.stop_token_ids)
        return Request(
            prompt_ids=plan.new_ids,
            config=config,
            stop_token_ids=stops,
            stop_strings=tuple(dict.fromkeys([*self.stop_strings, *config.stop])),
            window=self.context_window,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            seq=seq,
            reset=plan.reset,
            rollback=plan.rollback,
            owner=owner,
            prompt_text=plan.text,
            reused_tokens=plan.reused,
            dropped_messages=plan.dropped,
            constraint=self.constraint_for(config, stops),
            splitter=self.splitter_for(plan.text),
        )

    def thinking_switch(self, think: Any) -> bool | None:
        """A request's thinking switch, checked: None or a bool, and True only for a model that
        thinks (InvalidRequestError otherwise, as Ollama answers)."""
        think = check_think(think)
        if think and not self.thinks:
            raise InvalidRequestError(
                f"{self.name} does not think before answering (its chat template writes no "
                f"<think> block): leave thinking unset or off", "think")
        return think

    def splitter_for(self, prompt: str) -> Splitter | None:
        """The thinking/answer splitter of a reply to `prompt` (None: the model does not
        think); the reply starts inside the thinking when the prompt opened the block. A
        harmony model (gpt-oss) gets a HarmonySplitter: its channels, not think tags."""
        if not self.thinks:
            return None
        if self.harmony_tokens is not None:
            return HarmonySplitter(self.harmony_tokens, prompt=prompt)
        return ReasoningSplitter(self.think_tags, opened=prompt_opens_thinking(prompt))


def _check_window(context_window: int | None, limit: int) -> int | None:
    """`context_window` when it is None or an integer in [2, limit]; else InvalidRequestError."""
    if context_window is None:
        return None
    if isinstance(context_window, bool) or not isinstance(context_window, int):
        raise InvalidRequestError(
            f"context_window must be an integer, got {context_window!r}", "context_window"
        )
    if not 2 <= context_window <= limit:
        raise InvalidRequestError(
            f"context_window must be in [2, {limit}], got {context_window}", "context_window"
        )
    return context_window


__all__ = ["Conversation", "Engine", "resolve_model_dir"]
