"""
Backends other than the local engine, behind engine/backend.py's Backend interface.

The local backend is decoding.Engine (engine/decoding/engine.py); open_backend (engine/factory.py) picks one.

- vllm.py: VllmBackend, a vLLM server over its OpenAI-compatible streaming API; VllmConfig, VllmPlan, VllmResult,
  VllmStatus. No torch at module level (grammar only for a constrained goal).
- vllm_stream.py: the HTTP calls and the server-sent event stream (stdlib only); ServerUnavailable.
- vllm_reply.py: tools and thinking on the server: the chat fields, the grammar of a whole reply, the streamed calls.
- vllm_metrics.py: the server's Prometheus counters and the speculation figures between two scrapes.
- vllm_server.py: a launcher for a local vLLM server (bench, tests and launch files; not the serving path), with
  vLLM's Gemma 4 tool-call and reasoning parsers when its vLLM has them.
"""
