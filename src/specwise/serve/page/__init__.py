"""The page ``specwise serve`` shows at ``/``: one self-contained HTML file (no build step, nothing
fetched from elsewhere) that streams a request through the server's own OpenAI endpoints and
colours each token by where it came from (``speculative.origins``, docs/serve.md)."""

from __future__ import annotations

import json
from importlib import resources

from specwise.targets.chat import has_chat_template

#: where the page's settings go (a JavaScript literal the page reads at load)
_SLOT = "/*SPECWISE_CONFIG*/null"


def page_html(target, model: str, methods: tuple[str, ...], default_method: str, max_tokens_cap: int,
              api_key_required: bool) -> str:
    """The page for this server: its model, whether it chats (the target has a chat template) or
    completes, the methods a request may name, and whether the page must ask for the API key."""
    settings = {"model": model, "chat": has_chat_template(getattr(target, "tokenizer", None)),
                "methods": list(methods), "default_method": default_method, "max_tokens_cap": max_tokens_cap,
                "api_key_required": api_key_required}
    html = resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")
    # "</" cannot end the script early inside a JSON string once escaped
    return html.replace(_SLOT, json.dumps(settings).replace("</", "<\\/"), 1)
