"""Read the text of an uploaded document: plain text, Markdown or PDF."""

from __future__ import annotations

from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".csv", ".json", ".html", ".py")


def read_document(path: Path) -> str:
    """The text of ``path``; raises ValueError for an unsupported or unreadable file."""
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError

        try:
            reader = PdfReader(str(path))
            return "\n\n".join(page.extract_text() or "" for page in reader.pages)
        except (PdfReadError, OSError, ValueError) as exc:
            raise ValueError(f"{path.name} is not a readable PDF: {exc}") from exc
    if suffix in TEXT_SUFFIXES or not suffix:
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            return path.read_text(encoding="latin-1")
    raise ValueError(f"{path.name}: unsupported file type {suffix}; use text, Markdown or PDF")
