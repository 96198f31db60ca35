"""Chat: templates, prompt building (modes, truncation), characters and the history store."""
