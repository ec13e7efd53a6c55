"""``serve.engine``: the speculative decoding engine (no Ray, no HTTP); the rest of ``serve``: the
Ray Serve application around it (``app``, OpenAI protocol, asyncio front end, ``ServeConfig``, vLLM
backend)."""
