"""The OpenAI wire format: request and response bodies, chat templates, and the parsers that
split model output into content, reasoning and tool calls. No HTTP server, no Ray here."""
