"""The generate stage's room: the target regenerates every assistant turn. Backends: ``hf.py``
(transformers in a Ray Data actor pool; also the conversation walk every backend shares),
``engine.py`` (this project's continuous-batching engine), ``vllm_backend.py`` (``ray.data.llm``
on GPUs); ``reuse.py`` takes answers a run already made."""
