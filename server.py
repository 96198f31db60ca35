"""textgen entry point: settings -> shared.init -> extensions -> app -> uvicorn."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from modules import extensions, fileio, jobs, models, shared
from modules.errors import TextgenError
from modules.logging_setup import setup_logging
from modules.settings import SettingsError, load_settings
from modules.web_guard import API_PREFIXES, WebOriginGuard

log = logging.getLogger("textgen")


def health() -> JSONResponse:
    """200 when a model is loaded and ready, 503 while one loads or when none is."""
    if shared.model is not None:
        engine = shared.model.stats().get("engine")
        if engine not in (None, "serving"):  # the engine behind it died (and may be starting again)
            return JSONResponse({"status": f"engine {engine}", "model": shared.model_name}, status_code=503)
        return JSONResponse({"status": "ok", "model": shared.model_name})
    if shared.loading_model:
        return JSONResponse({"status": "loading", "model": shared.loading_model}, status_code=503)
    return JSONResponse({"status": "no model loaded", "error": shared.load_error}, status_code=503)


def create_app() -> FastAPI:
    """The FastAPI app: extension routes (the OpenAI API among them), then the web UI at /."""
    app = FastAPI(title="textgen", docs_url=None, redoc_url=None)
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    extensions.collect("api_routes", app=app)
    if not shared.settings.nowebui:
        import gradio as gr

        from modules.chat.history import images_dir
        from modules.ui.admin import startup_warnings
        from modules.ui.app import build_ui, custom_css, custom_js

        auth = shared.settings.auth_pairs() or None
        for warning in startup_warnings(shared.settings):
            log.warning("%s", warning)
        app = gr.mount_gradio_app(
            app,
            build_ui(),
            path="",
            auth=auth,
            css=custom_css(),
            js=custom_js(),
            footer_links=[],
            run_history=False,
            ssr_mode=False,
            show_error=True,
            allowed_paths=[str(images_dir())],  # pictures attached to chat messages (random names)
            max_file_size=int(shared.settings.max_upload_mb * 2**20),
        )
    settings = shared.settings
    declared = [settings.listen_host] if settings.listen_host else []
    app.add_middleware(  # outermost: before the web UI and the API see anything
        WebOriginGuard,
        allowed_hosts=lambda: [*declared, *shared.settings.allowed_hosts],
        cors_origins=lambda: list(shared.settings.api_cors_origins),
        json_route=lambda path: path.startswith(API_PREFIXES),
    )
    return app


def load_startup_model(name: str) -> None:
    """Load the startup model; on failure log why and keep serving."""
    started = time.perf_counter()
    try:
        models.load_model(name)
    except TextgenError as exc:
        shared.loading_model, shared.load_error = None, str(exc)
        log.error("Could not load %s: %s", name, exc)
        return
    log.info("Model %s ready in %.2f s", name, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted."""
    try:
        loaded = load_settings(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = loaded.settings
    setup_logging(settings.verbose)
    # A native crash (llama.cpp, torch) prints every thread's stack; the log's last "Request ..." lines say
    # which model and requests were running.
    faulthandler.enable(all_threads=True)
    for note in loaded.notes:
        log.info("%s", note)
    shared.init(loaded)
    for folder in (shared.user_data_dir(), shared.models_dir(), shared.loras_dir()):
        fileio.remove_stale_temp_files(folder)  # what interrupted atomic writes left behind
    extensions.load_extensions(settings.startup_extensions())
    try:
        app = create_app()
    except SettingsError as exc:
        log.error("%s", exc)
        return 2

    import uvicorn

    if settings.model and settings.model.lower() != "none":
        shared.loading_model = settings.model
        threading.Thread(target=load_startup_model, args=(settings.model,), name="model-load", daemon=True).start()
    else:
        log.info("Starting without a model (load one in the Model tab)")
    host = settings.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    what = "API" if settings.nowebui else "web UI and API" if settings.api else "web UI (no API: --no-api)"
    ports = list(dict.fromkeys(p for p in (settings.listen_port, settings.api_port) if p))
    for port in ports:
        log.info("Serving the %s on http://%s:%d", what, shown, port)
    configs = [
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="debug" if settings.verbose else "warning",
            timeout_graceful_shutdown=2,
        )
        for port in ports
    ]
    sockets = [config.bind_socket() for config in configs]  # one server on every port (--api-port too)
    try:
        uvicorn.Server(configs[0]).run(sockets=sockets)
    finally:
        jobs.stop_process_jobs()  # training in a child process stops with a checkpoint, not killed mid-step
        models.unload_model()  # a model's own processes (a vLLM engine) end with the server
    return 0


if __name__ == "__main__":
    sys.exit(main())
