"""Image generation: text-to-image with a local diffusers pipeline folder from models/.

- In the chat, a message starting with ``/image`` (``params['trigger']``) answers with a picture.
- The Image generation tab makes pictures from a prompt.
- ``POST /v1/images/generations`` (OpenAI's images API) returns them as ``b64_json`` or as a URL served at
  ``/v1/images/files/ID.png``. Bounds for every caller (a 400 naming the field beyond them): ``n`` 1..8,
  ``steps`` 1..150, ``size`` multiples of 8 up to 1024x1024. A ``model`` other than the pipeline in use switches
  pipelines, which needs the admin key (403 otherwise).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import FileResponse

params: dict[str, Any] = {
    "display_name": "Image generation",
    "is_tab": True,
    "model": "",  # a diffusers pipeline folder in models/; empty: the first one found
    "width": 512,
    "height": 512,
    "steps": 20,
    "trigger": "/image",
}


def _model(name: str | None = None) -> str:
    from extensions.image_generation.generator import pipelines

    chosen = name or params.get("model") or next(iter(pipelines()), "")
    if not chosen:
        from modules.errors import ModelNotFound

        raise ModelNotFound("no diffusers pipeline in models/ (a folder with model_index.json)")
    return str(chosen)


OPENAI_IMAGE_MODELS = ("dall-e-2", "dall-e-3", "gpt-image-1")  # names clients send by default: the pipeline in use


def _in_use() -> str:
    """The pipeline a request without ``model`` gets: the one in memory, else the configured or first one."""
    from extensions.image_generation.generator import current_pipeline, pipelines

    return current_pipeline() or str(params.get("model") or next(iter(pipelines()), ""))


def _given(body: dict[str, Any], name: str, default: Any) -> Any:
    return default if body.get(name) is None else body[name]


def custom_generate_reply(
    question: str, original_question: str, state: dict[str, Any], stopping_strings: list[str], is_chat: bool
) -> Iterator[str] | None:
    """Answer a chat message that starts with the trigger with a generated picture."""
    text = str(state.get("user_input") or "") if is_chat else original_question
    trigger = str(params.get("trigger") or "/image")
    if not text.strip().startswith(trigger):
        return None
    prompt = text.strip()[len(trigger) :].strip()

    def reply() -> Iterator[str]:
        from extensions.image_generation.generator import generate

        pictures = generate(
            prompt, _model(), width=int(params["width"]), height=int(params["height"]), steps=int(params["steps"])
        )
        from extensions.image_generation.generator import image_path

        yield "\n".join(f"![{prompt}](/gradio_api/file={image_path(p.id + '.png')})" for p in pictures)

    return reply()


def api_routes(app: Any) -> None:
    """POST /v1/images/generations and GET /v1/images/files/{name}."""
    import anyio

    from extensions.image_generation import generator
    from extensions.openai.auth import is_admin, require_key
    from modules.errors import InvalidRequest

    @app.post("/v1/images/generations", dependencies=[Depends(require_key)])
    async def images_generations(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise InvalidRequest("the request body is not valid JSON") from exc
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise InvalidRequest("prompt is required", param="prompt")
        fmt = body.get("response_format") or "url"
        if fmt not in ("url", "b64_json"):
            raise InvalidRequest("response_format must be 'url' or 'b64_json'", param="response_format")
        width, height = generator.parse_size(body.get("size"), (int(params["width"]), int(params["height"])))
        n = generator.bounded_int(_given(body, "n", 1), "n", 1, generator.MAX_N)
        steps = generator.bounded_int(_given(body, "steps", params["steps"]), "steps", 1, generator.MAX_STEPS)
        seed = generator.bounded_int(body["seed"], "seed", -1, 2**63 - 1) if body.get("seed") is not None else None
        asked = body.get("model")
        asked = None if asked in (None, "", *OPENAI_IMAGE_MODELS) else asked
        if asked is not None and asked != _in_use() and not is_admin(request):
            from extensions.openai.errors import APIError

            raise APIError(
                403,
                f"switching the image pipeline to {asked!r} needs the admin key (--admin-key); leave out 'model' "
                f"to use {_in_use() or 'the default pipeline'}",
                type_="permission_error",
                param="model",
                code="admin_key_required",
            )
        model = _model(asked)
        pictures = await anyio.to_thread.run_sync(
            lambda: generator.generate(
                body["prompt"],
                model,
                n=n,
                width=width,
                height=height,
                steps=steps,
                seed=seed,
                negative_prompt=body.get("negative_prompt"),
            )
        )
        base = str(request.base_url).rstrip("/")
        data = [
            {"b64_json": base64.b64encode(p.png).decode("ascii")}
            if fmt == "b64_json"
            else {"url": f"{base}/v1/images/files/{p.id}.png"}
            for p in pictures
        ]
        return {"created": int(time.time()), "data": [{**d, "revised_prompt": body["prompt"]} for d in data]}

    @app.get("/v1/images/files/{name}", dependencies=[Depends(require_key)])
    async def images_file(name: str) -> FileResponse:
        path = generator.image_path(name)
        if not path.is_file():
            from modules.errors import ModelNotFound

            raise ModelNotFound(f"no image named {name!r}")
        return FileResponse(path, media_type="image/png")


def ui() -> None:
    """Prompt, size, steps and seed; the pictures in a gallery."""
    import gradio as gr

    from extensions.image_generation import generator
    from modules.errors import TextgenError

    def run(
        request: gr.Request, prompt: str, model: str, width: float, height: float, steps: float, seed: float
    ) -> list[str]:
        from modules.ui.admin import NOT_ADMIN, is_ui_admin, username

        if model and model != _in_use() and not is_ui_admin(request):  # the API's rule: switching is admin work
            raise gr.Error(NOT_ADMIN.format(action="switch the image pipeline", user=username(request) or "a guest"))
        try:
            pictures = generator.generate(
                prompt, _model(model or None), width=int(width), height=int(height), steps=int(steps), seed=int(seed)
            )
        except TextgenError as exc:
            raise gr.Error(str(exc)) from exc
        return [str(p.path) for p in pictures]

    run.__annotations__["request"] = gr.Request  # resolved here: Gradio finds the request by it (gr is local)

    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(label="Prompt", lines=3, elem_id="image-prompt")
            model = gr.Dropdown(
                generator.pipelines(),
                value=params["model"] or None,
                label="Pipeline (models/)",
                allow_custom_value=True,
            )
            width = gr.Slider(64, 1024, value=params["width"], step=8, label="Width")
            height = gr.Slider(64, 1024, value=params["height"], step=8, label="Height")
            steps = gr.Slider(1, 100, value=params["steps"], step=1, label="Steps")
            seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)")
            button = gr.Button("Generate", variant="primary", elem_id="image-generate")
        gallery = gr.Gallery(label="Pictures", elem_id="image-gallery")
    button.click(run, [prompt, model, width, height, steps, seed], gallery)
