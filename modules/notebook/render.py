"""A cell's outputs as HTML for the page: text escaped, tracebacks without colour codes, images inline,
HTML outputs (pandas tables) through an allow-list so that an uploaded notebook cannot run script in the page."""

from __future__ import annotations

import base64
import binascii
import html
import re
from typing import Any

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_SHOWN = 200_000  # characters of one text output shown on the page (the file keeps them all)
ALLOWED_TAGS = {
    "a", "b", "blockquote", "br", "caption", "code", "col", "colgroup", "dd", "del", "div", "dl", "dt", "em",
    "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "kbd", "li", "ol", "p", "pre", "s", "samp", "small", "span",
    "strong", "sub", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "tt", "u", "ul",
}  # fmt: skip
DROP_WITH_CONTENT = {"script", "style", "iframe", "object", "embed", "template", "noscript", "svg", "math", "title"}
ALLOWED_ATTRS = {"class", "colspan", "rowspan", "align", "valign", "border", "title", "scope"}
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif")
BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes (IPython colours its tracebacks)."""
    return ANSI.sub("", text)


def sanitize_html(text: str) -> str:
    """HTML with only plain formatting and table tags (nh3, the Ammonia sanitizer): scripts, styles, handlers,
    links' targets and comments removed; the content of script-like tags dropped with them."""
    import nh3

    return nh3.clean(
        text,
        tags=ALLOWED_TAGS,
        attributes={"*": ALLOWED_ATTRS},
        clean_content_tags=DROP_WITH_CONTENT,
        link_rel=None,
        strip_comments=True,
    )


def _text(value: Any) -> str:
    text = "".join(value) if isinstance(value, list) else str(value)
    if len(text) > MAX_SHOWN:
        text = text[:MAX_SHOWN] + f"\n... ({len(text) - MAX_SHOWN} more characters)"
    return text


def _pre(text: str, kind: str) -> str:
    return f'<pre class="nb-{kind}">{html.escape(_text(text), quote=False)}</pre>'


def _image(mime: str, data: Any) -> str | None:
    encoded = "".join(data) if isinstance(data, list) else str(data)
    if not BASE64.fullmatch(encoded):
        return None
    try:
        base64.b64decode(encoded, validate=False)
    except (binascii.Error, ValueError):
        return None
    return f'<img class="nb-image" alt="{mime} output" src="data:{mime};base64,{"".join(encoded.split())}">'


def bundle_html(data: dict[str, Any]) -> str:
    """The richest safe view of a display_data/execute_result bundle."""
    for mime in IMAGE_TYPES:
        if mime in data:
            shown = _image(mime, data[mime])
            if shown:
                return shown
    if "image/svg+xml" in data:  # an <img> never runs an SVG's scripts
        encoded = base64.b64encode(_text(data["image/svg+xml"]).encode("utf-8")).decode("ascii")
        return f'<img class="nb-image" alt="SVG output" src="data:image/svg+xml;base64,{encoded}">'
    if "text/html" in data:
        return f'<div class="nb-html">{sanitize_html(_text(data["text/html"]))}</div>'
    if "text/markdown" in data:
        return _pre(data["text/markdown"], "text")
    if "text/plain" in data:
        return _pre(data["text/plain"], "text")
    return _pre(f"[output of type {', '.join(sorted(data)) or 'none'}]", "text")


def output_html(output: dict[str, Any]) -> str:
    """One nbformat output as HTML."""
    kind = output.get("output_type")
    if kind == "stream":
        return _pre(output.get("text", ""), "stderr" if output.get("name") == "stderr" else "stdout")
    if kind == "error":
        lines = output.get("traceback") or [f"{output.get('ename', 'Error')}: {output.get('evalue', '')}"]
        return _pre(strip_ansi("\n".join(lines)), "error")
    if kind in ("display_data", "execute_result"):
        shown = bundle_html(output.get("data") or {})
        if kind == "execute_result":
            count = output.get("execution_count")
            shown = f'<div class="nb-out-prompt">Out[{count if count is not None else " "}]:</div>{shown}'
        return shown
    return ""


def outputs_html(outputs: list[dict[str, Any]], note: str = "") -> str:
    """Every output of a cell as HTML (``note``, e.g. 'Running...', first)."""
    parts = [f'<div class="nb-note">{html.escape(note)}</div>'] if note else []
    parts += [output_html(o) for o in outputs]
    return f'<div class="nb-outputs">{"".join(parts)}</div>' if parts else ""


def code_html(code: str, title: str) -> str:
    """Code the model is writing, shown while it streams."""
    return f'<div class="nb-note">{html.escape(title)}</div><pre class="nb-proposed">{html.escape(code)}</pre>'


def error_text(outputs: list[dict[str, Any]]) -> str:
    """The cell's tracebacks as plain text (for the Fix prompt), empty if it did not fail."""
    return "\n".join(
        strip_ansi("\n".join(o.get("traceback") or [f"{o.get('ename')}: {o.get('evalue')}"]))
        for o in outputs
        if o.get("output_type") == "error"
    )


def plain_text(outputs: list[dict[str, Any]]) -> str:
    """A cell's outputs as text, for prompts: streams, text/plain results, tracebacks, [image] for pictures."""
    parts = []
    for output in outputs:
        kind = output.get("output_type")
        if kind == "stream":
            parts.append(_text(output.get("text", "")))
        elif kind == "error":
            parts.append(error_text([output]))
        else:
            data = output.get("data") or {}
            if any(mime.startswith("image/") for mime in data):
                parts.append("[image]")
            elif "text/plain" in data:
                parts.append(_text(data["text/plain"]))
    return "\n".join(p.rstrip("\n") for p in parts if p)
