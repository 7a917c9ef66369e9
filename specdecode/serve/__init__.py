"""`specdecode serve`: an OpenAI-compatible server with continuous batching, paged KV caches,
per-request speculation with an automatic on/off policy, Prometheus metrics and a dashboard.
See README.md in this folder. Entry points: `server.build_state(llm, EngineConfig(...))` and
`app.create_app(state)`."""
