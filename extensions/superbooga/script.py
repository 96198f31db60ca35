"""Superbooga-style retrieval: add documents, and the chunks most relevant to each question go into the prompt.

Documents (text, Markdown, PDF, or pasted text) are split into chunks, embedded with the offline all-MiniLM-L6-v2
model and stored in a sqlite-vec index in ``user_data/superbooga/documents.sqlite``. For every chat message (and
raw prompt) the best chunks are placed before the question in the prompt; the history keeps the question alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from modules import shared

log = logging.getLogger(__name__)

params: dict[str, Any] = {
    "display_name": "Documents (superbooga)",
    "is_tab": True,
    "activate": True,
    "chunk_count": 3,
    "chunk_length": 700,
    "max_distance": 1.3,  # chunks farther than this from the question are left out (L2 on unit vectors)
    "template": "Use this information to answer.\n\n{context}\n\nQuestion: {question}",
}

_store: Any = None


def store() -> Any:
    """The document store (opened on first use)."""
    global _store
    if _store is None:
        from extensions.superbooga.store import DocumentStore

        _store = DocumentStore(shared.user_data_dir() / "superbooga" / "documents.sqlite")
    return _store


def add_text(name: str, text: str) -> int:
    """Add a document; returns its chunk count."""
    return int(store().add(name, text, int(params["chunk_length"])))


def add_file(path: Path) -> int:
    """Add a text, Markdown or PDF file."""
    from extensions.superbooga.documents import read_document

    return add_text(path.name, read_document(path))


def inject(question: str) -> str:
    """The question with the most relevant chunks before it (unchanged when nothing is relevant)."""
    if not params.get("activate") or not question.strip() or not store().documents():
        return question
    hits = [
        h for h in store().search(question, int(params["chunk_count"])) if h.distance <= float(params["max_distance"])
    ]
    if not hits:
        return question
    context = "\n\n".join(h.text for h in hits)
    log.debug("superbooga: %d chunks for %r", len(hits), question[:60])
    return str(params["template"]).format(context=context, question=question)


def input_modifier(string: str, state: dict[str, Any], is_chat: bool = False) -> str:
    """Put the relevant chunks before the user's question in the prompt."""
    return inject(string)


def ui() -> None:
    """Add documents (upload or paste), list and delete them, try a search."""
    import gradio as gr

    def listing() -> list[list[Any]]:
        return [[i, n, c] for i, n, c in store().documents()]

    def upload(files: list[str] | None) -> tuple[Any, str]:
        messages = []
        for file in files or []:
            try:
                messages.append(f"{Path(file).name}: {add_file(Path(file))} chunks")
            except ValueError as exc:
                messages.append(str(exc))
        return listing(), "\n".join(messages)

    def paste(name: str, text: str) -> tuple[Any, str]:
        try:
            count = add_text(name.strip() or "pasted text", text)
        except ValueError as exc:
            return listing(), str(exc)
        return listing(), f"added {count} chunks"

    def delete(doc_id: float | None) -> Any:
        if doc_id is not None:
            store().delete(int(doc_id))
        return listing()

    def search(query: str) -> str:
        return "\n\n---\n\n".join(
            f"**{h.document}** (distance {h.distance:.2f})\n\n{h.text}"
            for h in store().search(query, int(params["chunk_count"]))
        )

    with gr.Row():
        with gr.Column():
            files = gr.File(
                label="Text, Markdown or PDF files",
                file_count="multiple",
                file_types=[".txt", ".md", ".pdf"],
                elem_id="superbooga-files",
            )
            name = gr.Textbox(label="Name of pasted text")
            text = gr.Textbox(label="Paste text", lines=6, elem_id="superbooga-text")
            add = gr.Button("Add text", elem_id="superbooga-add")
            status = gr.Markdown(elem_id="superbooga-status")
        with gr.Column():
            table = gr.Dataframe(
                listing(), headers=["id", "document", "chunks"], interactive=False, elem_id="superbooga-docs"
            )
            doc_id = gr.Number(label="Document id to delete", precision=0)
            remove = gr.Button("Delete document")
            activate = gr.Checkbox(value=params["activate"], label="Add relevant chunks to prompts")
            count = gr.Slider(1, 10, value=params["chunk_count"], step=1, label="Chunks per question")
            query = gr.Textbox(label="Try a search")
            results = gr.Markdown()
    from modules.ui.admin import admin_only  # the document store and its settings are shared: admin work

    files.upload(admin_only("add documents")(upload), files, [table, status])
    add.click(admin_only("add documents")(paste), [name, text], [table, status])
    remove.click(admin_only("delete documents")(delete), doc_id, table)
    activate.change(admin_only("switch superbooga")(lambda value: params.update(activate=value)), activate)
    count.change(admin_only("change superbooga")(lambda value: params.update(chunk_count=int(value))), count)
    query.submit(search, query, results)
