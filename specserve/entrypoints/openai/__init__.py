"""An OpenAI-compatible HTTP server (`specserve serve`) and its load generator (`specserve bench serve`)."""
