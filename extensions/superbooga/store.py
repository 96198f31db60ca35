"""The document store: chunks in SQLite, their MiniLM embeddings in a sqlite-vec index, in one file."""

from __future__ import annotations

import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.embeddings import DIMENSIONS, ENCODER


@dataclass
class Hit:
    """A retrieved chunk."""

    text: str
    document: str
    distance: float


def chunk_text(text: str, size: int = 700, overlap: int = 100) -> list[str]:
    """Split text into chunks of about ``size`` characters on paragraph and sentence boundaries."""
    text = re.sub(r"[ \t]+", " ", text.replace("\r\n", "\n")).strip()
    if not text:
        return []
    pieces = [p.strip() for p in re.split(r"\n\s*\n|(?<=[.!?])\s+", text) if p.strip()]
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        while len(piece) > size:  # a very long sentence: cut it
            head, piece = piece[:size], piece[size - overlap :]
            if current:
                chunks.append(current)
                current = ""
            chunks.append(head)
        if current and len(current) + 1 + len(piece) > size:
            chunks.append(current)
            tail = current[-overlap:] if overlap else ""
            current = (tail[tail.find(" ") + 1 :] + " " if " " in tail else "") + piece
        else:
            current = f"{current} {piece}" if current else piece
    if current:
        chunks.append(current)
    return chunks


def _blob(vector: list[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


class DocumentStore:
    """Add, search, list and delete documents. Thread-safe; the database is created on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.RLock()
        self._conn: Any = None

    def _db(self) -> Any:
        if self._conn is None:
            import apsw
            import sqlite_vec

            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = apsw.Connection(str(self.path))
            conn.enable_load_extension(True)
            conn.load_extension(sqlite_vec.loadable_path())
            conn.enable_load_extension(False)
            conn.execute(
                "create table if not exists documents (id integer primary key, name text not null, added real not null);"
                "create table if not exists chunks (id integer primary key, document_id integer not null, text text not null);"
                f"create virtual table if not exists chunk_vectors using vec0(embedding float[{DIMENSIONS}]);"
            )
            self._conn = conn
        return self._conn

    def add(self, name: str, text: str, chunk_size: int = 700) -> int:
        """Chunk, embed and store a document; returns the number of chunks."""
        chunks = chunk_text(text, chunk_size, overlap=min(100, chunk_size // 5))
        if not chunks:
            raise ValueError(f"{name} holds no text")
        vectors = ENCODER.encode(chunks).vectors
        with self._lock:
            db = self._db()
            with db:  # one transaction: a document is stored whole or not at all
                db.execute("insert into documents(name, added) values (?, ?)", (name, time.time()))
                doc_id = db.last_insert_rowid()
                for chunk, vector in zip(chunks, vectors, strict=True):
                    db.execute("insert into chunks(document_id, text) values (?, ?)", (doc_id, chunk))
                    chunk_id = db.last_insert_rowid()
                    db.execute("insert into chunk_vectors(rowid, embedding) values (?, ?)", (chunk_id, _blob(vector)))
        return len(chunks)

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The ``k`` chunks closest to the query."""
        if not query.strip():
            return []
        vector = ENCODER.encode([query]).vectors[0]
        with self._lock:
            rows = (
                self._db()
                .execute(
                    "select c.text, d.name, v.distance from chunk_vectors v "
                    "join chunks c on c.id = v.rowid join documents d on d.id = c.document_id "
                    "where v.embedding match ? and k = ? order by v.distance",
                    (_blob(vector), int(k)),
                )
                .fetchall()
            )
        return [Hit(text=t, document=n, distance=float(d)) for t, n, d in rows]

    def documents(self) -> list[tuple[int, str, int]]:
        """(id, name, chunk count) of every document."""
        with self._lock:
            return [
                (int(i), str(n), int(c))
                for i, n, c in self._db().execute(
                    "select d.id, d.name, count(c.id) from documents d left join chunks c on c.document_id = d.id "
                    "group by d.id order by d.id"
                )
            ]

    def delete(self, doc_id: int) -> None:
        """Remove a document and its chunks."""
        with self._lock:
            db = self._db()
            with db:
                ids = [r[0] for r in db.execute("select id from chunks where document_id = ?", (doc_id,))]
                for chunk_id in ids:
                    db.execute("delete from chunk_vectors where rowid = ?", (chunk_id,))
                db.execute("delete from chunks where document_id = ?", (doc_id,))
                db.execute("delete from documents where id = ?", (doc_id,))

    def clear(self) -> None:
        """Remove every document."""
        for doc_id, _, _ in self.documents():
            self.delete(doc_id)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
