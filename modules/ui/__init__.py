"""The Gradio web UI: one module per tab, assembled by ui/app.py. No business logic here."""
