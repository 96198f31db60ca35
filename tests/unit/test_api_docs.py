"""docs/api.md documents every route and every extra field the API accepts."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from extensions.openai.protocol import OPENAI_SHAPED, TextgenExtras
from extensions.openai.routes import install
from modules.generation.params import GenerationParams

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def test_every_extra_field_is_documented() -> None:
    for name in GenerationParams.field_names():
        if name not in OPENAI_SHAPED:
            assert f"`{name}`" in DOC, name
    for name in TextgenExtras.model_fields:
        assert f"`{name}`" in DOC, name


def test_every_route_is_documented() -> None:
    app = FastAPI()
    install(app)
    api_paths = {p for p in app.openapi()["paths"] if p.startswith("/v1/")} | {"/metrics"}
    assert len(api_paths) > 20
    for path in api_paths:
        shown = path.replace("{model_id}", "{id}").replace("{response_id}", "{id}")
        assert shown in DOC, path
