"""Gated hub repos (Llama, Gemma): say which licence to accept and where, and get a token.

The hub answers a gated repo's files (or listing) with HTTP 401 when no token is sent and 403
when the token's account has not accepted the licence; `hub.py` turns either into a
`GatedAccessError`. A pull from an interactive terminal with no token set (neither `HF_TOKEN`
nor the token `huggingface_hub` stored at `hf auth login`) then names the licence and the page
to accept it on and asks for a token, without echoing it, and pulls again with it; anywhere
else the pull fails with one line saying to set HF_TOKEN.
"""

from __future__ import annotations

import getpass
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from localchat.errors import AccessDeniedError

if TYPE_CHECKING:
    from localchat.downloader.hub import HubClient

T = TypeVar("T")
Say = Callable[[str], None]
AskToken = Callable[[str], str]

# the hub's licence ids of the gated recipes, as their owners name them
LICENCE_NAMES = {
    "llama2": "Llama 2 Community License",
    "llama3": "Meta Llama 3 Community License",
    "llama3.1": "Llama 3.1 Community License",
    "llama3.2": "Llama 3.2 Community License",
    "llama3.3": "Llama 3.3 Community License",
    "gemma": "Gemma Terms of Use",
}
LOGIN = "set HF_TOKEN or run `hf auth login`"


class GatedAccessError(AccessDeniedError):
    """The hub refused a gated repo: HTTP 401 (no token sent) or 403 (the token's account has
    not accepted the licence); `page` is where to accept it."""

    def __init__(self, message: str, *, repo_id: str, page: str, status: int | None) -> None:
        super().__init__(message)
        self.repo_id = repo_id
        self.page = page
        self.status = status

    @classmethod
    def from_status(cls, repo_id: str, page: str, status: int | None,
                    licence: str | None = None) -> GatedAccessError:
        """The one-line error for `status`, naming the licence when it is known."""
        what = f"{repo_id} is a gated repo" + (f" ({licence_name(licence)})" if licence else "")
        if status == 403:
            message = (f"{what} and your token has no access (HTTP 403): accept the licence "
                       f"or request access at {page} with that account, or {LOGIN} with an "
                       f"account that has it")
        else:
            message = (f"{what} (HTTP {status}): accept its licence at {page}, then {LOGIN}")
        return cls(message, repo_id=repo_id, page=page, status=status)

    def with_licence(self, licence: str | None) -> GatedAccessError:
        """The same refusal, its message naming `licence` (a recipe's licence id)."""
        if not licence:
            return self
        return GatedAccessError.from_status(self.repo_id, self.page, self.status, licence)


def licence_name(licence: str) -> str:
    """A licence id as its owner names it ("llama3.1" -> "Llama 3.1 Community License")."""
    name = LICENCE_NAMES.get(licence.lower())
    return f"{name}, licence {licence}" if name else f"licence {licence}"


def token_is_set() -> bool:
    """Whether huggingface_hub has a token to send: HF_TOKEN, or one `hf auth login` stored."""
    if os.environ.get("HF_TOKEN", "").strip():
        return True
    from huggingface_hub import get_token

    return bool(get_token())


def interactive() -> bool:
    """Whether a person is at the terminal (stdin and stderr are terminals)."""
    return sys.stdin.isatty() and sys.stderr.isatty()


def ask_token(prompt: str) -> str:
    """Read a token from the terminal without echoing it."""
    return getpass.getpass(prompt, stream=sys.stderr).strip()


def _recipe_licence(ref: str) -> str | None:
    """The licence id of the recipe `ref` names, if it names one."""
    from localchat.downloader.pull import parse_source
    from localchat.errors import LocalchatError

    try:
        recipe = parse_source(ref).recipe
    except LocalchatError:
        return None
    return None if recipe.is_adhoc else (recipe.license or None)


def pull_with_token_prompt(ref: str, run: Callable[[HubClient | None], T], *, say: Say,
                           prompt: bool | None = None, ask: AskToken = ask_token) -> T:
    """`run(None)` (a pull with huggingface_hub's own token, if any); when a gated repo refuses
    it for want of a token and a person is at the terminal (`prompt`, default: stdin and stderr
    are terminals), name the licence and its page, ask for a token and `run` again with a hub
    client that sends it. Otherwise the refusal is raised, naming the recipe's licence."""
    licence = _recipe_licence(ref)
    try:
        return run(None)
    except GatedAccessError as exc:
        refused = exc.with_licence(licence)
        wanted = interactive() if prompt is None else prompt
        if exc.status == 403 or token_is_set() or not wanted:
            raise refused from None
    what = licence_name(licence) if licence else "its licence"
    endpoint = refused.page[: -len(refused.repo_id) - 1]
    say(f"{refused.repo_id} is gated: accept {what} at {refused.page} (signed in to the hub), "
        f"then give an access token of that account ({endpoint}/settings/tokens)")
    token = ask("Hugging Face token (not shown; Enter to cancel): ")
    if not token:
        raise refused
    say("token received; it is used for this pull only (set HF_TOKEN or run `hf auth login` "
        "to keep one)")
    from localchat.downloader.hub import HubClient

    try:
        return run(HubClient(endpoint=endpoint, token=token))
    except GatedAccessError as exc:  # the token's account has not accepted the licence
        raise exc.with_licence(licence) from None
